"""Build packages/<name>/ into packages/<name>/build/<variant>/ the way kernel-builder would.

Reads the package's build.toml and ggml-build.toml (package_spec.py), compiles the torch binding, the
backend sources and the shared glue in common/ against the torch of the running interpreter, links
them against nothing of ggml's (the extension loads ggml's runtime, tools/build/ggml_runtime.py, at
first use), checks the ABI and lays out the variant folder that `kernels` loads:

    __init__.py ... (torch-ext/<py_name>/*)   _ops.py   metadata.json   _<id>.abi3.so
    _ggml_runtime.py (common/python: Python glue every package shares)
    libggml-kernels-cpu-<level>.so (one per x86-64 feature level)
    LICENSE (the repo's, MIT) and LICENSE.ggml (llama.cpp's, from the pinned sources: the binaries contain ggml)

A package whose build.toml has a `metal` kernel entry (`emulated = true` in ggml-build.toml: no Metal
device here) gets two more builds of that entry (BUILD_KINDS), the same Python API on CPU tensors with
the emulator's instrumentation (_metal_emu.py), never uploaded:
- build-metal-emu/<variant>/: upstream's Metal backend on the emulated device
  (libggml-kernels-metal-emu.so beside the extension instead of the CPU runtimes);
- build-mps-emu/<variant>/: the MPS backend and device layer of the darwin build on the Linux twin
  (tools/build/mps_runtime.py: libggml-kernels-metal-twin.so, the fake Metal framework and the
  Objective-C runtime it needs beside the extension, found by $ORIGIN).

    python -m tools.build                      # every package
    python -m tools.build ggml-quantization    # one package
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shutil
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools import REPO

from . import extension_cache, files, ggml_runtime, metal_runtime, package_spec, sanitize, upstream
from . import ninja_build as ninja
from .package_spec import PackageSpec

COMMON = REPO / "common"
LICENSE = REPO / "LICENSE"
UPSTREAM_LICENSE = "LICENSE.ggml"  # llama.cpp's own LICENSE, from the pinned sources (the binaries contain ggml)
COMMON_SOURCES = ["ggml_runtime.cpp", "ggml_torch.cpp"]  # every backend's


@dataclass(frozen=True)
class Backend:
    """A build.toml backend as built here: what ggml-build.toml must state of its kernels."""

    ggml: tuple[str, ...]  # the ggml runtime its extensions load
    emulated: bool  # built here only on CPU tensors, over an emulated device (no native toolchain)


BACKENDS = {
    "cpu": Backend(("ggml-base", "ggml-cpu"), False),
    # no Metal toolchain or device here: every metal build kind runs on CPU tensors and the emulator
    "metal": Backend(("ggml-base", "ggml-metal"), True),
}


@dataclass(frozen=True)
class Platform:
    """What a build kind needs beyond g++ and torch, made before its extension: link inputs built
    elsewhere (clang's objects), include folders and defines for its sources, the libraries that go
    beside the extension, the files of the checkout those inputs were made from (in the extension's
    key), and the toolchain that made them."""

    includes: tuple[Path, ...] = ()
    defines: tuple[str, ...] = ()
    objects: tuple[Path, ...] = ()
    ldflags: tuple[str, ...] = ()
    libraries: tuple[Path, ...] = ()
    sources: tuple[Path, ...] = ()
    toolchain: str = ""


@dataclass(frozen=True)
class BuildKind:
    """One way a build.toml backend is built here: packages/<name>/<folder>/<variant>/."""

    backend: str  # the build.toml backend whose kernels it builds
    folder: str
    tag: str  # in the extension id: _<py_name>_<tag>_<hash>
    # its part of common/: what every backend defines (ggml_torch.h's backend::, ggml_runtime.h's
    # backend_name / backend::load) and its own ops; no shared header names a backend
    sources: tuple[str, ...]
    python: tuple[str, ...]  # its Python glue in common/, beside the shared common/python/*.py
    dispatch_key: str  # torch dispatch key of its ops' tensors
    libraries: Callable[[Path], list[Path]]  # the ggml runtime's libraries in the runtime folder
    platform: Callable[[int | None], Platform] = lambda jobs: Platform()


@functools.cache  # brought up to date once per build run, not once per package (~12 s when nothing changed)
def mps_twin(jobs: int | None) -> Platform:
    """The MPS backend over the twin's runtime (tools/build/mps_runtime.py): the device layer on the
    fake Metal framework, whose "MPS tensors" are CPU tensors and whose dispatches run on its own
    emulator. On a Mac (darwin.py) the same backend takes MPS tensors and is named "metal"."""
    from . import mps_runtime

    runtime = mps_runtime.twin_runtime(jobs)
    fake = mps_runtime.out_dir() / mps_runtime.LIBRARY
    return Platform(
        includes=(COMMON / "metal" / "mps", mps_runtime.FAKE_DIR),
        defines=(f'GGML_KERNELS_MPS_RUNTIME="{runtime.name}"', "GGML_KERNELS_MPS_DEVICE=CPU",
                 'GGML_KERNELS_MPS_BACKEND_NAME="mps-emu"'),
        objects=(mps_runtime.platform_object(),),  # mps_platform.h on the twin (clang, metal-cpp)
        ldflags=(str(fake), f"-l:{mps_runtime.OBJC_RUNTIME}", "-Wl,-rpath,$$ORIGIN"),
        libraries=(runtime, fake, mps_runtime.objc_runtime()),
        sources=(mps_runtime.TWIN_PLATFORM,),
        toolchain=mps_runtime.clang_version())


# what both emulated Metal kinds' sources include of common/metal/ (in their extensions' keys): the
# part of the backend the emulated device's and the MPS layer's share, and the instrumentation ops
METAL_EMU_SHARED = ("metal/backend_core.h", "metal/emulator_ops.h")
BUILD_KINDS = {
    "cpu": BuildKind("cpu", "build", "cpu", ("cpu/cpu_backend.cpp",), (), "CPU", ggml_runtime.libraries),
    # upstream's Metal backend on the emulated device: CPU tensors, and the emulator's instrumentation
    "metal-emu": BuildKind("metal", "build-metal-emu", "metal_emu", (*METAL_EMU_SHARED, "metal/metal_backend.cpp", "metal/metal_emu_ops.cpp"),
                           ("metal/_metal_emu.py",), "CPU", lambda runtime: [runtime / metal_runtime.LIBRARY]),
    # the MPS backend and device layer (the darwin build's) on the Linux twin: CPU tensors as the
    # MPS storages, the instrumentation of the layer's log and the fake framework's emulator
    "mps-emu": BuildKind("metal", "build-mps-emu", "mps_emu", (*METAL_EMU_SHARED, "metal/mps/mps_backend.cpp", "metal/mps_emu/mps_emu_ops.cpp"),
                         ("metal/_metal_emu.py",), "CPU", lambda runtime: [], mps_twin),
}
# local verification libraries beside an extension, never uploaded: the emulated device's _Float16
# conversions (msl.h's half) take libgcc_s's GCC_12 helpers, beyond manylinux_2_28; the twin's
# fake framework and the Debian Objective-C runtime it needs
UNCHECKED_LIBRARIES = {metal_runtime.LIBRARY, "libggml-kernels-metal-twin.so", "libggml-kernels-fake-metal.so", "libobjc.so.4"}
CXXFLAGS = [
    # -fopenmp: at::parallel_for is inline and uses OpenMP pragmas; without it, it runs serially.
    # At run time the libgomp.so.1 that torch itself loads (torch/lib) serves them: one thread pool.
    "-std=gnu++20", "-O2", "-fPIC", "-pthread", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
    "-Wall", "-Wno-unused-function", "-include", str(COMMON / "glibc_compat.h"),
]
MANYLINUX = "manylinux_2_28"
PYTHON_ABI = "3.9"


def packages() -> list[str]:
    return sorted(p.name for p in (REPO / "packages").iterdir() if package_spec.is_package(p))


def torch_variant() -> str:
    """The CPU build's variant folder name for the running torch, by the integration's rule
    (locate.cpu_variant, read from this checkout's file): users find builds by it, so it is the one
    source. kernels 0.17.2 names variants only to match folders that exist (its naming is private)."""
    from tools.testing.kernel_testing import integration_locate

    return integration_locate().cpu_variant()


def hash_files(files, extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for f in sorted(files):
        h.update(str(f.relative_to(REPO)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:7]


def kinds_of(spec: PackageSpec) -> list[str]:
    """The build kinds a package gets: those of every backend its build.toml has kernels for."""
    return [name for name, kind in BUILD_KINDS.items() if spec.kernels_of(kind.backend)]


def build_package(name: str, jobs: int | None = None, check_abi: bool = True) -> list[Path]:
    """Every build kind of a package (build/ and, with a metal entry, build-metal-emu/ and build-mps-emu/)."""
    pkg = REPO / "packages" / name
    spec = package_spec.load(pkg)
    if "cpu" not in spec.general.get("backends", []) or not spec.kernels_of("cpu"):
        raise ValueError(f"{name}: build.toml declares no cpu backend")
    check_backends(spec)
    sanitize.refuse_checkout(REPO)
    runtime = ggml_runtime.build(jobs)
    return [_build_kind(spec, kind, runtime, jobs, check_abi) for kind in kinds_of(spec)]


def check_backends(spec: PackageSpec) -> None:
    """Every kernel's backend is one built here, with the runtime ggml-build.toml states, and
    emulated exactly when that backend's builds here are."""
    where = spec.folder / package_spec.GGML_BUILD_TOML
    for k in spec.kernels:
        backend = BACKENDS.get(k.backend)
        if backend is None:
            raise ValueError(f"{spec.folder / package_spec.BUILD_TOML}: [kernel.{k.name}]: backend {k.backend!r} is "
                             f"not built here (only {', '.join(BACKENDS)})")
        if k.ggml != backend.ggml:
            raise ValueError(f"{where}: [kernel.{k.name}]: ggml = {list(k.ggml)}, but a {k.backend} extension "
                             f"loads {list(backend.ggml)}")
        if k.emulated != backend.emulated:
            folders = ", ".join(f"{b.folder}/" for b in BUILD_KINDS.values() if b.backend == k.backend)
            raise ValueError(f"{where}: [kernel.{k.name}]: emulated = {str(k.emulated).lower()}: the {k.backend} "
                             f"kernels are built here only as {'the emulated builds' if backend.emulated else 'native code'} "
                             f"({folders}), emulated = {str(backend.emulated).lower()}")


def _build_kind(spec: PackageSpec, name: str, runtime: Path, jobs: int | None, check_abi: bool) -> Path:
    import torch
    from torch.utils import cpp_extension

    kind = BUILD_KINDS[name]
    platform = kind.platform(jobs)
    kernels = spec.kernels_of(kind.backend)
    pkg = spec.folder
    py_name = pkg.name.replace("-", "_")
    tree = upstream.ggml_tree()
    sources = [pkg / s for s in spec.torch["src"]]
    sources += list(dict.fromkeys(pkg / s for k in kernels for s in k.src))
    sources += [COMMON / s for s in (*COMMON_SOURCES, *kind.sources)]
    include_dirs = list(dict.fromkeys(pkg / d for k in kernels for d in k.include))
    headers = [p for p in sources if p.suffix == ".h"] + [h for d in include_dirs for h in sorted(d.glob("*.h"))]
    headers = list(dict.fromkeys(headers)) + sorted(COMMON.glob("*.h"))
    headers += [COMMON / "cpu" / "cpu_runtime_api.h", COMMON / "metal" / "metal_device_api.h",
                COMMON / "metal" / "emu" / "metal_emu_api.h"]
    headers += [h for d in platform.includes for h in sorted(d.glob("*.h"))]
    compiled = [p for p in sources if p.suffix in (".cpp", ".cc", ".c")]

    variant = torch_variant()
    recipe = torch.__version__ + "".join(sanitize.compile_flags())  # a sanitized build gets its own id
    ext_id = f"_{py_name}_{kind.tag}_{hash_files(sources + headers + list(platform.sources), recipe + kind.backend)}"
    work = pkg / kind.folder / ".ninja" / variant
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{tree / 'include'}", f"-I{COMMON}",
                 f"-I{pkg / 'torch-ext'}"]
    includes += [f"-I{d}" for d in [*include_dirs, *platform.includes]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = CXXFLAGS + sanitize.compile_flags() + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += [f"-DTORCH_EXTENSION_NAME={ext_id}", f"-DGGML_KERNELS_DISPATCH_KEY={kind.dispatch_key}"]
    flags += [f"-D{d}" for d in platform.defines]
    flags += includes
    torch_lib = Path(torch.__file__).parent / "lib"

    n = ninja.NinjaFile()
    n.rule("cxx", "g++ -MMD -MF $out.d $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("cc", "gcc -MMD -MF $out.d -std=gnu11 -O2 -fPIC -fvisibility=hidden -include "
           f"{COMMON / 'glibc_compat.h'} -c $in -o $out", "CC $out", depfile=True)
    n.rule("link", "g++ -shared -o $out $in $ldflags", "LINK $out")
    objs = []
    for src in compiled:
        obj = work / "obj" / (src.relative_to(REPO).as_posix().replace("/", "_") + ".o")
        n.build(obj, "cxx", src, variables={"flags": ninja.quote(flags)})
        objs.append(obj)
    compat_sources = {COMMON / "glibc_compat.c": "cc", COMMON / "glibcxx_compat.cpp": "cxx"}
    for src, rule in compat_sources.items():
        obj = work / "obj" / (src.name + ".o")
        n.build(obj, rule, src, variables={"flags": ninja.quote(CXXFLAGS)})
        objs.append(obj)
    so = work / f"{ext_id}.abi3.so"
    ldflags = [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-lgomp", "-Wl,-z,noexecstack", "-ldl"]
    ldflags += sanitize.link_flags() + list(platform.ldflags)
    n.build(so, "link", [*objs, *platform.objects], variables={"ldflags": ninja.quote(ldflags)})
    n.write(work / "build.ninja")
    toolchain = extension_cache.running_torch()
    if platform.toolchain:
        toolchain = extension_cache.Toolchain(f"{toolchain.identity}; {platform.toolchain}", toolchain.machine_paths)
    extension_cache.build(so, work, n, [*compiled, *compat_sources, *platform.sources], jobs, toolchain)

    out = pkg / kind.folder / variant
    glue = python_glue(kind)
    libraries = [*kind.libraries(runtime), *platform.libraries]
    assemble(out, pkg / "torch-ext" / py_name, so, libraries, glue, ext_id, spec.general)
    for module in glue:
        files.copy_if_changed(module, out / module.name)
    if check_abi:
        check_binaries(out)
    return out


def python_glue(kind: BuildKind) -> list[Path]:
    """The Python modules of common/ a build of this kind carries: those every package shares
    (common/python/) and the backend's own (the emulator's instrumentation in emulated builds only)."""
    return sorted((COMMON / "python").glob("*.py")) + [COMMON / p for p in kind.python]


def assemble(out: Path, py_src: Path, so: Path, runtime_libs: list[Path], glue: list[Path], ext_id: str,
             general: dict, backend: str = "cpu") -> None:
    """The variant folder kernels loads (every build kind's, the darwin one's too): `backend` is
    metadata.json's backend type."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = {so.name} | {lib.name for lib in runtime_libs} | {"_ops.py", "metadata.json", LICENSE.name, UPSTREAM_LICENSE}
    wanted |= {p.name for p in glue}
    for f in sorted(py_src.rglob("*.py")):
        rel = f.relative_to(py_src)
        wanted.add(rel.parts[0])
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        files.copy_if_changed(f, out / rel)
    for f in [so, *runtime_libs, LICENSE]:
        files.copy_if_changed(f, out / f.name)
    files.copy_if_changed(upstream.upstream_license(), out / UPSTREAM_LICENSE)
    for stale in out.iterdir():  # an older extension id, a removed module, a dropped CPU level
        if stale.name not in wanted:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    ops = (
        "import torch\n\n"
        f"from . import {ext_id}\n\n"
        f"ops = torch.ops.{ext_id}\n\n\n"
        "def add_op_namespace_prefix(op_name: str) -> str:\n"
        f'    """Prefix op by namespace."""\n'
        f'    return f"{ext_id}::{{op_name}}"\n'
    )
    files.write_if_changed(out / "_ops.py", ops)
    metadata = {
        "name": general["name"],
        "id": ext_id,
        "version": general["version"],
        "license": general["license"],
        "upstream": general.get("upstream"),
        "python-depends": general.get("python-depends", []),
        "backend": {"type": backend},
    }
    files.write_if_changed(out / "metadata.json", json.dumps({k: v for k, v in metadata.items() if v is not None}, indent=2) + "\n")


def check_binaries(variant_dir: Path, required: bool = False) -> None:
    """kernel-abi-check's rules: manylinux_2_28 symbols, Python abi3 >= 3.9. Without the package
    installed, says so and checks nothing, or (required) raises."""
    try:
        import kernel_abi_check
    except ImportError:
        if required:
            raise RuntimeError("kernel-abi-check is not installed: pip install kernel-abi-check") from None
        print("[build] kernel-abi-check not installed; ABI not checked", file=sys.stderr)
        return
    problems = []
    for so in sorted(variant_dir.glob("*.so")):
        if so.name in UNCHECKED_LIBRARIES:
            continue
        obj = kernel_abi_check.ObjectFile(str(so))
        bad = list(obj.check_manylinux(MANYLINUX))
        if so.name.endswith(".abi3.so"):
            bad += list(obj.check_python_abi(PYTHON_ABI))
        problems += [f"{so.name}: {b}" for b in bad]
    if problems:
        raise RuntimeError("ABI check failed:\n  " + "\n  ".join(problems))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", help="package folder names (default: all)")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    ap.add_argument("--no-abi-check", action="store_true")
    args = ap.parse_args()
    for name in args.packages or packages():
        for out in build_package(name, args.jobs, check_abi=not args.no_abi_check):
            print(out.relative_to(REPO))


if __name__ == "__main__":
    main()

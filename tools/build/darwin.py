"""Cross-build every package's Metal variant for macOS arm64 on Linux: torch<XY>-metal-aarch64-darwin.

    python -m tools.build.darwin [PACKAGE ...] [--torch 2.13.0 ...]      (nox -s build-darwin)

With the toolchain of darwin_toolchain.py (zig, the macOS torch wheels, metal-cpp, our stubs), for
each torch version:
- the Metal runtime, libggml-kernels-metal.dylib (in the runtime cache, runtime-darwin/torch<XY>/):
  ggml-base and upstream's six Metal host C++ files as fetched, the supports_op slice cut from
  ggml-metal-device.m, the MPS device layer (common/metal/mps/: plain C++ over metal-cpp and torch's
  MPS API) and upstream's .metal source embedded as text (tools/build/metal_source.py; compiled
  with newLibraryWithSource at first use on the Mac). The emulator never goes in;
- each package's extension (its torch binding, its metal kernel sources of build.toml, common/'s
  glue), laid out like the Linux variants in packages/<name>/build/torch<XY>-metal-aarch64-darwin/
  with metadata backend {"type": "metal"};
- the link checks of macho_check.py over both (arm64, macOS minos <= 26.0, only torch's and Apple's
  libraries, every import exported by them, ad-hoc signed).

Nothing of this runs here: `nox -s publish` uploads a darwin variant only once a Mac has checked it
(mac-checked.json beside it; tools/publish.py). On a Mac, `nox -s mac` builds the same variants with the
Mac's own compiler, SDK and torch instead (tools/build/darwin_native.py, the `Compilers` it passes here).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools import REPO

from . import (
    build,
    darwin_toolchain,
    extension_cache,
    files,
    ggml_runtime,
    macho,
    macho_check,
    metal_runtime,
    metal_source,
    package_spec,
    upstream,
)
from . import ninja_build as ninja
from .darwin_toolchain import Toolchain, TorchMac

# zig's and the macOS torch's versions are in their cache paths, which the recipes name
MAC_TOOLCHAIN = extension_cache.Toolchain("zig c++ for aarch64-macos")
METAL_CPP_LICENSE = "LICENSE.metal-cpp"

COMMON = REPO / "common"
MPS_DIR = COMMON / "metal" / "mps"
LIBRARY = "libggml-kernels-metal.dylib"
# The MPS device layer and its darwin platform part (common/metal/mps/): a missing one is a build
# error naming it. The extension's side: the packages' MPS backend over the same platform part.
DEVICE_LAYER = ("metal_cpp_impl.cpp", "mps_device.cpp", "mps_context.cpp", "mps_platform_darwin.cpp")
DEVICE_API = COMMON / "metal" / "metal_device_api.cpp"  # takes every device function's address: a missing one fails the link
EXTENSION_BACKEND = (MPS_DIR / "mps_backend.cpp", MPS_DIR / "mps_platform_darwin.cpp")
SLICE_HEADER = "mps_device.h"  # defines the ggml_metal_device the supports_op slice reads
# libc++ as macOS 26 ships it: zig's driver turns libc++'s availability markers off
# (_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS=0), which would let newer headers call functions
# that the system's libc++ lacks; on, a call the deployment target does not have is a compile error.
LIBCXX_AVAILABILITY = ["-U_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS", "-D_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS=1"]
COMMON_FLAGS = ["-O2", "-fPIC", "-fvisibility=hidden", *LIBCXX_AVAILABILITY]
CXXFLAGS = ["-std=gnu++20", "-fvisibility-inlines-hidden", "-Wall", "-Wno-unused-function",
            # torch's MPSStream.h defines `nil` again after objc.h has
            "-Wno-macro-redefined"]
GGML_DEFINES = ["NDEBUG", "_XOPEN_SOURCE=600", "_DARWIN_C_SOURCE", "GGML_BUILD", "GGML_SHARED", "GGML_BACKEND_BUILD",
                "GGML_BACKEND_SHARED", "GGML_SCHED_MAX_COPIES=4"]
SYSTEM_STUBS = ("Metal", "Foundation", "libobjc", "libc++")


def variant_name(torch: TorchMac) -> str:
    """torch<XY>-metal-aarch64-darwin, by the integration's rule (locate.BACKENDS["mps"], read from
    this checkout's file): enable(backend="mps") finds the variants by it, so it is the one source."""
    from tools.testing.kernel_testing import integration_locate

    return integration_locate().BACKENDS["mps"].variant(torch.version)


def missing_sources() -> list[Path]:
    """The device layer's files the darwin build needs and the checkout lacks."""
    return [p for p in dict.fromkeys((*(MPS_DIR / f for f in DEVICE_LAYER), DEVICE_API, *EXTENSION_BACKEND)) if not p.is_file()]


@dataclass(frozen=True)
class Compilers:
    """How this machine compiles and links for macOS arm64: zig's cross toolchain with our stubs on
    Linux (cross()), or a Mac's own Apple clang, SDK and torch (tools/build/darwin_native.py)."""

    cc: str  # command prefixes; the rules add the flags, inputs and output
    cxx: str
    link: str  # a shared library from objects
    metal_cpp: Path
    includes: tuple[str, ...]  # besides metal-cpp's: the CoreFoundation / IOSurface stand-ins on Linux
    torch: dict[str, TorchMac]
    link_inputs: Callable[[TorchMac], list[str]]  # the libraries every link names
    link_deps: Callable[[TorchMac], list[Path]]  # files whose change relinks
    recipe_files: tuple[Path, ...]  # files of the checkout an extension's recipe reads besides its sources
    identity: extension_cache.Toolchain
    runtime_dir: Path
    # the link checks' tables for a torch version; None where the machine's own loader checks (a Mac)
    allowed: Callable[[str], dict[str, set[str]]] | None


def cross(tc: Toolchain) -> Compilers:
    zig = f"env {' '.join(f'{k}={v}' for k, v in tc.env().items())} {tc.zig}"
    target = f"-target {darwin_toolchain.TARGET}"
    # -nostdlib++: libc++ is the system's (our stub), never zig's own linked in statically
    return Compilers(f"{zig} cc {target}", f"{zig} c++ {target}", f"{zig} c++ {target} -shared -nostdlib++",
                     tc.metal_cpp, (f"-I{darwin_toolchain.SHIM_INCLUDE}",), tc.torch,
                     lambda torch: [str(p) for p in _stub_inputs(tc, torch)], lambda torch: _stub_inputs(tc, torch),
                     (darwin_toolchain.STUBS_TOML,), MAC_TOOLCHAIN, runtime_dir(),
                     lambda version: macho_check.libraries(tc, version))


def _rules(n: ninja.NinjaFile, c: Compilers) -> None:
    n.rule("cc", f"{c.cc} -MMD -MF $out.d -std=gnu11 $flags -c $in -o $out", "CC $out", depfile=True)
    n.rule("cxx", f"{c.cxx} -MMD -MF $out.d $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("link", f"{c.link} -o $out $in $ldflags", "LINK $out")


def _stub_inputs(tc: Toolchain, torch: TorchMac) -> list[Path]:
    return [tc.stubs / f"{name}.tbd" for name in SYSTEM_STUBS] + [torch.libs / f"{Path(lib).stem}.tbd" for lib in darwin_toolchain.TORCH_LIBS]


def _torch_includes(torch: TorchMac) -> list[str]:
    return [f"-I{torch.include}", f"-I{torch.include / 'torch' / 'csrc' / 'api' / 'include'}"]


def _ldflags(name: str) -> list[str]:
    return [f"-Wl,-install_name,@rpath/{name}", "-Wl,-rpath,@loader_path", "-Wl,-dead_strip_dylibs"]


def uses_torch(source: Path) -> bool:
    """Whether a source includes torch's headers (ATen, c10, torch): then it is compiled per torch."""
    return re.search(r"^\s*#\s*include\s*<(ATen|c10|torch)/", source.read_text(), re.M) is not None


def runtime_dir() -> Path:
    return upstream.ggml_tree().parent / "runtime-darwin"


def build_runtimes(tc: Compilers, jobs: int | None) -> dict[str, Path]:
    """libggml-kernels-metal.dylib per torch version (the device layer's platform part uses torch's
    MPS API); everything else in it is compiled once."""
    tree = upstream.ggml_tree()
    src, out = tree / "src", tc.runtime_dir
    gen = out / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    ggml_runtime.write_version_header(gen)
    metal_dir = src / "ggml-metal"
    slice_text = metal_runtime.slice_supports_op((metal_dir / "ggml-metal-device.m").read_text())
    files.write_if_changed(gen / "metal_supports_op.cpp", slice_text.replace(metal_runtime.SLICE_PRELUDE, (
        "// Cut from upstream's ggml-metal-device.m at build time by tools/build/darwin.py.\n"
        f'#include "{SLICE_HEADER}"\n#include "ggml-metal-common.h"\n#include "ggml-metal-impl.h"\n#include "ggml-impl.h"\n\n'), 1))
    metal_source.write(metal_dir, gen / "metal_source.cpp")

    n = ninja.NinjaFile()
    _rules(n, tc)
    ggml = COMMON_FLAGS + [f"-D{d}" for d in GGML_DEFINES] + [f"-I{tree / 'include'}", f"-I{src}", f"-I{gen}", "-w"]
    objs = []
    for s in ggml_runtime.BASE_SOURCES:
        obj = out / "obj" / (s.replace("/", "_") + ".o")
        n.build(obj, "cc" if s.endswith(".c") else "cxx", src / s, variables={"flags": ninja.quote(ggml + (["-std=gnu++17"] if not s.endswith(".c") else []))})
        objs.append(obj)
    # ggml-metal.cpp uses std::unique_ptr without including <memory>
    host = ggml + ["-std=gnu++17", f"-I{metal_dir}", f"-I{MPS_DIR}", "-include", "memory"]
    for s in metal_runtime.HOST_SOURCES:
        obj = out / "obj" / (Path(s).name + ".o")
        n.build(obj, "cxx", src / s, variables={"flags": ninja.quote(host)})
        objs.append(obj)
    layer = [gen / "metal_supports_op.cpp", gen / "metal_source.cpp", DEVICE_API, *(MPS_DIR / f for f in DEVICE_LAYER)]
    layer_flags = COMMON_FLAGS + CXXFLAGS + [f"-D{d}" for d in GGML_DEFINES] + [
        f"-I{tree / 'include'}", f"-I{src}", f"-I{metal_dir}", f"-I{gen}", f"-I{MPS_DIR}", f"-I{COMMON / 'metal'}",
        f"-I{tc.metal_cpp}", *tc.includes]
    # compiled once; those including torch's headers once per torch (its MPS API is C++)
    per_torch = [p for p in layer if uses_torch(p)]
    for path in layer:
        if path not in per_torch:
            obj = out / "obj" / (path.name + ".o")
            n.build(obj, "cxx", path, variables={"flags": ninja.quote(layer_flags)})
            objs.append(obj)
    libs = {}
    for version, torch in tc.torch.items():
        torch_objs = []
        for path in per_torch:
            obj = out / f"torch{torch.tag}" / "obj" / (path.name + ".o")
            n.build(obj, "cxx", path, variables={"flags": ninja.quote(layer_flags + _torch_includes(torch))})
            torch_objs.append(obj)
        lib = out / f"torch{torch.tag}" / LIBRARY
        n.build(lib, "link", objs + torch_objs, implicit=tc.link_deps(torch),
                variables={"ldflags": ninja.quote([*tc.link_inputs(torch), *_ldflags(LIBRARY)])})
        libs[version] = lib
    n.write(out / "build.ninja")
    ninja.run(out, jobs)
    return libs


def build_extension(spec: package_spec.PackageSpec, tc: Compilers, torch: TorchMac, runtime: Path, jobs: int | None) -> Path:
    """One package's darwin variant folder, checked."""
    import sysconfig

    pkg = spec.folder
    py_name = pkg.name.replace("-", "_")
    kernels = spec.kernels_of("metal")
    if not kernels:
        raise ValueError(f"{pkg / package_spec.BUILD_TOML}: no metal kernel: nothing to build for macOS")
    tree = upstream.ggml_tree()
    sources = [pkg / s for s in spec.torch["src"]]
    sources += list(dict.fromkeys(pkg / s for k in kernels for s in k.src))
    sources += [COMMON / s for s in build.COMMON_SOURCES] + list(EXTENSION_BACKEND)
    include_dirs = list(dict.fromkeys(pkg / d for k in kernels for d in k.include))
    headers = sorted({*(p for p in sources if p.suffix == ".h"), *(h for d in include_dirs for h in d.glob("*.h")),
                      *COMMON.glob("*.h"), *COMMON.glob("cpu/*.h"), *COMMON.glob("metal/*.h"),
                      *MPS_DIR.glob("*.h")})
    variant = variant_name(torch)
    ext_id = f"_{py_name}_metal_{build.hash_files(sources + headers, f'darwin {torch.version}')}"
    work = pkg / "build" / ".ninja" / variant
    # Python's headers for the limited API (abi3): declarations only, the same on every platform
    # for what Py_LIMITED_API exposes; the symbols bind at load time to the interpreter's.
    includes = [*_torch_includes(torch), f"-I{sysconfig.get_paths()['include']}", f"-I{tree / 'include'}", f"-I{COMMON}",
                f"-I{COMMON / 'metal'}", f"-I{MPS_DIR}", f"-I{pkg / 'torch-ext'}", *(f"-I{d}" for d in include_dirs),
                f"-I{tc.metal_cpp}", *tc.includes]
    flags = COMMON_FLAGS + CXXFLAGS + [f"-DTORCH_EXTENSION_NAME={ext_id}", "-DGGML_KERNELS_DISPATCH_KEY=MPS",
                                       f'-DGGML_KERNELS_MPS_RUNTIME="{LIBRARY}"', *includes]
    n = ninja.NinjaFile()
    _rules(n, tc)
    objs = []
    for src in (p for p in sources if p.suffix in (".cpp", ".cc")):
        obj = work / "obj" / (src.relative_to(REPO).as_posix().replace("/", "_") + ".o")
        n.build(obj, "cxx", src, variables={"flags": ninja.quote(flags)})
        objs.append(obj)
    so = work / f"{ext_id}.abi3.so"
    # Python's C API binds by flat lookup to the interpreter that imports the module
    ldflags = [*tc.link_inputs(torch), *_ldflags(so.name), "-Wl,-undefined,dynamic_lookup"]
    n.build(so, "link", objs, implicit=tc.link_deps(torch), variables={"ldflags": ninja.quote(ldflags)})
    n.write(work / "build.ninja")
    # the zig and macOS torch versions are in the recipe's paths; the stubs' symbols in stubs.toml
    compiled = [p for p in sources if p.suffix in (".cpp", ".cc")]
    extension_cache.build(so, work, n, [*compiled, *tc.recipe_files], jobs, tc.identity)
    allowed = tc.allowed(torch.version) if tc.allowed else None
    if allowed is not None:
        macho_check.check_file(so, allowed)  # before it lands in build/

    out = pkg / "build" / variant
    glue = build.python_glue(build.BUILD_KINDS["cpu"])  # common/python only: no emulator module
    # the runtime holds metal-cpp's compiled code (Apache-2.0): its licence travels with it
    notice = runtime.parent / METAL_CPP_LICENSE
    files.copy_if_changed(tc.metal_cpp / "LICENSE.txt", notice)
    build.assemble(out, pkg / "torch-ext" / py_name, so, [runtime, notice], glue, ext_id, spec.general, backend="metal")
    for module in glue:
        files.copy_if_changed(module, out / module.name)
    if allowed is not None:
        macho_check.check_variant(out, allowed)
    macho_check.check_macos_binaries(out, required=False)
    return out


def resolved_functions() -> list[str]:
    """The runtime's functions the extension looks up by name at load time (dlsym, which no linker
    checks): ggml_runtime.h's base and Metal lists, and the names the backend's sources pass to dlsym."""
    header = (COMMON / "ggml_runtime.h").read_text()
    names = []
    for macro in ("GGML_KERNELS_BASE_FUNCTIONS", "GGML_KERNELS_METAL_FUNCTIONS"):
        found = re.search(rf"#define {macro}\(X\)((?:[^\n]*\\\n)*[^\n]*)", header)  # to the first line without "\\"
        if found is None:
            raise RuntimeError(f"common/ggml_runtime.h: no #define {macro}(X) list")
        names += re.findall(r"X\((\w+)\)", found.group(1))
    for src in EXTENSION_BACKEND:
        names += re.findall(r'dlsym\(\s*\w+\s*,\s*"(\w+)"\s*\)', src.read_text())
    return list(dict.fromkeys(names))


def check_runtime_exports(lib: Path) -> None:
    """Raises naming every function the extension resolves by name that `lib` does not export."""
    exports = macho.read(lib).exports
    missing = [name for name in resolved_functions() if f"_{name}" not in exports]
    if missing:
        raise macho_check.LinkCheckError(f"{lib}: does not export {', '.join(missing)}, which the extension "
                                         "resolves by name when it loads the runtime (common/ggml_runtime.h, "
                                         f"{', '.join(p.name for p in EXTENSION_BACKEND)})")


def build_all(names: list[str], versions: tuple[str, ...], jobs: int | None = None,
              compilers: Callable[[tuple[str, ...]], Compilers] | None = None) -> list[Path]:
    """Every package's variant for each torch version; `compilers` makes the toolchain for the versions
    (default: zig's cross toolchain, fetched into the cache)."""
    missing = missing_sources()
    if missing:
        raise RuntimeError("the darwin build needs the MPS device layer; missing: "
                           + ", ".join(str(p.relative_to(REPO)) for p in missing))
    start = time.monotonic()
    tc = (compilers or (lambda v: cross(darwin_toolchain.toolchain(v))))(versions)
    runtimes = build_runtimes(tc, jobs)
    for version, lib in runtimes.items():
        if tc.allowed:
            macho_check.check_file(lib, tc.allowed(version))
        check_runtime_exports(lib)
    print(f"[darwin] toolchain and runtimes: {time.monotonic() - start:.0f} s", file=sys.stderr)
    outs = []
    for name in names:
        spec = package_spec.load(REPO / "packages" / name)
        for version, torch in tc.torch.items():
            outs.append(build_extension(spec, tc, torch, runtimes[version], jobs))
    print(f"[darwin] {len(outs)} variants built and link-checked in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return outs


def update_stubs(versions: tuple[str, ...]) -> None:
    objects = sorted(runtime_dir().rglob("*.o")) + sorted((REPO / "packages").glob("*/build/.ninja/*-darwin/obj/*.o"))
    added, unresolved = darwin_toolchain.update_stubs(darwin_toolchain.toolchain(versions), objects)
    unresolved = [s for s in unresolved if not macho_check.PYTHON_C_API.match(s)]  # the interpreter's
    for line in added:
        print(f"[darwin] stub added: {line}", file=sys.stderr)
    if unresolved:
        print(f"[darwin] no shipped macOS binary imports these; add each to its library in "
              f"{darwin_toolchain.STUBS_TOML.relative_to(REPO)} with a note, if it exists there: {', '.join(unresolved)}",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.build.darwin", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", help="package folder names (default: all)")
    ap.add_argument("--torch", action="append", choices=darwin_toolchain.TORCH_VERSIONS,
                    help="torch versions (default: all of them)")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    ap.add_argument("--update-stubs", action="store_true",
                    help="after the build (failed or not), add to tools/build/darwin/stubs.toml the symbols the "
                         "objects import that a shipped macOS binary imports from a stubbed library")
    args = ap.parse_args(argv)
    versions = tuple(args.torch or darwin_toolchain.TORCH_VERSIONS)
    try:
        outs = build_all(args.packages or build.packages(), versions, args.jobs)
    except (RuntimeError, ValueError) as e:
        print(f"build-darwin: {e}", file=sys.stderr)
        if args.update_stubs:
            update_stubs(versions)
        return 1
    if args.update_stubs:
        update_stubs(versions)
    for out in outs:
        print(out.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())

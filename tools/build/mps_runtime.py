"""The Linux twin of the MPS device layer: metal-cpp over a fake Metal framework on the emulated device.

On a Mac the MPS device layer (common/metal/mps/) is plain C++ over metal-cpp (Apple's C++ headers
over the Objective-C runtime) and torch's MPS stream. On Linux the same source compiles against
metal-cpp plus ours (common/metal/mps_emu/):
- a fake Metal framework: Objective-C classes registered at load time with the GNU runtime
  (Debian's libobjc4), reached through an x86-64 objc_msgSend trampoline of ours (libobjc4 has
  none); its methods record every call, refuse what Metal refuses, and run committed dispatches on
  the emulated device (the runtime's emulator objects and translated kernels, shared with
  libggml-kernels-metal-emu.so); what it checks of a kernel (the function constants it reads, its
  arguments and threadgroup memory) is a table generated here from upstream's .metal sources;
- a fake MPS stream (at::mps::MPSStream's names, fake_mps_stream.h) and dispatch_sync_f;
- stand-ins for the Apple headers metal-cpp includes (shims/).

metal-cpp is taken at build time from the `mlx-metal` wheel on the package index (macOS tag; only
`mlx/include/metal_cpp/` is unpacked, into the cache) and never committed. metal-cpp's block types
need clang (`-fblocks`): Debian's clang-16. Both Debian packages are installed when missing and this
runs as root with apt-get; otherwise the build stops naming them. Not under GGML_KERNELS_SANITIZE.

    python -m tools.build.mps_runtime      # builds (incrementally); prints the folder

builds, in <runtime>/mps-emu/: the framework, `libggml-kernels-fake-metal.so` (what a library over
the device layer links: metal-cpp's calls, MTLCreateSystemDefaultDevice, dispatch_sync_f, the
at::mps stream and fake_mps.h), and `fake-metal-driver`, the C++ driver of tests/test_mps_emu_fake.py;
and twin_runtime(), in <runtime>/mps-emu/torch<XY>/: `libggml-kernels-metal-twin.so`, the twin's
Metal runtime (what libggml-kernels-metal.dylib is on a Mac): ggml-base and upstream's Metal host
code (the Metal runtime build's objects) over the MPS device layer and its Linux platform part.

    python -m tools.build.mps_runtime twin  # the twin runtime too
"""

from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tools import REPO

from . import files, ggml_runtime, metal_runtime, metal_source, metal_translate, sanitize, upstream
from . import ninja_build as ninja

MLX_METAL = "0.32.4"  # the wheel metal-cpp is taken from (its headers are the macOS 26 edition)
MLX_PLATFORM = "macosx_14_0_arm64"  # the only tag mlx-metal publishes under; nothing of it runs here
CLANG = "clang++-16"
OBJC_RUNTIME = "libobjc.so.4"  # Debian libobjc4: the GNU Objective-C runtime

FAKE_DIR = REPO / "common" / "metal" / "mps_emu"
EMU_DIR = REPO / "common" / "metal" / "emu"
DRIVER = REPO / "tests" / "mps_emu" / "fake_metal_driver.cpp"
FAKE_SOURCES = ["fake_metal.cpp", "fake_metal_api.cpp", "fake_mps_stream.cpp", "objc_msgsend_x86_64.S"]
FAKE_HEADERS = ["fake_mps.h", "fake_mps_stream.h"]
# metal-cpp's one implementation unit, the device layer's (both platforms compile it)
METAL_CPP_IMPL = REPO / "common" / "metal" / "mps" / "metal_cpp_impl.cpp"
TORCH_STD = "-std=c++20"  # after CXXFLAGS' (the last -std wins) where torch's headers are read: 2.14+ need C++20
CXXFLAGS = ["-std=c++17", "-fblocks", "-fPIC", "-O2", "-g", "-pthread", "-Wall", "-Wno-unused-function"]
LINK_LIBS = [f"-l:{OBJC_RUNTIME}", "-pthread", "-lm", "-ldl"]
LIBRARY = "libggml-kernels-fake-metal.so"
FACTS = "fake_metal_kernels.cpp"  # generated: what each kernel reads (constants, arguments)
HIDDEN_METAL_CPP = ("-DMETALCPP_SYMBOL_VISIBILITY_HIDDEN",)


# ---- tools: clang-16 and libobjc4 from Debian ----

def _missing_packages() -> list[str]:
    missing = []
    if shutil.which(CLANG) is None:
        missing.append("clang-16")
    if ctypes.util.find_library("objc") is None and not Path(f"/usr/lib/x86_64-linux-gnu/{OBJC_RUNTIME}").exists():
        missing.append("libobjc4")
    return missing


def objc_runtime() -> Path:
    """Debian's libobjc.so.4 (require_tools() installs it), by its soname (the copy beside a build
    must have the name the libraries over it need)."""
    require_tools()
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        if (Path(folder) / OBJC_RUNTIME).exists():
            return Path(folder) / OBJC_RUNTIME
    raise RuntimeError(f"no {OBJC_RUNTIME} in /usr/lib: apt-get install libobjc4")


def clang_version() -> str:
    """For the keys of what clang built (an extension cache entry linking its objects)."""
    require_tools()
    return subprocess.run([CLANG, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def require_tools() -> None:
    """clang-16 and libobjc4: installed with apt-get when missing (as root), else a clear error."""
    missing = _missing_packages()
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"[mps-emu] apt-get install {' '.join(missing)}", file=sys.stderr)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
        missing = _missing_packages()
    if missing:
        raise RuntimeError(
            f"the fake Metal framework needs Debian's {' and '.join(missing)} "
            f"(the GNU Objective-C runtime {OBJC_RUNTIME}, and clang for metal-cpp's block types): "
            f"apt-get install {' '.join(missing)}"
        )


# ---- metal-cpp from the mlx-metal wheel ----

def metal_cpp() -> Path:
    """<cache>/metal-cpp-<mlx-metal version>/metal_cpp (Foundation/, Metal/, ...), fetched once."""
    folder = upstream.cache_dir() / f"metal-cpp-{MLX_METAL}"
    if (folder / ".complete").exists():
        return folder / "metal_cpp"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform", MLX_PLATFORM,
               "-d", tmp, f"mlx-metal=={MLX_METAL}"]
        res = subprocess.run(cmd, env={**os.environ, "PIP_CONSTRAINT": os.devnull}, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"pip download mlx-metal=={MLX_METAL} ({MLX_PLATFORM}) failed:\n{res.stdout}{res.stderr}")
        staging = Path(tmp) / "staging"
        prefix = "mlx/include/"
        with zipfile.ZipFile(wheels[0]) as z:
            for info in z.infolist():
                if info.filename.startswith(prefix + "metal_cpp/") and not info.is_dir():
                    target = staging / info.filename[len(prefix):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(info))
        if not (staging / "metal_cpp" / "Metal" / "Metal.hpp").exists():
            raise RuntimeError(f"{wheels[0].name} has no {prefix}metal_cpp/Metal/Metal.hpp")
        (staging / ".complete").write_text(f"{wheels[0].name}\n")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    return folder / "metal_cpp"


# ---- what each kernel reads: function constants, arguments ----

_FC_DEFINE = re.compile(r"^\s*#\s*define\s+(FC_\w+)\s+(\d+)\s*$", re.M)
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")
_ATTRIBUTE = re.compile(r"\[\[.*?\]\]", re.S)


def _index(expr: str, macros: dict[str, int]) -> int:
    """A function_constant(...) index: `FC_MUL_MV + 3`, `FC_NORM`, `100`."""
    total = 0
    for term in expr.split("+"):
        term = term.strip()
        total += int(term) if term.isdigit() else macros[term]
    return total


def _without_template_header(header: str) -> str:
    """`template <...> void f(...)` -> ` void f(...)`: the template's parameters may hold function
    types (`void (*deq)(...)`) that are not the function's name."""
    m = re.search(r"\btemplate\s*<", header)
    if m is None:
        return header
    depth = 0
    for i in range(m.end() - 1, len(header)):
        depth += {"<": 1, ">": -1}.get(header[i], 0)
        if depth == 0:
            return header[i + 1:]
    return header


def _definitions(text: str) -> list[tuple[str, str]]:
    """(name, body) of every top-level function definition: the identifier before the first `(` of
    a top-level `{ ... }` block's header."""
    out, depth, start, header_start = [], 0, 0, 0
    for i, c in enumerate(text):
        if c == "{":
            if depth == 0:
                start = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                header = _without_template_header(_ATTRIBUTE.sub("", text[header_start:start]))
                m = re.search(r"(\w+)\s*\(", header)
                if m:
                    out.append((m.group(1), text[start:i + 1]))
                header_start = i + 1
        elif c == ";" and depth == 0:
            header_start = i + 1
    return out


def kernel_constants(text: str, macros: dict[str, int]) -> dict[str, list[int]]:
    """{kernel name: the function-constant indices it reads}, for one kernel file with its includes
    inlined (`macros`: the FC_* group bases of ggml-metal-impl.h): a kernel reads what its function
    and every function it calls (by name, transitively) name. Metal refuses to make a function
    whose read constants lack a value."""
    text = re.sub(r"//[^\n]*", "", text)
    constants = {m.group(3): _index(m.group(4), macros) for m in metal_translate._FUNCTION_CONSTANT.finditer(text)}
    reads: dict[str, set[str]] = {}
    calls: dict[str, set[str]] = {}
    for name, body in _definitions(text):
        ids = set(_IDENT.findall(body))
        reads.setdefault(name, set()).update(ids & constants.keys())
        calls.setdefault(name, set()).update(ids)
    for name in calls:
        calls[name] &= reads.keys()

    def closure(fn: str) -> set[str]:
        seen, todo, found = set(), [fn], set()
        while todo:
            f = todo.pop()
            if f in seen or f not in reads:
                continue
            seen.add(f)
            found |= reads[f]
            todo += calls[f]
        return found

    entries = {m.group(1): m.group(2) for m in metal_translate._INSTANCE.finditer(text)}
    entries.update({m.group(2) or m.group(3): m.group(3) for m in metal_translate._KERNEL.finditer(text)})
    names = set(metal_translate.kernel_names(text))
    return {kernel: sorted(constants[c] for c in closure(fn)) for kernel, fn in entries.items() if kernel in names}


def kernel_arguments(text: str) -> dict[str, tuple[list[int], list[int]]]:
    """{kernel name: (its buffer argument indices, its threadgroup memory indices)}, for one kernel
    file with its includes inlined, by the translator's reading of kernel parameters."""
    params: dict[str, list[tuple[str, int | str]]] = {}
    for m in metal_translate._KERNEL.finditer(text):
        close = metal_translate._matching_paren(text, m.end() - 1)
        params[m.group(3)] = metal_translate._param_kinds(metal_translate._split_params(text[m.end():close]), m.group(3))
    entries = {m.group(1): m.group(2) for m in metal_translate._INSTANCE.finditer(text)}
    entries.update({m.group(2) or m.group(3): m.group(3) for m in metal_translate._KERNEL.finditer(text)})
    names = set(metal_translate.kernel_names(text))
    return {kernel: (sorted(i for kind, i in params[fn] if kind == "Buffer"),
                     sorted(i for kind, i in params[fn] if kind == "Threadgroup"))
            for kernel, fn in entries.items() if kernel in names and fn in params}


@dataclass
class KernelFacts:
    constants: list[int]  # function-constant indices it reads
    buffers: list[int]  # argument indices of its buffers (setBytes or setBuffer)
    threadgroups: list[int]  # indices of its threadgroup memory (setThreadgroupMemoryLength)


def library_facts(kernels_dir: Path) -> dict[str, KernelFacts]:
    """What Metal checks of each kernel of upstream's kernel files (ggml-metal/kernels/)."""
    found: dict[str, KernelFacts] = {}
    folders = [kernels_dir, kernels_dir.parent, kernels_dir.parent.parent]
    impl = (kernels_dir.parent / "ggml-metal-impl.h").read_text()
    macros = {m.group(1): int(m.group(2)) for m in _FC_DEFINE.finditer(impl)}
    for path in sorted(kernels_dir.glob("*.metal")):
        text = metal_translate.inline_includes(path.read_text(), folders)
        constants = kernel_constants(text, macros)
        for kernel, (buffers, threadgroups) in kernel_arguments(text).items():
            found[kernel] = KernelFacts(constants.get(kernel, []), buffers, threadgroups)
    return found


def facts_table(kernels_dir: Path) -> str:
    """The C++ table fake_metal.cpp reads (fake_metal::kKernelFacts), for upstream's kernel files:
    index lists as arrays, argument indices as bit masks (Metal has 31)."""
    found = sorted(library_facts(kernels_dir).items())
    arrays = "".join(f"const int32_t c{i}[] = {{{', '.join(map(str, f.constants))}}};\n"
                     for i, (_, f) in enumerate(found) if f.constants)
    rows = "".join(f'    {{"{k}", {f"c{i}" if f.constants else "nullptr"}, {len(f.constants)}, '
                   f"{hex(sum(1 << b for b in f.buffers))}u, {hex(sum(1 << b for b in f.threadgroups))}u}},\n"
                   for i, (k, f) in enumerate(found))
    return ("// Generated by tools/build/mps_runtime.py from upstream's .metal sources: what each kernel\n"
            "// reads (function constants, buffer arguments, threadgroup memory).\n#include <cstdint>\n\n"
            "namespace fake_metal {\nstruct KernelFacts {\n  const char* kernel;\n  const int32_t* constants;\n"
            "  int constant_count;\n  uint32_t buffers;       // bit i: argument index i\n"
            "  uint32_t threadgroups;  // bit i: threadgroup memory index i\n};\n"
            f"namespace {{\n{arrays}}}  // namespace\n"
            f"extern const KernelFacts kKernelFacts[] = {{\n{rows}    {{nullptr, nullptr, 0, 0, 0}}}};\n"
            "}  // namespace fake_metal\n")


# ---- the build ----

def emulator_objects(runtime: Path) -> list[Path]:
    """The emulated device's objects the Metal runtime build made (metal_runtime): the emulator's
    runtime, the translated kernels and the list of kernels not translated yet, the glibc compat."""
    objs = [runtime / "obj" / "metal" / "emu_runtime.cpp.o",
            runtime / "obj" / "metal-kernels" / "untranslated_kernels.cpp.o",
            *(runtime / "obj" / "metal-kernels" / (Path(f).stem + ".cpp.o") for f in metal_translate.KERNEL_FILES),
            runtime / "obj" / "glibc_compat.o", runtime / "obj" / "glibcxx_compat.o"]
    missing = [str(o) for o in objs if not o.exists()]
    if missing:
        raise RuntimeError(f"the Metal runtime build did not make {missing}: tools/build/metal_runtime.py changed its "
                           "object names; update mps_runtime.emulator_objects")
    return objs


def out_dir() -> Path:
    return ggml_runtime.runtime_dir() / "mps-emu"


def _stage(staged: Path, src: Path) -> None:
    """Our sources into the cache (the compile commands name no path of the checkout)."""
    (staged / "shims").mkdir(parents=True, exist_ok=True)
    for name in [*FAKE_SOURCES, *FAKE_HEADERS]:
        files.write_if_changed(staged / name, (FAKE_DIR / name).read_text())
    for shim in sorted((FAKE_DIR / "shims").rglob("*.h")):
        target = staged / "shims" / shim.relative_to(FAKE_DIR / "shims")
        target.parent.mkdir(parents=True, exist_ok=True)
        files.write_if_changed(target, shim.read_text())
    for header in ("emu_runtime.h", "metal_emu_api.h"):
        files.write_if_changed(staged / header, (EMU_DIR / header).read_text())
    files.write_if_changed(staged / METAL_CPP_IMPL.name, METAL_CPP_IMPL.read_text())
    files.write_if_changed(staged / DRIVER.name, DRIVER.read_text())
    files.write_if_changed(staged / FACTS, facts_table(src / "ggml-metal" / "kernels"))


def framework_objects(out: Path) -> list[Path]:
    """The framework's objects in `out` (build()), metal-cpp's tables among them, for a test binary
    that links it statically (with emulator_objects) instead of LIBRARY."""
    return [out / "obj" / (name + ".o") for name in [*FAKE_SOURCES, METAL_CPP_IMPL.name, FACTS]]


def link_flags(out: Path) -> list[str]:
    """What a binary over metal-cpp links to get the fake framework built in `out` (build())."""
    return [str(out / LIBRARY), f"-Wl,-rpath,{out}", *LINK_LIBS]


def build(jobs: int | None = None) -> Path:
    """LIBRARY and the test driver in out_dir() (incremental); returns the folder.

    The framework is one shared library, like Metal.framework: its Objective-C classes are
    registered once per process, whatever number of libraries over metal-cpp link it. It holds its
    own copy of the emulator (the runtime's objects, hidden symbols)."""
    if sanitize.enabled():  # the runtime's emulator objects are gcc's ASan builds; this links with clang
        raise RuntimeError(f"the fake Metal framework is not built under {sanitize.ENV} (its tests are in the slow tier)")
    require_tools()
    include = metal_cpp()
    runtime = ggml_runtime.build(jobs)
    src = upstream.ggml_tree() / "src"
    out = out_dir()
    staged = out / "src"
    _stage(staged, src)

    flags = CXXFLAGS + [f"-I{staged / 'shims'}", f"-I{include}", f"-I{staged}"]
    n = ninja.NinjaFile()
    n.rule("cxx", f"{CLANG} -MMD -MF $out.d $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("link", f"{CLANG} -o $out $in $ldflags", "LINK $out")

    def compile_one(path: Path, extra: tuple[str, ...] = ()) -> Path:
        obj = out / "obj" / (path.name + ".o")
        n.build(obj, "cxx", path, variables={"flags": ninja.quote(flags + list(extra))})
        return obj

    emulator = emulator_objects(runtime)
    # metal-cpp's tables hidden: the library's (the fake stream is a metal-cpp client too) stay its
    # own next to those of a library over the device layer
    objs = [compile_one(staged / name, HIDDEN_METAL_CPP) for name in [*FAKE_SOURCES, METAL_CPP_IMPL.name, FACTS]]
    assert objs == framework_objects(out)
    lib = out / LIBRARY
    n.build(lib, "link", [*objs, *emulator],
            variables={"ldflags": ninja.quote(["-shared", f"-Wl,-soname,{LIBRARY}", "-Wl,--no-undefined",
                                               "-Wl,-z,noexecstack", "-Wl,-rpath,$$ORIGIN", *LINK_LIBS])})
    # the driver: metal-cpp's tables, and the emulator once more for the direct path
    driver = compile_one(staged / DRIVER.name, (f"-I{src / 'ggml-metal'}",))
    n.build(out / "fake-metal-driver", "link", [driver, objs[len(FAKE_SOURCES)], *emulator], implicit=[lib],
            variables={"ldflags": ninja.quote(link_flags(out))})
    n.write(out / "build.ninja")
    ninja.run(out, jobs)
    return out


# ---- the twin's Metal runtime: upstream's host code over the MPS device layer ----

MPS_DIR = REPO / "common" / "metal" / "mps"
TWIN_RUNTIME = "libggml-kernels-metal-twin.so"
# the device layer (the darwin runtime's, less its platform part) and the twin's platform part
TWIN_LAYER = ["mps_device.cpp", "mps_context.cpp", METAL_CPP_IMPL.name]
TWIN_PLATFORM = FAKE_DIR / "mps_platform_fake.cpp"  # mps_platform.h on Linux: uses torch's tensors
DEVICE_API = REPO / "common" / "metal" / "metal_device_api.cpp"
# what the layer shares with the emulated device
DEVICE_CORE = [REPO / "common" / "metal" / f for f in ("device_core.h", "device_core_functions.h")]


def twin_dir() -> Path:
    """Per torch version (the platform part takes torch's tensors), as the darwin runtimes."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return out_dir() / f"torch{major}{minor}"


def twin_objects(folder: Path | None = None) -> list[Path]:
    """The twin runtime's own objects (twin_runtime() builds them), its platform part's among them:
    a test binary links them with the Metal runtime's base and host objects instead of the library."""
    obj = (folder or twin_dir()) / "obj"
    return [obj / (name + ".o") for name in [*TWIN_LAYER, TWIN_PLATFORM.name, "metal_source.cpp",
                                                "metal_supports_op.cpp", DEVICE_API.name]]


def platform_object(folder: Path | None = None) -> Path:
    """mps_platform.h on the twin, compiled (clang, metal-cpp): what an extension over the MPS
    backend links besides the runtime (tensor_buffer, synchronize)."""
    return (folder or twin_dir()) / "obj" / (TWIN_PLATFORM.name + ".o")


def runtime_link_objects(runtime: Path) -> list[Path]:
    """The Metal runtime build's ggml-base and upstream's host objects, and the glibc compat they
    were built against."""
    objs = sorted((runtime / "obj" / "base").glob("*.o"))
    objs += [runtime / "obj" / "glibc_compat.o", runtime / "obj" / "glibcxx_compat.o"]
    objs += [runtime / "obj" / "metal" / (Path(s).name + ".o") for s in metal_runtime.HOST_SOURCES]
    missing = [str(o) for o in objs if not o.exists()]
    if missing or len(objs) == 2 + len(metal_runtime.HOST_SOURCES):
        raise RuntimeError(f"the Metal runtime build did not make {missing or 'ggml-base'}: update mps_runtime.runtime_link_objects")
    return objs


def _stage_layer(staged: Path) -> None:
    """The layer's sources and headers, the device API and the platform part into the cache."""
    staged.mkdir(parents=True, exist_ok=True)
    for path in [*MPS_DIR.glob("*.cpp"), *MPS_DIR.glob("*.h"), DEVICE_API, DEVICE_API.with_suffix(".h"), *DEVICE_CORE,
                 TWIN_PLATFORM]:
        files.write_if_changed(staged / path.name, path.read_text())


def _generate(gen: Path, metal_dir: Path) -> None:
    """Upstream's shader source embedded, and supports_op sliced from ggml-metal-device.m."""
    metal_source.write(metal_dir, gen / "metal_source.cpp")
    sliced = metal_runtime.slice_supports_op((metal_dir / "ggml-metal-device.m").read_text())
    if not sliced.startswith(metal_runtime.SLICE_PRELUDE):
        raise RuntimeError("metal_runtime.slice_supports_op no longer starts with SLICE_PRELUDE")
    files.write_if_changed(gen / "metal_supports_op.cpp", '#include "mps_device.h"\n#include "ggml-metal-common.h"\n'
                           '#include "ggml-metal-impl.h"\n#include "ggml-impl.h"\n' + sliced[len(metal_runtime.SLICE_PRELUDE):])


def torch_link_flags() -> list[str]:
    """What a library over the twin's platform part links of torch (its tensors' storage)."""
    import torch.utils.cpp_extension as ext

    torch_lib = ext.library_paths()[0]
    return [f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]


def twin_runtime(jobs: int | None = None) -> Path:
    """TWIN_RUNTIME in twin_dir() (incremental; nothing is rebuilt when nothing changed): ggml-base
    and upstream's host objects of the Metal runtime build, the MPS device layer and its twin
    platform part, linked to the fake framework (build()) found beside it ($ORIGIN) or in out_dir()."""
    import torch.utils.cpp_extension as ext

    fake = build(jobs) / LIBRARY
    runtime = ggml_runtime.runtime_dir()
    tree = upstream.ggml_tree()
    metal_dir = tree / "src" / "ggml-metal"
    out = twin_dir()
    staged, gen = out / "src", out / "gen"
    _stage_layer(staged)
    _generate(gen, metal_dir)

    ggml = [f"-isystem{tree / 'include'}", f"-isystem{tree / 'src'}", f"-isystem{metal_dir}"]
    clang = CXXFLAGS + [f"-I{out_dir() / 'src' / 'shims'}", f"-I{metal_cpp()}", f"-I{staged}"]
    torch = [TORCH_STD] + [f"-isystem{p}" for p in ext.include_paths()]
    n = ninja.NinjaFile()
    n.rule("clang", f"{CLANG} -MMD -MF $out.d $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("gxx", "g++ -MMD -MF $out.d -std=gnu++17 -O2 -fPIC -pthread $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("link", f"{CLANG} -o $out $in $ldflags", "LINK $out")
    compiles = [(staged / f, "clang", clang + ggml) for f in TWIN_LAYER]
    compiles += [(staged / TWIN_PLATFORM.name, "clang", clang + [f"-I{out_dir() / 'src'}"] + torch),
                 (gen / "metal_source.cpp", "gxx", [f"-I{staged}"]),
                 (gen / "metal_supports_op.cpp", "gxx", [f"-I{staged}"] + ggml),
                 (staged / DEVICE_API.name, "gxx", [f"-I{staged}"] + ggml)]
    objs = []
    for src, rule, flags in compiles:
        obj = out / "obj" / (src.name + ".o")
        n.build(obj, rule, src, variables={"flags": ninja.quote(flags)})
        objs.append(obj)
    assert objs == twin_objects(out)
    lib = out / TWIN_RUNTIME
    n.build(lib, "link", [*objs, *runtime_link_objects(runtime)], implicit=[fake],
            variables={"ldflags": ninja.quote(["-shared", f"-Wl,-soname,{TWIN_RUNTIME}", "-Wl,--no-undefined",
                                               "-Wl,-z,noexecstack", str(fake), f"-Wl,-rpath,$$ORIGIN:{fake.parent}",
                                               *LINK_LIBS, *torch_link_flags()])})
    n.write(out / "build.ninja")
    ninja.run(out, jobs)
    return lib


if __name__ == "__main__":
    print(twin_runtime() if sys.argv[1:] == ["twin"] else build())

"""The Metal runtime for Linux: upstream's Metal host code, compiled unmodified, over our device layer.

ggml's Metal backend is C++ host code (ggml-metal.cpp: the ggml-backend interface; -ops.cpp: one
encoder per op; -device.cpp: pipeline names and function constants; -common.cpp, -fusion.cpp,
-tuning.cpp) over a device layer upstream writes in Objective-C (ggml-metal-device.m,
ggml-metal-context.m). This builds `libggml-kernels-metal-emu.so` in the runtime cache from:
- ggml-base and upstream's six C++ host files, as fetched (nothing edited, nothing committed);
- `supports_op` (and its mul_mat helper), cut at build time out of ggml-metal-device.m, where it is
  plain C between two markers: the build fails, naming them, if they are not found exactly once;
- our device layer for the emulated device (common/metal/emu/): the functions of ggml-metal-device.h and
  ggml-metal-context.h upstream writes in Objective-C (the list: common/metal/metal_device_api.h), with no
  Apple type, over an executor that runs each dispatch on the emulator.

`ggml_backend_metal_init()` of this library is upstream's Metal backend: every kernel choice, grid,
function constant and threadgroup memory size comes from upstream's code.
"""

from __future__ import annotations

from pathlib import Path

from tools import REPO

from . import files, metal_translate
from . import ninja_build as ninja

LIBRARY = "libggml-kernels-metal-emu.so"
HOST_SOURCES = [
    "ggml-metal/ggml-metal.cpp", "ggml-metal/ggml-metal-ops.cpp", "ggml-metal/ggml-metal-device.cpp",
    "ggml-metal/ggml-metal-common.cpp", "ggml-metal/ggml-metal-fusion.cpp", "ggml-metal/ggml-metal-tuning.cpp",
]
# ours, staged into one folder of the cache (the compile commands name no path of the checkout):
# the interface a Metal device layer implements, its build-time check and what every layer shares
# (common/metal/: metal_device_api.{h,cpp}, device_core.h, device_core_functions.h), and the
# emulated device (common/metal/emu/): our device layer (emu_device.cpp, emu_context.cpp, metal_emu.h),
# the emulator's runtime and executor, and the MSL shim the translated kernels compile against
METAL_DIR = REPO / "common" / "metal"
INTERFACE_FILES = ["metal_device_api.h", "metal_device_api.cpp", "device_core.h", "device_core_functions.h"]
DEVICE_DIR = METAL_DIR / "emu"
MSL_HEADERS = ["msl.h", "msl_types.h", "msl_math.h", "msl_simd.h", "msl_simdgroup_matrix.h"]
DEVICE_FILES = ["metal_emu.h", "metal_emu_api.h", "emu_device.cpp", "emu_context.cpp", "emu_runtime.h", "emu_runtime.cpp",
                "emu_executor.cpp", *MSL_HEADERS]
STAGED = [*(METAL_DIR / f for f in INTERFACE_FILES), *(DEVICE_DIR / f for f in DEVICE_FILES)]
DEVICE_SOURCES = [f.name for f in STAGED if f.suffix == ".cpp"]
HEADERS = [f.name for f in STAGED if f.suffix == ".h"]
# supports_op in ggml-metal-device.m: from its mul_mat helper to the end of the entry point
SLICE_START = "static bool ggml_metal_supports_mul_mat_op("
SLICE_ENTRY = "bool ggml_metal_device_supports_op(ggml_metal_device_t dev, const struct ggml_tensor * op) {"
SLICE_PRELUDE = (
    "// Cut from upstream's ggml-metal-device.m at build time by tools/build/metal_runtime.py.\n"
    '#include "metal_emu.h"\n#include "ggml-metal-common.h"\n#include "ggml-metal-impl.h"\n#include "ggml-impl.h"\n\n'
)


def slice_supports_op(objc: str) -> str:
    """The plain-C `supports_op` block of ggml-metal-device.m, as a C++ translation unit."""
    lines = objc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(SLICE_START)]
    entries = [i for i, line in enumerate(lines) if line.startswith(SLICE_ENTRY)]
    if len(starts) != 1 or len(entries) != 1 or starts[0] > entries[0]:
        raise ValueError(
            "ggml-metal-device.m changed: expected one line starting with each of "
            f"{SLICE_START!r} ({len(starts)} found) and {SLICE_ENTRY!r} ({len(entries)} found), in that order; "
            "update tools/build/metal_runtime.py's markers for the new pin"
        )
    end = next((i for i in range(entries[0], len(lines)) if lines[i] == "}"), None)
    if end is None:
        raise ValueError("ggml-metal-device.m changed: no closing brace after ggml_metal_device_supports_op")
    return SLICE_PRELUDE + "\n".join(lines[starts[0] : end + 1]) + "\n"


def _kernel_objects(n: ninja.NinjaFile, *, out: Path, src: Path, staged: Path, flags: list[str],
                    headers: list[Path]) -> list[Path]:
    """Upstream's kernel files, translated (metal_translate) and compiled against msl.h."""
    kernels_dir = src / "ggml-metal" / "kernels"
    include = out / "gen" / "msl-include"  # `#include <metal_stdlib>` is the shim
    include.mkdir(parents=True, exist_ok=True)
    files.write_if_changed(include / "metal_stdlib", '#include "msl.h"\n')
    translated = out / "gen" / "metal-kernels"
    translated.mkdir(parents=True, exist_ok=True)
    # the kernels' own folder first: their "common.h" is not ggml-cpu's
    kernel_flags = [f"-I{kernels_dir}", f"-I{include}", f"-I{staged}", f"-I{src / 'ggml-metal'}"] + flags
    # the kernels of the files not translated yet, so that asking for one says so (and asking for a
    # name no file defines says that instead)
    untranslated = [n for f in sorted(kernels_dir.glob("*.metal")) if f.name not in metal_translate.KERNEL_FILES
                    for n in metal_translate.kernel_names(f.read_text())]
    listing = translated / "untranslated_kernels.cpp"
    files.write_if_changed(listing, "// Generated by tools/build/metal_runtime.py: kernels of upstream's files not translated yet.\n"
                      "namespace ggml_kernels::metal::emu {\nextern const char* const kUntranslatedKernels[] = {\n"
                      + "".join(f'    "{n}",\n' for n in untranslated) + "    nullptr};\n}\n")
    objs = [out / "obj" / "metal-kernels" / "untranslated_kernels.cpp.o"]
    n.build(objs[0], "cxx", listing, variables={"flags": ninja.quote(flags)})
    for name in metal_translate.KERNEL_FILES:
        cpp = translated / (Path(name).stem + ".cpp")
        files.write_if_changed(cpp, metal_translate.translate_file(kernels_dir / name))
        obj = out / "obj" / "metal-kernels" / (cpp.name + ".o")
        n.build(obj, "cxx", cpp, implicit=headers, variables={"flags": ninja.quote(kernel_flags)})
        objs.append(obj)
    return objs


def add_to(n: ninja.NinjaFile, *, out: Path, src: Path, flags: list[str], base_objs: list[Path],
           compat_objs: list[Path], ldflags: list[str]) -> Path:
    """Add the library's compile and link steps to the runtime's ninja file; returns its path."""
    staged = out / "common" / "metal"
    staged.mkdir(parents=True, exist_ok=True)
    for path in STAGED:
        files.write_if_changed(staged / path.name, path.read_text())
    gen = out / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    files.write_if_changed(gen / "metal_supports_op.cpp", slice_supports_op((src / "ggml-metal" / "ggml-metal-device.m").read_text()))

    # ggml-metal.cpp uses std::unique_ptr without including <memory> (libc++ includes it transitively)
    metal_flags = flags + [f"-I{src / 'ggml-metal'}", f"-I{staged}", "-include", "memory"]
    headers = [staged / h for h in HEADERS]
    objs = []
    for s in HOST_SOURCES:
        obj = out / "obj" / "metal" / (Path(s).name + ".o")
        n.build(obj, "cxx", src / s, variables={"flags": ninja.quote(metal_flags)})
        objs.append(obj)
    for path in [*(staged / f for f in DEVICE_SOURCES), gen / "metal_supports_op.cpp"]:
        obj = out / "obj" / "metal" / (path.name + ".o")
        n.build(obj, "cxx", path, implicit=headers, variables={"flags": ninja.quote(metal_flags)})
        objs.append(obj)
    kernel_headers = [staged / h for h in ("emu_runtime.h", *MSL_HEADERS)]
    objs += _kernel_objects(n, out=out, src=src, staged=staged, flags=flags, headers=kernel_headers)
    lib = out / LIBRARY
    n.build(lib, "link", base_objs + objs + compat_objs, variables={"ldflags": ninja.quote(ldflags + [f"-Wl,-soname,{LIBRARY}"])})
    return lib

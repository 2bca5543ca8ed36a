"""Build ggml's CPU runtime (ggml-base + ggml-cpu) once per CPU variant, in the cache.

Every package links the same runtime: one shared library per x86-64 feature level, exactly the
split ggml itself uses for GGML_CPU_ALL_VARIANTS, but a handful of levels instead of a dozen. A
package's extension picks the best one the running CPU supports at import time
(common/ggml_runtime.cpp), so a build is portable: AVX-512 code only ever runs on AVX-512 CPUs.

Each library is loaded privately (RTLD_LOCAL) and linked -Bsymbolic, so its calls stay inside
itself and it can share a process with another ggml, such as llama-cpp-python's, without symbol
clashes. libstdc++ is linked dynamically, like torch's own libraries (a static copy would drag in
glibc symbols newer than manylinux_2_28 allows).

    python -m tools.build.ggml_runtime      # builds (incrementally) and prints the runtime folder
"""

from __future__ import annotations

import os
from pathlib import Path

from tools import REPO

from . import metal_runtime, sanitize, upstream
from . import ninja_build as ninja

COMMON = REPO / "common"

# The CPU levels, baseline first: name -> (compiler flags, ggml feature defines). The one Python list
# of them (tests take theirs from here); kVariants in common/ggml_runtime.cpp, which picks the best
# one the CPU supports at load time, lists the same names best first (tests/test_shared_facts.py).
_HASWELL = ["-msse4.2", "-mavx", "-mf16c", "-mfma", "-mbmi2", "-mavx2"]
_HASWELL_DEF = ["GGML_SSE42", "GGML_AVX", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX2"]
_AVX512 = ["-mavx512f", "-mavx512cd", "-mavx512vl", "-mavx512dq", "-mavx512bw"]
CPU_LEVELS: dict[str, tuple[list[str], list[str]]] = {
    "x64": ([], []),
    "haswell": (_HASWELL, _HASWELL_DEF),
    "skylakex": (_HASWELL + _AVX512, _HASWELL_DEF + ["GGML_AVX512"]),
    "zen4": (
        _HASWELL + _AVX512 + ["-mavx512vbmi", "-mavx512vnni", "-mavx512bf16"],
        _HASWELL_DEF + ["GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"],
    ),
}
# The /proc/cpuinfo flag of the newest instructions each level above the baseline needs: where it is
# missing, the loader refuses that level (tests skip forcing it there).
CPUINFO_FLAG = {"haswell": "avx2", "skylakex": "avx512bw", "zen4": "avx512_bf16"}

BASE_SOURCES = [
    "ggml.c", "ggml.cpp", "ggml-alloc.c", "ggml-backend.cpp", "ggml-backend-meta.cpp", "ggml-opt.cpp",
    "ggml-threading.cpp", "ggml-quants.c", "gguf.cpp",
]
CPU_SOURCES = [
    "ggml-cpu/ggml-cpu.c", "ggml-cpu/ggml-cpu.cpp", "ggml-cpu/repack.cpp", "ggml-cpu/hbm.cpp",
    "ggml-cpu/quants.c", "ggml-cpu/traits.cpp", "ggml-cpu/amx/amx.cpp", "ggml-cpu/amx/mmq.cpp",
    "ggml-cpu/tiled/tiled.cpp", "ggml-cpu/tiled/tiled-kernel.cpp", "ggml-cpu/binary-ops.cpp",
    "ggml-cpu/unary-ops.cpp", "ggml-cpu/vec.cpp", "ggml-cpu/ops.cpp", "ggml-cpu/llamafile/sgemm.cpp",
    "ggml-cpu/arch/x86/quants.c", "ggml-cpu/arch/x86/repack.cpp",
]
DEFINES = [
    "NDEBUG", "_GNU_SOURCE", "_XOPEN_SOURCE=600", "GGML_BUILD", "GGML_SHARED", "GGML_BACKEND_BUILD",
    "GGML_BACKEND_SHARED", "GGML_SCHED_MAX_COPIES=4", "GGML_USE_LLAMAFILE", "GGML_USE_CPU_REPACK",
]
COMMON_FLAGS = ["-O3", "-fPIC", "-pthread", "-fvisibility=hidden", "-w"]
# Our sources the runtime compiles: staged into the cache, so the compile commands name no path of
# the checkout and a clone elsewhere (CI's) finds the runtime up to date.
COMPAT_FILES = ["glibc_compat.h", "glibc_compat.c", "glibcxx_compat.cpp"]
# ... and the ggml-cpu internals the runtime exports under gk_ names (compiled per CPU variant).
CPU_API_FILES = ["cpu/cpu_runtime_api.h", "cpu/cpu_runtime_api.cpp"]
LIB_PREFIX = "libggml-kernels-cpu-"


def selected_variants() -> list[str]:
    """All CPU levels, or GGML_KERNELS_CPU_VARIANTS=zen4,x64 to build fewer while developing."""
    env = os.environ.get("GGML_KERNELS_CPU_VARIANTS")
    names = [v.strip() for v in env.split(",")] if env else list(CPU_LEVELS)
    unknown = [n for n in names if n not in CPU_LEVELS]
    if unknown:
        raise ValueError(f"unknown CPU variants {unknown}; known: {list(CPU_LEVELS)}")
    return names


def runtime_dir() -> Path:
    """Cache folder of the built runtime, one per pin; ninja rebuilds what a recipe change touches."""
    return upstream.ggml_tree().parent / ("runtime-sanitize" if sanitize.enabled() else "runtime")


def _stage_common(out: Path) -> Path:
    """Copy COMPAT_FILES and CPU_API_FILES into out/common (rewritten only when their text changed);
    returns the folder."""
    staged = out / "common"
    for name in COMPAT_FILES + CPU_API_FILES:
        text = (COMMON / name).read_text()
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        if not (staged / name).exists() or (staged / name).read_text() != text:
            (staged / name).write_text(text)
    return staged


def write_version_header(gen: Path) -> None:
    """gen/ggml-version.h, which CMake generates upstream: the pinned version and commit."""
    pin = upstream.pin()["llama_cpp"]
    text = f'#pragma once\n#define GGML_VERSION "{pin["ggml_version"]}"\n#define GGML_COMMIT "{pin["commit"][:7]}"\n'
    version_h = gen / "ggml-version.h"
    if not version_h.exists() or version_h.read_text() != text:
        version_h.write_text(text)


def build(jobs: int | None = None) -> Path:
    tree = upstream.ggml_tree()
    out = runtime_dir()
    src = tree / "src"
    gen = out / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    write_version_header(gen)

    includes = [f"-I{tree / 'include'}", f"-I{src}", f"-I{src / 'ggml-cpu'}", f"-I{gen}"]
    n = ninja.NinjaFile()
    n.rule("cc", "gcc -MMD -MF $out.d -std=gnu11 $flags -c $in -o $out", "CC $out", depfile=True)
    n.rule("cxx", "g++ -MMD -MF $out.d -std=gnu++17 $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("link", "g++ -shared -o $out $in $ldflags", "LINK $out")

    def compile_all(sources, subdir, flags):
        objs = []
        for s in sources:
            obj = out / "obj" / subdir / (s.replace("/", "_") + ".o")
            rule = "cc" if s.endswith(".c") else "cxx"
            n.build(obj, rule, src / s, variables={"flags": ninja.quote(flags)})
            objs.append(obj)
        return objs

    compat = _stage_common(out)
    common_flags = COMMON_FLAGS + ["-include", str(compat / "glibc_compat.h")]
    defs = [f"-D{d}" for d in DEFINES] + sanitize.compile_flags()
    # ggml-base holds no SIMD code worth specialising: compiled once, linked into every variant.
    base_objs = compile_all(BASE_SOURCES, "base", common_flags + defs + includes)
    compat_objs = [out / "obj" / "glibc_compat.o", out / "obj" / "glibcxx_compat.o"]
    n.build(compat_objs[0], "cc", compat / "glibc_compat.c", variables={"flags": ninja.quote(common_flags)})
    n.build(compat_objs[1], "cxx", compat / "glibcxx_compat.cpp", variables={"flags": ninja.quote(common_flags)})
    ldflags = [
        "-Wl,-Bsymbolic",
        "-Wl,--no-undefined", "-Wl,-z,noexecstack", "-pthread", "-lm", "-ldl", *sanitize.link_flags(),
    ]
    libs = []
    for name in selected_variants():
        flags, feature_defs = CPU_LEVELS[name]
        cpu_flags = common_flags + flags + defs + [f"-D{d}" for d in feature_defs] + includes
        cpu_objs = compile_all(CPU_SOURCES, name, cpu_flags)
        api_obj = out / "obj" / name / "cpu_runtime_api.o"
        n.build(api_obj, "cxx", compat / "cpu" / "cpu_runtime_api.cpp", variables={"flags": ninja.quote(cpu_flags)})
        cpu_objs.append(api_obj)
        lib = out / f"{LIB_PREFIX}{name}.so"
        n.build(lib, "link", base_objs + cpu_objs + compat_objs,
                variables={"ldflags": ninja.quote(ldflags + [f"-Wl,-soname,{lib.name}"])})
        libs.append(lib)
    metal_runtime.add_to(n, out=out, src=src, flags=common_flags + defs + includes, base_objs=base_objs,
                         compat_objs=compat_objs, ldflags=ldflags)
    n.write(out / "build.ninja")
    ninja.run(out, jobs)
    return out


def libraries(out: Path | None = None) -> list[Path]:
    out = out or runtime_dir()
    return [out / f"{LIB_PREFIX}{name}.so" for name in selected_variants()]


if __name__ == "__main__":
    print(build())

"""The llama-cpp-python wheel used as an independent oracle (llama.cpp b11312), built once per cache.

Built from the same pinned sdist as our ggml sources (upstream.toml) for an explicit x86-64
instruction set read from this CPU's flags, never ggml's native build: a native build on a CPU with
AMX enables ggml's AMX code, which crashes in `llama_decode` on such a machine (seen on an Intel Xeon,
2026-12-02). The wheel is kept in `<cache>/wheels/<instruction set>/`, so a wheel built on another
CPU (another set) is never reused, and test sessions, benchmarks and CI runs install it in seconds.

    python -m tools.build.llama_cpp_wheel          # prints the wheel's path (building it if needed, ~5 min)
    python -m tools.build.llama_cpp_wheel --isa    # prints the instruction set and its CMake options
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from . import upstream

# ggml's x86 instruction-set options (ggml/CMakeLists.txt) and the /proc/cpuinfo flags each needs,
# lowest first. GGML_AVX512 compiles with AVX512 F, CD, VL, DQ and BW. AMX is never enabled.
X86_OPTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("SSE42", ("sse4_2",)),
    ("AVX", ("avx",)),
    ("F16C", ("f16c",)),
    ("FMA", ("fma",)),
    ("BMI2", ("bmi2",)),
    ("AVX2", ("avx2",)),
    ("AVX_VNNI", ("avx_vnni",)),
    ("AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("AVX512_VBMI", ("avx512vbmi",)),
    ("AVX512_VNNI", ("avx512_vnni",)),
    ("AVX512_BF16", ("avx512_bf16",)),
]
NEVER = ("AMX_TILE", "AMX_INT8", "AMX_BF16")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def instruction_set(flags: set[str] | None = None) -> list[str]:
    """The ggml options (without the GGML_ prefix) this CPU supports; the AVX-512 extensions only
    where AVX-512 itself is on."""
    flags = cpu_flags() if flags is None else flags
    chosen = [name for name, needs in X86_OPTIONS if all(f in flags for f in needs)]
    if "AVX512" not in chosen:
        chosen = [n for n in chosen if not n.startswith("AVX512")]
    return chosen


def cmake_args(chosen: list[str]) -> list[str]:
    on = {name: name in chosen for name, _ in X86_OPTIONS}
    return (["-DGGML_NATIVE=OFF", "-DLLAVA_BUILD=OFF"]
            + [f"-DGGML_{name}={'ON' if v else 'OFF'}" for name, v in on.items()]
            + [f"-DGGML_{name}=OFF" for name in NEVER])


def cache_tag(chosen: list[str]) -> str:
    """The wheel's cache folder: the instruction set it was built for, in words."""
    return "x86_64-" + ("-".join(n.lower() for n in chosen) or "baseline")


def wheel_path() -> Path:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the oracle wheel is built for x86-64 only (this machine: {platform.machine()})")
    pin = upstream.pin()["sdist"]
    chosen = instruction_set()
    wheels = upstream.cache_dir() / "wheels" / cache_tag(chosen)
    found = sorted(wheels.glob(f"llama_cpp_python-{pin['version']}-*.whl"))
    if found:
        return found[-1]
    sdist = upstream.sdist_path()
    wheels.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(cmake_args(chosen))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    print(f"[llama-cpp] building the oracle wheel from {sdist.name} for {cache_tag(chosen)} "
          "(one time, a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(sdist)],
                   check=True, env=env, stdout=sys.stderr)
    found = sorted(wheels.glob(f"llama_cpp_python-{pin['version']}-*.whl"))
    if not found:
        raise RuntimeError("llama-cpp-python wheel build produced no wheel")
    return found[-1]


if __name__ == "__main__":
    if "--isa" in sys.argv[1:]:
        chosen = instruction_set()
        print(cache_tag(chosen))
        print(" ".join(cmake_args(chosen)))
    else:
        print(wheel_path())

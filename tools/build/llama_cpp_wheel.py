"""The llama-cpp-python wheel used as an independent oracle (llama.cpp b11312), built once per cache.

Built from the same pinned sdist as our ggml sources (upstream.toml), for this CPU (ggml native),
and kept in <cache>/wheels, so test sessions, benchmarks and CI runs install it in seconds.

    python -m tools.build.llama_cpp_wheel     # prints the wheel's path (building it if needed, ~5 min)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import upstream


def wheel_path() -> Path:
    pin = upstream.pin()["sdist"]
    wheels = upstream.cache_dir() / "wheels"
    found = sorted(wheels.glob(f"llama_cpp_python-{pin['version']}-*.whl"))
    if found:
        return found[-1]
    sdist = upstream.sdist_path()
    wheels.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("CMAKE_ARGS", "-DLLAVA_BUILD=OFF")
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    print(f"[llama-cpp] building the oracle wheel from {sdist.name} (one time, a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(sdist)],
                   check=True, env=env, stdout=sys.stderr)
    found = sorted(wheels.glob(f"llama_cpp_python-{pin['version']}-*.whl"))
    if not found:
        raise RuntimeError("llama-cpp-python wheel build produced no wheel")
    return found[-1]


if __name__ == "__main__":
    print(wheel_path())

"""The fast tests on builds instrumented with AddressSanitizer and UBSan (`nox -s sanitize`).

`GGML_KERNELS_SANITIZE=1` makes the builder compile our C++ (common/, the torch bindings, the CPU
backends) and ggml's CPU runtime with `-fsanitize=address,undefined`. Such builds never mix with the
ordinary ones: the runtime goes to its own cache folder (`runtime-sanitize`, one CPU level), and the
builder refuses to write sanitized packages into a git checkout. This tool copies the checkout
(tracked and untracked files, not ignored ones) to `.nox/sanitize-tree`, builds there and runs the
tests there under the sanitizers:

    python -m tools.build.sanitize [pytest args]     # default: the fast tier, -m "not slow"

Torch, Python and llama.cpp's oracle are not instrumented. ASan's runtime (and libstdc++, whose
`__cxa_throw` ASan must find at start-up, or the first C++ exception aborts) is preloaded into every
Python process of the run, subprocesses included; leak checks are off (Python and torch keep memory
until exit by design). Any ASan or UBSan report ends its process, so the test fails; pytest leaves
the stderr of its own process uncaptured (`--capture=sys`) so that a report is printed whole. The
reports UBSan must not stop on, each justified, are in `ubsan-suppressions.txt` beside this file
(runtime suppressions need recoverable checks: UBSan's are, `halt_on_error=1` makes them fatal).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools import REPO

ENV = "GGML_KERNELS_SANITIZE"
COMPILE_FLAGS = [
    "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g",
    "-DGGML_KERNELS_NO_GLIBC_COMPAT",  # calls reach the sanitizers' interceptors, not pinned glibc versions
]
LINK_FLAGS = ["-fsanitize=address,undefined"]
CPU_LEVEL = "haswell"  # one level instruments ggml's SIMD code paths and runs on any x86-64 CI machine
TREE = REPO / ".nox" / "sanitize-tree"
UBSAN_SUPPRESSIONS = Path(__file__).with_name("ubsan-suppressions.txt")
# Tests of what a shipped build must be, which a sanitized build is not, on purpose.
NOT_FOR_SANITIZED_BUILDS = [
    "tests/test_packages.py::test_abi",  # links libasan; glibc's newest symbol versions
    "tests/test_packages.py::test_build_layout_and_metadata",  # one CPU level, not every one
    "tests/test_publishing.py::test_dry_run_lists_the_operations",  # publishing checks the ABI first
    "tests/test_publishing.py::test_to_cache_writes_the_hub_layout",
]


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def compile_flags() -> list[str]:
    return COMPILE_FLAGS if enabled() else []


def link_flags() -> list[str]:
    return LINK_FLAGS if enabled() else []


def refuse_checkout(repo: Path) -> None:
    """Sanitized packages must not replace the builds that tests and users load from a checkout."""
    if enabled() and (repo / ".git").exists():
        raise RuntimeError(f"{ENV}=1 builds only in a copy of the checkout, not in {repo}: "
                           "run `python -m tools.build.sanitize` (or `nox -s sanitize`)")


def mirror(dest: Path = TREE) -> Path:
    """Copies this checkout's files into dest, leaving those whose content is unchanged (and their
    times: ninja rebuilds only what changed), and removes the ones the checkout no longer has."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
    files = sorted({f for f in listed if f and (REPO / f).is_file()})
    manifest = dest / ".mirrored-files"
    previous = set(manifest.read_text().splitlines()) if manifest.exists() else set()
    for gone in previous - set(files):
        (dest / gone).unlink(missing_ok=True)
    for f in files:
        src, dst = REPO / f, dest / f
        if not (dst.exists() and dst.read_bytes() == src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    manifest.write_text("\n".join(files) + "\n")
    return dest


def _compiler_library(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], check=True, capture_output=True,
                          text=True).stdout.strip()
    if not os.path.isabs(path):
        raise RuntimeError(f"gcc does not find {name}: install the compiler's sanitizer runtime (libasan)")
    return os.path.realpath(path)


def run_env(tree: Path) -> dict[str, str]:
    """The environment that loads the tree's sanitized builds (children inherit it)."""
    env = dict(os.environ)
    env.pop("GGML_KERNELS_BUILDS", None)  # the integration finds the tree's builds
    env.pop("LOCAL_KERNELS", None)
    env.update({
        ENV: "1",  # tools that find the runtime (tests/test_metal_host.py) take the sanitized one
        "LD_PRELOAD": ":".join(_compiler_library(n) for n in ("libasan.so", "libstdc++.so.6")),
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": f"print_stacktrace=1:halt_on_error=1:suppressions={UBSAN_SUPPRESSIONS}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(tree / "integration"), env.get("PYTHONPATH")) if p),
    })
    return env


def main() -> int:
    tree = mirror()
    build_env = dict(os.environ, **{ENV: "1", "GGML_KERNELS_CPU_VARIANTS": CPU_LEVEL})
    subprocess.run([sys.executable, "-m", "tools.build", "--no-abi-check"], cwd=tree, env=build_env, check=True)
    deselect = [arg for test in NOT_FOR_SANITIZED_BUILDS for arg in ("--deselect", test)]
    args = sys.argv[1:] or ["-m", "not slow", "-q"]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--capture=sys", *deselect, *args]
    return subprocess.run(cmd, cwd=tree, env=run_env(tree)).returncode


if __name__ == "__main__":
    sys.exit(main())

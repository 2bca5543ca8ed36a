"""The darwin variants built on a Mac with the Mac's own tools (what `nox -s mac` builds and checks).

The same build as tools/build/darwin.py's cross-build (same sources, flags, layout and variant name,
torch<XY>-metal-aarch64-darwin), with:
- Apple clang (`xcrun clang++`, the SDK xcrun selects) for macOS arm64, deployment target 26.0;
- the SDK's real Metal and Foundation frameworks, libobjc and libc++ instead of our stubs, and the
  SDK's CoreFoundation / IOSurface headers instead of our stand-ins;
- the torch of the running interpreter (the session's virtualenv: torch's macOS wheel) instead of
  one unpacked into the cache, so one torch version per run;
- metal-cpp from the `mlx-metal` wheel as on Linux (tools/build/mps_runtime.py fetches it).

No link checks against our stub tables: the Mac's own loader is the check (`nox -s mac` imports the
variants). The runtime is built in runtime-darwin-native/, apart from the cross-built one.

Nothing of this has run yet: no Mac has been available (docs/metal.md).
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

from . import darwin, darwin_toolchain, extension_cache, mps_runtime, upstream

TORCH_DYLIBS = ("c10", "torch_cpu")  # the libraries the builds link (darwin_toolchain.TORCH_LIBS)
APPLE_LIBRARIES = ["-framework", "Metal", "-framework", "Foundation", "-lobjc"]


def host_problem(system: str | None = None, machine: str | None = None, macos: str | None = None) -> str | None:
    """Why this machine cannot build or run the darwin variants natively, or None on an Apple-silicon
    Mac with macOS >= 26 (kernels loads Metal variants there only)."""
    system = platform.system() if system is None else system
    machine = platform.machine() if machine is None else machine
    macos = platform.mac_ver()[0] if macos is None else macos
    if system != "Darwin":
        return (f"this is {system or 'an unknown system'} {machine}, not a Mac: `nox -s mac` needs an Apple-silicon "
                f"Mac with macOS {darwin_toolchain.MIN_MACOS} or later (here, `nox -s build-darwin` cross-builds "
                "the darwin variants and link-checks them)")
    if machine != "arm64":
        return f"this Mac is {machine}, not Apple silicon (arm64): the darwin variants are arm64 only"
    if _version(macos) < _version(darwin_toolchain.MIN_MACOS):
        return (f"this Mac runs macOS {macos or 'unknown'}; the Metal variants need macOS {darwin_toolchain.MIN_MACOS} "
                "or later (kernels loads them there only)")
    return None


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(".")) if text else (0,)
    except ValueError:
        return (0,)


def running_torch() -> darwin_toolchain.TorchMac:
    """The torch of this interpreter, as the darwin build names one: headers and dylibs."""
    import torch

    folder = Path(torch.__file__).parent
    return darwin_toolchain.TorchMac(torch.__version__.split("+")[0], folder / "include", folder / "lib")


@functools.cache
def _clang_identity() -> str:
    return subprocess.run(["xcrun", "clang++", "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]


def compilers(versions: tuple[str, ...] = ()) -> darwin.Compilers:
    """darwin.Compilers for this Mac and its torch. `versions` (darwin.build_all's) must be empty or
    name the running torch: a native build has only that one."""
    problem = host_problem()
    if problem:
        raise RuntimeError(problem)
    torch = running_torch()
    if versions and tuple(versions) != (torch.version,):
        raise ValueError(f"a native build is for the running torch {torch.version} only, not {', '.join(versions)}")
    base = f"xcrun {{}} -arch arm64 -mmacosx-version-min={darwin_toolchain.MIN_MACOS}"
    return darwin.Compilers(
        cc=base.format("clang"), cxx=base.format("clang++"), link=base.format("clang++") + " -shared",
        metal_cpp=mps_runtime.metal_cpp(), includes=(), torch={torch.version: torch},
        link_inputs=lambda t: [f"-L{t.libs}", *(f"-l{name}" for name in TORCH_DYLIBS), *APPLE_LIBRARIES],
        link_deps=lambda t: [t.libs / f"lib{name}.dylib" for name in TORCH_DYLIBS],
        recipe_files=(),
        identity=extension_cache.Toolchain(f"{_clang_identity()}; torch {torch.version}",
                                           (torch.include.parent, torch.include.parent.resolve())),
        runtime_dir=upstream.ggml_tree().parent / "runtime-darwin-native",
        allowed=None)


def build(packages: list[str], jobs: int | None = None) -> list[Path]:
    """Every named package's darwin variant for the running torch, built natively; their folders."""
    return darwin.build_all(packages, (running_torch().version,), jobs, compilers=compilers)

"""Where the kernel builds are: Hub id -> a kernel folder that `kernels` can load.

A kernel folder is what `kernels.get_local_kernel` takes: a folder holding variant folders
(`torch213-cxx11-cpu-x86_64-linux/`, ...) directly or under `build/`, as a package of this repo
after `nox -s build`, or a kernel repository downloaded from the Hub. Looked up, first found wins:

1. `GGML_KERNELS_BUILDS`: entries separated by `os.pathsep`, each `<hub id>=<kernel folder>`, a
   package folder with a `build.toml`, or a folder of such package folders (a checkout's `packages/`);
2. `LOCAL_KERNELS` entries the user set for our Hub ids (kernels' own override, same form as 1's first);
3. the `packages/` folder of the checkout this module lives in (an editable install).

A package folder holds one build per backend (`BACKENDS`): `build/` (CPU), `build-metal-emu/`
(upstream's Metal backend on the emulated device, CPU tensors) and `build-mps-emu/` (the MPS device
layer on its Linux twin: the fake Metal framework and MPS stream over the emulated device, CPU
tensors); `builds(backend)` picks the backend's folder. On an Apple-silicon Mac the "mps" backend
takes the darwin variants beside the CPU ones in `build/` (`torch<XY>-metal-aarch64-darwin`, MPS
tensors), which kernels picks by itself there: its backend is Metal wherever torch has an MPS
device, and it loads a Metal variant on macOS >= 26 only.
"""

from __future__ import annotations

import os
import platform
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

# torch is imported where it is used: tools/build/darwin.py reads the variant names from this file
# in an environment without torch (`nox -s build-darwin`)

BUILDS_ENV = "GGML_KERNELS_BUILDS"
QUANTIZATION = "ggml-org/ggml-quantization"
ATTENTION = "ggml-org/ggml-attn"
# every package the integration can use; only ggml-quantization is required
HUB_IDS = (QUANTIZATION, "ggml-org/ggml-norm", ATTENTION, "ggml-org/ggml-gated-delta-net", "transformers-community/topk")
CHECKOUT_PACKAGES = Path(__file__).resolve().parents[2] / "packages"


LINUX_CPU = "cpu-x86_64-linux"  # the arch part of a CPU build's variant name
DARWIN_METAL = "metal-aarch64-darwin"  # the arch part of a darwin (MPS) build's variant name
MIN_MACOS = "26.0"  # kernels loads a Metal variant on macOS >= 26 only (the darwin builds' deployment target)


@dataclass(frozen=True)
class Backend:
    """What `enable(backend=...)` loads and what it may do there."""

    folder: str  # the build folder inside a package folder
    # upstream's Metal host code picks each kernel: every package is required (a call left on a CPU
    # build would not be checked) and the ggml-cpu paths (dense_prefill, repack_weights) stay off
    metal: bool
    device: str = "cpu"  # where the model's tensors are, the device the layer kernels are mapped for
    arch: str = LINUX_CPU  # the variant name's arch part

    @property
    def emulated(self) -> bool:
        """Metal on the emulated device: the builds log their Metal dispatches (`metal_dispatches()`)."""
        return self.metal and self.device == "cpu"

    @property
    def required(self) -> tuple[str, ...]:
        """The Hub ids enable() cannot run without."""
        return HUB_IDS if self.metal else (QUANTIZATION,)

    def variant(self, torch_version: str | None = None) -> str:
        """The variant folder name of this backend's builds for `torch_version` (default: the running
        torch), as kernels names them: Linux builds carry the C++ ABI, darwin builds none."""
        if torch_version is None:
            import torch

            torch_version = torch.__version__
        major, minor = torch_version.split("+")[0].split(".")[:2]
        if not self.arch.endswith("-linux"):
            return f"torch{major}{minor}-{self.arch}"
        import torch

        abi = "cxx11" if torch._C._GLIBCXX_USE_CXX11_ABI else "cxx98"
        return f"torch{major}{minor}-{abi}-{self.arch}"


BACKENDS = {
    "cpu": Backend("build", metal=False),
    "metal-emu": Backend("build-metal-emu", metal=True),
    "mps-emu": Backend("build-mps-emu", metal=True),
    # the darwin variants, beside the CPU ones in build/, on torch's MPS device
    "mps": Backend("build", metal=True, device="mps", arch=DARWIN_METAL),
}


def cpu_variant() -> str:
    """The variant folder name of a CPU build for the running torch."""
    return BACKENDS["cpu"].variant()


def host_problem(backend: str) -> str | None:
    """Why this machine cannot run `backend`, or None: the "mps" backend needs an Apple-silicon Mac
    with macOS >= `MIN_MACOS` and torch's MPS device; the others run anywhere our builds load."""
    if backend_of(backend).device != "mps":
        return None
    import torch

    system, machine, macos = platform.system(), platform.machine(), platform.mac_ver()[0]
    mps = torch.backends.mps.is_available()
    if system == "Darwin" and machine == "arm64" and _version(macos) >= _version(MIN_MACOS) and mps:
        return None
    here = f"macOS {macos or 'unknown'} {machine}" if system == "Darwin" else f"{system or 'an unknown system'} {machine}"
    return (f"the {backend} backend needs macOS {MIN_MACOS} or later on Apple silicon with torch's MPS device; "
            f"this machine is {here}, torch {torch.__version__} (MPS device available: {mps})")


def check_host(backend: str) -> None:
    """RuntimeError saying `host_problem(backend)`, if there is one."""
    problem = host_problem(backend)
    if problem:
        raise RuntimeError(problem)


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return (0,)


def backend_kwargs() -> dict:
    """Our builds are CPU builds; on a CUDA build of torch, kernels must be told to take them."""
    import torch

    return {"backend": "cpu"} if torch.version.cuda else {}


def variant_dir(kernel_folder: Path, backend: str = "cpu") -> Path | None:
    """The variant folder of `backend` for this torch inside a kernel folder, or None."""
    name = backend_of(backend).variant()
    for candidate in (kernel_folder / name, kernel_folder / "build" / name):
        if (candidate / "__init__.py").is_file():
            return candidate
    return None


def _package_hub_id(folder: Path) -> str | None:
    toml = folder / "build.toml"
    if not toml.is_file():
        return None
    with open(toml, "rb") as f:
        return tomllib.load(f).get("general", {}).get("hub", {}).get("repo-id")


def _entries(value: str | None) -> dict[str, Path]:
    """Hub id -> folder from one path-list variable (`id=path`, package folders, folders of packages)."""
    found: dict[str, Path] = {}
    for entry in filter(None, (value or "").split(os.pathsep)):
        repo_id, sep, path = entry.partition("=")
        if sep:
            found.setdefault(repo_id, Path(path).expanduser())
            continue
        folder = Path(entry).expanduser()
        for package in [folder, *sorted(p for p in folder.glob("*") if p.is_dir())]:
            repo_id = _package_hub_id(package)
            if repo_id:
                found.setdefault(repo_id, package)
    return found


def backend_of(name: str) -> Backend:
    """The `BACKENDS` entry of `name`; ValueError naming the known ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def required(backend: str) -> tuple[str, ...]:
    """The Hub ids `enable(backend=...)` cannot run without."""
    return backend_of(backend).required


def _for_backend(folder: Path, backend: str) -> Path:
    """The kernel folder of `backend` in a package folder (the folder itself for the builds in build/,
    whose variants kernels finds there); a kernel folder stays as it is."""
    if BACKENDS[backend].folder == "build" or not (folder / "build.toml").is_file():
        return folder
    return folder / BACKENDS[backend].folder


def builds(backend: str = "cpu") -> dict[str, Path]:
    """Hub id -> kernel folder, for each of `HUB_IDS` that has a `backend` build for this torch. A
    `GGML_KERNELS_BUILDS` entry that gives none (a mistyped path, a package not built for this
    torch or backend) is passed over with a UserWarning that names it and what is used instead."""
    backend_of(backend)
    named = _entries(os.environ.get(BUILDS_ENV))
    sources = [named, _entries(os.environ.get("LOCAL_KERNELS")), _entries(str(CHECKOUT_PACKAGES))]
    out = {}
    for repo_id in HUB_IDS:
        for source in sources:
            folder = source.get(repo_id)
            folder = None if folder is None else _for_backend(folder, backend)
            if folder is not None and variant_dir(folder, backend) is not None:
                out[repo_id] = folder
                break
    _warn_unused_entries(named, out, backend)
    return out


def _warn_unused_entries(named: dict[str, Path], used: dict[str, Path], backend: str) -> None:
    """A UserWarning for each `GGML_KERNELS_BUILDS` entry `builds` could not take."""
    variant = backend_of(backend).variant()
    for repo_id, folder in named.items():
        if repo_id in HUB_IDS and used.get(repo_id) != _for_backend(folder, backend):
            instead = f"using {used[repo_id]}" if repo_id in used else "no other build was found"
            warnings.warn(f"{BUILDS_ENV} names {folder} for {repo_id}, which holds no {backend} build for "
                          f"{variant}: {instead}", UserWarning, stacklevel=3)
    for entry in filter(None, os.environ.get(BUILDS_ENV, "").split(os.pathsep)):
        if "=" not in entry and not _entries(entry):
            warnings.warn(f"{BUILDS_ENV} entry {entry} is neither `<hub id>=<folder>` nor a package folder "
                          "(one with a build.toml) or a folder of them: ignored", UserWarning, stacklevel=3)


def not_found_message(backend: str = "cpu", missing: tuple[str, ...] = (QUANTIZATION,)) -> str:
    how = ("in a checkout build the darwin variants (`nox -s mac` on the Mac, or `nox -s build-darwin` on Linux)"
           if backend_of(backend).device == "mps" else "in a checkout run `nox -s build`")
    return (
        f"no {backend} build of {', '.join(missing)} for {backend_of(backend).variant()} was found: set {BUILDS_ENV} to "
        f"the kernel folders (or `<hub id>=<folder>` entries), or {how}"
    )

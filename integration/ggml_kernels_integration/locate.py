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
tensors); `builds(backend)` picks the backend's folder.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

BUILDS_ENV = "GGML_KERNELS_BUILDS"
QUANTIZATION = "ggml-org/ggml-quantization"
ATTENTION = "ggml-org/ggml-attn"
# every package the integration can use; only ggml-quantization is required
HUB_IDS = (QUANTIZATION, "ggml-org/ggml-norm", ATTENTION, "ggml-org/ggml-gated-delta-net", "transformers-community/topk")
CHECKOUT_PACKAGES = Path(__file__).resolve().parents[2] / "packages"


@dataclass(frozen=True)
class Backend:
    """What `enable(backend=...)` loads and what it may do there."""

    folder: str  # the build folder inside a package folder
    # upstream's Metal host code picks each kernel: every package is required (a call left on a CPU
    # build would not be checked), the builds log their Metal dispatches (`metal_dispatches()`), and
    # the ggml-cpu paths (dense_prefill, repack_weights) stay off
    metal: bool


BACKENDS = {
    "cpu": Backend("build", metal=False),
    "metal-emu": Backend("build-metal-emu", metal=True),
    "mps-emu": Backend("build-mps-emu", metal=True),
}


def cpu_variant() -> str:
    """The variant folder name of a CPU build for the running torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    abi = "cxx11" if torch._C._GLIBCXX_USE_CXX11_ABI else "cxx98"
    return f"torch{major}{minor}-{abi}-cpu-x86_64-linux"


def backend_kwargs() -> dict:
    """Our builds are CPU builds; on a CUDA build of torch, kernels must be told to take them."""
    return {"backend": "cpu"} if torch.version.cuda else {}


def variant_dir(kernel_folder: Path) -> Path | None:
    """The CPU variant folder for this torch inside a kernel folder, or None."""
    for candidate in (kernel_folder / cpu_variant(), kernel_folder / "build" / cpu_variant()):
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
    return HUB_IDS if backend_of(backend).metal else (QUANTIZATION,)


def _for_backend(folder: Path, backend: str) -> Path:
    """The kernel folder of `backend` in a package folder (the folder itself for the CPU, whose
    variants kernels finds under build/); a kernel folder stays as it is."""
    if backend == "cpu" or not (folder / "build.toml").is_file():
        return folder
    return folder / BACKENDS[backend].folder


def builds(backend: str = "cpu") -> dict[str, Path]:
    """Hub id -> kernel folder, for each of `HUB_IDS` that has a `backend` build for this torch."""
    backend_of(backend)
    sources = [
        _entries(os.environ.get(BUILDS_ENV)),
        _entries(os.environ.get("LOCAL_KERNELS")),
        _entries(str(CHECKOUT_PACKAGES)),
    ]
    out = {}
    for repo_id in HUB_IDS:
        for source in sources:
            folder = source.get(repo_id)
            folder = None if folder is None else _for_backend(folder, backend)
            if folder is not None and variant_dir(folder) is not None:
                out[repo_id] = folder
                break
    return out


def not_found_message(backend: str = "cpu", missing: tuple[str, ...] = (QUANTIZATION,)) -> str:
    return (
        f"no {backend} build of {', '.join(missing)} for {cpu_variant()} was found: set {BUILDS_ENV} to "
        f"the kernel folders (or `<hub id>=<folder>` entries), or in a checkout run `nox -s build`"
    )

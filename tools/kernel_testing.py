"""Helpers for tests: load our builds through `kernels.get_kernel(<hub id>)`, as transformers does,
with LOCAL_KERNELS pointing each Hub id at packages/<name> (kernels then looks in build/)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def hub_ids() -> dict[str, Path]:
    """Hub repo id -> package folder, from each package's build.toml."""
    out = {}
    for toml in sorted((REPO / "packages").glob("*/build.toml")):
        with open(toml, "rb") as f:
            out[tomllib.load(f)["general"]["hub"]["repo-id"]] = toml.parent
    return out


def local_kernels_env() -> str:
    return ":".join(f"{repo}={path}" for repo, path in hub_ids().items())


def point_hub_ids_at_local_builds() -> None:
    os.environ["LOCAL_KERNELS"] = local_kernels_env()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def backend_kwargs() -> dict:
    """Our builds are CPU builds; on a CUDA build of torch, kernels must be told to take them."""
    import torch

    return {"backend": "cpu"} if torch.version.cuda else {}


def load_kernel(repo_id: str):
    import kernels

    path = hub_ids()[repo_id]
    if not any((path / "build").glob("torch*-cpu-*")):
        raise RuntimeError(f"{repo_id} is not built: run `nox -s build` or `python tools/build.py {path.name}`")
    return kernels.get_kernel(repo_id, version=1, **backend_kwargs())


def variant_dir(package: str) -> Path:
    """packages/<package>/build/<variant> for the running torch: what LocalLayerRepository must be
    given. A package folder makes kernels pick the variant by torch's backend, which on a CUDA build
    of torch is a cu* variant we do not build (and kernelize's repositories take no backend)."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    from build import torch_variant

    path = REPO / "packages" / package / "build" / torch_variant()
    if not (path / "metadata.json").exists():
        raise RuntimeError(f"{package} is not built for this torch: run `python tools/build.py {package}`")
    return path

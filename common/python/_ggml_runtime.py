"""Python glue every package shares. tools/build/build.py copies this file into each build folder (a Hub
build must be self-contained), next to the generated _ops.py; import it as `from ._ggml_runtime
import info, same_device`."""

from __future__ import annotations

import torch

from . import _ops

_extension = getattr(_ops, _ops.ops.name)  # the compiled module: the ops' namespace is its name


def info() -> dict[str, str]:
    """Which ggml runtime this build loaded: CPU level, library path, ggml version and commit."""
    return {
        "cpu_variant": _extension.cpu_variant(),
        "runtime": _extension.runtime_path(),
        "ggml": _extension.ggml_version(),
    }


def same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """For fake (meta) implementations: tensors on two devices dispatch there (the meta key outranks
    the others), so they are refused there, by name."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {devices}")

"""Python glue every package shares. tools/build/build.py copies this file into each build folder (a Hub
build must be self-contained), next to the generated _ops.py; import it as `from ._ggml_runtime
import info, same_device`."""

from __future__ import annotations

import torch

from . import _ops

_extension = getattr(_ops, _ops.ops.name)  # the compiled module: the ops' namespace is its name
# "cpu", or "metal-emu": the emulated-Metal build (build-metal-emu/), which alone carries _metal_emu.py
BACKEND = _extension.backend()


def info() -> dict[str, str]:
    """Which ggml runtime this build loaded: its backend ("cpu", or "metal-emu": upstream's Metal
    backend on the emulated device), CPU level (CPU builds), library path, ggml version and commit."""
    return {
        "backend": BACKEND,
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


def dtype_name(dtype: torch.dtype) -> str:
    """torch's C++ name of a dtype ("Float", "BFloat16"), as the kernels' messages spell it."""
    try:
        return torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")
    except (RuntimeError, TypeError):
        return str(dtype).removeprefix("torch.")


def check_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], name: str) -> None:
    if t.dtype not in allowed:
        want = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {want}; got {dtype_name(t.dtype)}")


def check_dim(t: torch.Tensor, dim: int, name: str) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {list(t.shape)}")

"""Python glue every package shares. tools/build/build.py copies this file into each build folder (a Hub
build must be self-contained), next to the generated _ops.py; import it as `from ._ggml_runtime
import info, same_device`."""

from __future__ import annotations

import torch

from . import _ops

_extension = getattr(_ops, _ops.ops.name)  # the compiled module: the ops' namespace is its name
# "cpu"; "metal" (MPS tensors: the darwin build); on CPU tensors, the emulated builds, which alone carry
# _metal_emu.py (never on the Hub): "metal-emu" (upstream's Metal backend on the emulated device,
# build-metal-emu/) and "mps-emu" (the MPS device layer's Linux twin, build-mps-emu/)
BACKEND = _extension.backend()
EMULATED_METAL = ("metal-emu", "mps-emu")
METAL = BACKEND == "metal" or BACKEND in EMULATED_METAL  # upstream's Metal kernels run the ops


def info() -> dict[str, str]:
    """Which ggml runtime this build loaded: its backend ("cpu", "metal", or on CPU tensors "metal-emu"
    / "mps-emu": upstream's Metal backend on the emulated device / the MPS device layer's Linux twin),
    CPU level (CPU builds), library path, ggml version and commit."""
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


# The largest tensor an op reads or makes, numel * element size with expanded (stride-0) dims counted in
# full (kMaxTensorBytes in common/ggml_torch.h): above it the kernels raise ValueError before any copy.
MAX_TENSOR_BYTES: int = _extension.max_tensor_bytes()


def check_size(t: torch.Tensor, name: str) -> None:
    """The kernels' size check, for a wrapper about to reshape `t` (a reshape of an expanded tensor
    copies it whole): ValueError, with the kernels' words, if it is bigger than MAX_TENSOR_BYTES."""
    size = t.numel() * t.element_size()
    if size > MAX_TENSOR_BYTES:
        raise ValueError(f"{name} of shape {list(t.shape)} and dtype {dtype_name(t.dtype)} would take "
                         f"{size / 2**30:g} GiB; ggml-kernels takes tensors of at most {MAX_TENSOR_BYTES >> 30} "
                         "GiB (2^35 bytes), an expanded (stride-0) dim counted in full")


def check_dim(t: torch.Tensor, dim: int, name: str) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {list(t.shape)}")


# A float argument of an op (eps, scale, softcap) reaches ggml as a float32: a finite double beyond its
# range would be inf there. The kernels' test and words (fits_float32, kFloat32Range in common/ggml_torch.h).
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_RANGE = ", within float32's range (magnitude at most 3.40282e+38: ggml computes in float32)"


def fits_float32(value: float) -> bool:
    """Finite, and finite as a float32 too (NaN fails the comparison)."""
    return abs(value) <= FLOAT32_MAX

"""Python glue every package shares. tools/build/build.py copies this file into each build folder (a Hub
build must be self-contained), next to the generated _ops.py; import it as `from ._ggml_runtime
import info, same_device`."""

from __future__ import annotations

import json

import torch

from . import _ops

_extension = getattr(_ops, _ops.ops.name)  # the compiled module: the ops' namespace is its name


def info() -> dict[str, str]:
    """Which ggml runtime this build loaded: its backend ("cpu", or "metal-emu": upstream's Metal
    backend on the emulated device), CPU level (CPU builds), library path, ggml version and commit."""
    return {
        "backend": _extension.backend(),
        "cpu_variant": _extension.cpu_variant(),
        "runtime": _extension.runtime_path(),
        "ggml": _extension.ggml_version(),
    }


def metal_dispatches() -> dict[str, int]:
    """Metal builds: {kernel name: threadgroups dispatched} since the build was loaded or
    reset_metal_dispatches() last ran, as upstream's host code encoded them (e.g.
    {"kernel_mul_mv_ext_q4_K_f32_r1_4": 12}). A CPU build raises RuntimeError."""
    return json.loads(_extension.metal_threadgroups_json())


def metal_dispatch_records() -> list[dict]:
    """Metal builds: every dispatch since the last reset (the first 20000): kernel, pipeline,
    function constants, grid, threads per threadgroup, threadgroup memory, bindings."""
    return json.loads(_extension.metal_dispatches_json())


def reset_metal_dispatches() -> None:
    """Metal builds: start metal_dispatches() from zero."""
    _extension.metal_reset_dispatches()


def set_lane_schedule(reverse: bool, lane_zero_convergence: bool = True) -> None:
    """Metal emulation: the order in which the lanes of a SIMD group run between two rendezvous
    points (forward or reverse). Kernels that are correct on a GPU give bit-identical results in
    both; tests run each op under both. lane_zero_convergence=False drops the rendezvous the
    emulator puts around `if (tiisg == 0)` branches (a GPU's lock-step gives them for free), to
    show the kernels that rely on it."""
    _extension.metal_set_lane_schedule(int(bool(reverse)) | (0 if lane_zero_convergence else 2))


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

"""Normalisations with ggml's own CPU kernels: RMS norm (plain, weighted, zero-centred, with bias,
Llama's rounding), the gated RMS norm of Qwen3.5's linear attention, and L2 norm.

Every function normalises the last dim of `x` (any leading shape), takes float32, bfloat16 or
float16 and accumulates in float32 (ggml sums the squares in double); the output has x's dtype
unless said otherwise.
"""

from __future__ import annotations

import torch

from . import layers, reference
from ._ggml_runtime import (
    BACKEND,
    EMULATED_METAL,
    FLOAT32_RANGE,
    check_dtype,
    fits_float32,
    info,
    same_device,
)
from ._ops import add_op_namespace_prefix, ops

__all__ = [
    "L2_NORM_MODES",
    "info",
    "l2_norm",
    "layers",
    "reference",
    "rms_norm",
    "rms_norm_gated",
]

if BACKEND in EMULATED_METAL:  # the emulated-Metal builds (never on the Hub) alone have them
    from ._metal_emu import metal_dispatches, reset_metal_dispatches

    __all__ += ["metal_dispatches", "reset_metal_dispatches"]


L2_NORM_MODES = ("clamp", "rsqrt")
_MODE_ERROR = ('mode must be "clamp" (x / max(||x||, eps), ggml\'s l2_norm) or "rsqrt" (x / sqrt(||x||^2 + eps), '
               'transformers\' l2norm), got "{mode}"')



def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    zero_centered: bool = False,
    bias: torch.Tensor | None = None,
    *,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    """`x / sqrt(mean(x**2, -1) + eps)`, then `* weight` (`* (1 + weight)` if `zero_centered`, as
    Qwen3.5 and Gemma store their norms), then `+ bias`; all in float32, rounded once to x's dtype.

    `cast_before_weight=True` rounds like Llama/Qwen3's RMSNorm instead: `weight * norm(x).to(x.dtype)`,
    whose dtype is `torch.promote_types(x.dtype, weight.dtype)` (so float32 for a bf16 x and a
    float32 weight); it needs a weight and takes no bias.
    """
    return ops.rms_norm.default(x, weight, bias, float(eps), bool(zero_centered), bool(cast_before_weight))


def rms_norm_gated(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    cast_before_weight: bool = True,
) -> torch.Tensor:
    """`rms_norm(x) * weight * silu(z)` for a gate z of x's shape, in x's dtype: the gated norm of
    Qwen3.5's linear attention (transformers' `Qwen3_5RMSNormGated`).

    By default it rounds where transformers does: the norm to x's dtype, the weighted norm to
    `promote_types(x.dtype, weight.dtype)`, then times `silu(z)` computed in float32, then to x's
    dtype. `cast_before_weight=False` keeps everything in float32 until the end, as llama.cpp does.
    The two agree exactly for float32 x and weight.
    """
    return ops.rms_norm_gated.default(x, z, weight, float(eps), bool(cast_before_weight))


def l2_norm(x: torch.Tensor, eps: float = 1e-6, mode: str = "clamp") -> torch.Tensor:
    """L2-normalise the last dim.

    mode "clamp" (default): `x / max(||x||, eps)`, ggml's `ggml_l2_norm` (llama.cpp's Qwen3.5 q/k
        norm), the same formula as `torch.nn.functional.normalize(x, dim=-1, eps=eps)`.
    mode "rsqrt": `x * rsqrt(||x||**2 + eps)`, transformers' (and FLA's) `l2norm` used by
        Qwen3.5's gated delta net.

    The two differ by about `eps / (2 ||x||**2)` relatively, and for short vectors: below
    ||x|| ~ sqrt(eps) "rsqrt" shrinks x towards 0 while "clamp" still returns a unit vector down to
    ||x|| = eps.
    """
    if mode not in L2_NORM_MODES:
        raise ValueError(_MODE_ERROR.format(mode=mode))
    return ops.l2_norm.default(x, float(eps), mode)


# ---- fake (meta) implementations: shapes only, so torch.compile traces without graph breaks ----
# Mixed devices dispatch here too (the meta key outranks the others), so they are refused here; the
# kernel's other shape and dtype rules are checked here with its words, so a traced call fails as an
# eager one.

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_common(x: torch.Tensor, eps: float) -> None:
    check_dtype(x, _FLOAT_DTYPES, "x")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim (..., n), got a 0-D tensor")
    if not (fits_float32(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0{FLOAT32_RANGE}, got {eps:g}")


def _check_vector(name: str, t: torch.Tensor, n: int) -> None:
    check_dtype(t, _FLOAT_DTYPES, name)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be 1-D with {n} values (x's last dim), got shape {list(t.shape)}")


@torch.library.register_fake(add_op_namespace_prefix("rms_norm"))
def _rms_norm_fake(x, weight, bias, eps, zero_centered, cast_before_weight):
    same_device("rms_norm", x=x, weight=weight, bias=bias)
    _check_common(x, eps)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            _check_vector(name, t, x.shape[-1])
    if zero_centered and weight is None:
        raise ValueError("zero_centered needs a weight: it computes norm(x) * (1 + weight)")
    if cast_before_weight:
        if weight is None:
            raise ValueError("cast_before_weight needs a weight: it computes weight * norm(x).to(x.dtype)")
        if zero_centered or bias is not None:
            raise ValueError("cast_before_weight (Llama's rounding: weight * norm(x).to(x.dtype)) takes no bias "
                             "and cannot be zero_centered")
        return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_gated"))
def _rms_norm_gated_fake(x, z, weight, eps, cast_before_weight):
    same_device("rms_norm_gated", x=x, z=z, weight=weight)
    _check_common(x, eps)
    check_dtype(z, _FLOAT_DTYPES, "z")
    if z.shape != x.shape:
        raise ValueError(f"z (the gate) must have x's shape {list(x.shape)}, got {list(z.shape)}")
    _check_vector("weight", weight, x.shape[-1])
    return x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("l2_norm"))
def _l2_norm_fake(x, eps, mode):
    _check_common(x, eps)
    if mode not in L2_NORM_MODES:
        raise ValueError(_MODE_ERROR.format(mode=mode))
    return x.new_empty(x.shape)

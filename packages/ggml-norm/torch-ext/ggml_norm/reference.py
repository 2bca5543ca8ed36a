"""Pure-PyTorch references of every ggml-norm function: same arguments, same output dtype, same
rounding points; float32 arithmetic in place of ggml's (which sums the squares in double, so the
two agree to a few float32 ulps before the final rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["l2_norm", "rms_norm", "rms_norm_gated"]


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    zero_centered: bool = False,
    bias: torch.Tensor | None = None,
    *,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    y = _normalized(x, eps)
    if cast_before_weight:
        if weight is None or zero_centered or bias is not None:
            raise ValueError("cast_before_weight needs a weight, takes no bias and cannot be zero_centered")
        return weight * y.to(x.dtype)  # dtype promote(weight, x)
    if weight is not None:
        y = y * (1.0 + weight.float() if zero_centered else weight.float())
    elif zero_centered:
        raise ValueError("zero_centered needs a weight")
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rms_norm_gated(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    cast_before_weight: bool = True,
) -> torch.Tensor:
    y = _normalized(x, eps)
    if cast_before_weight:
        y = weight * y.to(x.dtype)  # rounded to promote(weight, x), as transformers' Qwen3.5 does
    else:
        y = y * weight.float()
    return (y * F.silu(z.float())).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6, mode: str = "clamp") -> torch.Tensor:
    xf = x.float()
    ss = (xf * xf).sum(-1, keepdim=True)
    if mode == "clamp":
        y = xf / ss.sqrt().clamp_min(eps)
    elif mode == "rsqrt":
        y = xf * torch.rsqrt(ss + eps)
    else:
        raise ValueError(f"mode must be 'clamp' or 'rsqrt', got {mode!r}")
    return y.to(x.dtype)

"""Pure-PyTorch reference of ggml-attn: attention written out, in float64 by default.

Same arguments and layout as `flash_attn`: q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D) -> (B, Hq, Sq, Dv).
"""

from __future__ import annotations

import torch


def flash_attn(q, k, v, mask=None, scale=None, causal=False, softcap=None, sinks=None, compute_dtype=torch.float64):
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    vf = vf.repeat_interleave(group, dim=1)
    logits = qf @ kf.transpose(-1, -2) * (scale or d**-0.5)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    bias = torch.zeros(sq, skv, dtype=compute_dtype)
    if causal:
        visible = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
        bias = bias.masked_fill(~visible, float("-inf"))
    logits = logits + bias
    if mask is not None:
        m = mask
        while m.dim() < 4:
            m = m.unsqueeze(0) if m.dim() == 2 else m.unsqueeze(1)
        logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.to(compute_dtype)
    if sinks is not None:  # one extra logit per head that takes probability mass but adds no value
        sink = sinks.to(compute_dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)
        logits = torch.cat([logits, sink], dim=-1)
    peak = logits.amax(-1, keepdim=True)
    dead = peak == float("-inf")  # every key masked: zeros, not NaN
    weights = torch.exp(logits - torch.where(dead, 0.0, peak))  # a +inf or NaN logit gives NaN, as in SDPA
    weights = torch.where(dead, 0.0, weights / weights.sum(-1, keepdim=True))
    if sinks is not None:
        weights = weights[..., :-1]
    return (weights @ vf).to(q.dtype)


def apply_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' `apply_rotary_pos_emb` (rotate_half form): x * cos + rotate_half(x) * sin with
    cos / sin unsqueezed at `unsqueeze_dim`, for q and k, in their dtype."""

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

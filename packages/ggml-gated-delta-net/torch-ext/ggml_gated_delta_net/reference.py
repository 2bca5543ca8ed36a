"""Readable pure-PyTorch reference for the package's ops: plain loops over tokens, written for
clarity, not speed. Same signatures and conventions as the package functions.

Everything is computed in float32 (or float64 when the inputs are float64, which tests use as
ground truth) and the outputs are cast like the kernels' (activations back to the input dtype,
states and gates float32 unless the inputs are float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "gated_delta_net", "gated_rms_norm", "gates", "l2_norm"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    xf = x.to(_compute_dtype(x))
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gates(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    dt = _compute_dtype(A_log, a, dt_bias, b)
    g = -torch.exp(A_log.to(dt)) * F.softplus(a.to(dt) + dt_bias.to(dt))
    beta = torch.sigmoid(b.to(dt))
    return g, beta


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) * silu(gate)."""
    dt = _compute_dtype(x, gate, weight)
    xf = x.to(dt)
    normed = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(dt) * normed * F.silu(gate.to(dt))).to(x.dtype)


def gated_delta_net(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    l2_normalize_qk: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time.

    q, k (B, T, Hk, D); v (B, T, Hv, Dv); g, beta (B, T, Hv); state (B, Hv, D, Dv) or None.
    Value head h reads key head h // (Hv // Hk). For every token t and head h, with S = state[b, h]
    (rows: key dim, columns: value dim):

        S     = S * exp(g[t])
        delta = beta[t] * (v[t] - S^T k[t])
        S     = S + outer(k[t], delta)
        o[t]  = S^T (scale * q[t])            scale = D ** -0.5 unless given
    """
    dt = _compute_dtype(q, k, v, g, beta, state)
    batch, tokens, key_heads, head_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    group = value_heads // key_heads
    scale = head_dim**-0.5 if scale is None else scale

    qf, kf, vf, gf, bf = (x.to(dt) for x in (q, k, v, g, beta))
    if l2_normalize_qk:
        qf, kf = l2_norm(qf), l2_norm(kf)
    # every value head gets its key head: 0, 0, 1, 1, ... for two value heads per key head
    qf = qf.repeat_interleave(group, dim=2) * scale
    kf = kf.repeat_interleave(group, dim=2)

    S = torch.zeros(batch, value_heads, head_dim, value_dim, dtype=dt) if state is None else state.to(dt).clone()
    out = torch.empty(batch, tokens, value_heads, value_dim, dtype=dt)
    for t in range(tokens):
        q_t, k_t, v_t = qf[:, t], kf[:, t], vf[:, t]  # (B, H, D)
        S = S * torch.exp(gf[:, t])[:, :, None, None]
        predicted = torch.einsum("bhij,bhi->bhj", S, k_t)  # S^T k
        delta = bf[:, t][:, :, None] * (v_t - predicted)
        S = S + k_t[:, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhij,bhi->bhj", S, q_t)  # S^T q
    return out.to(q.dtype), S


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y[:, c, t] = act(bias[c] + sum_j weight[c, j] * h[:, c, t + j]) with h = [state | x] (the
    last K - 1 state columns, zeros without a state). New state: the last W columns of [state | x]
    (W = state's width, or K)."""
    dt = _compute_dtype(x, weight, state, bias)
    batch, channels, tokens = x.shape
    w = weight.reshape(channels, -1).to(dt)
    kernel = w.shape[1]
    width = kernel if state is None else state.shape[-1]
    past = torch.zeros(batch, channels, width, dtype=dt) if state is None else state.to(dt)
    history = torch.cat([past, x.to(dt)], dim=-1)  # (B, C, W + T)

    y = torch.empty(batch, channels, tokens, dtype=dt)
    for t in range(tokens):
        end = width + t + 1  # history[..., end - 1] is x[..., t]
        window = history[:, :, end - kernel : end]
        y[:, :, t] = (window * w).sum(-1)
    if bias is not None:
        y = y + bias.to(dt)[:, None]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    new_state = history[:, :, -width:].to(state.dtype if state is not None else x.dtype)
    return y.to(x.dtype), new_state

"""Gated delta net (Qwen3.5 / Qwen3-Next linear attention) with ggml's own CPU kernels.

Shapes follow transformers (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`):

- `gated_delta_net(q, k, v, g, beta, state=None, *, l2_normalize_qk=False, scale=None)`
  q, k `(B, T, Hk, D)`, v `(B, T, Hv, D)` with Hv a multiple of Hk (value head h reads key head
  `h // (Hv // Hk)`, transformers' `repeat_interleave`), g and beta `(B, T, Hv)`, state
  `(B, Hv, D, D)` float32 indexed `[key dim, value dim]`. Per head and token:
  `S <- S * exp(g)`, `delta = beta * (v - S^T k)`, `S <- S + k delta^T`, `o = S^T (scale * q)`.
  `scale=None` is `D ** -0.5`, applied to q after the optional L2 normalisation, as transformers'
  torch paths and FLA do (ggml itself always divides by sqrt(D); q is pre-scaled to match).
  Returns `(o (B, T, Hv, D) in q's dtype, final state (B, Hv, D, D) float32)`. The final state
  is in ggml's memory layout, a transposed view (`state.transpose(-1, -2).is_contiguous()`):
  handed back as `state` (directly, or through transformers' cache, whose `zeros_like` keeps the
  strides) it is used without a copy; a contiguous state is transposed on the way in.
- `gated_delta_net_(q, k, v, g, beta, state, *, l2_normalize_qk=False, scale=None)`: the same with
  the final state written over `state` (which must be in ggml's layout, as above), returning only
  the output: a decode step with a cache neither allocates a new state nor copies one back.
- `causal_conv1d(x, weight, state=None, activation="silu", *, bias=None)`: x `(B, C, T)`, weight
  `(C, 1, K)` or `(C, K)`, state `(B, C, W)` with W >= K - 1 (transformers' cache keeps W = K) ->
  `(y (B, C, T) in x's dtype, new state (B, C, W))`, y[t] = act(sum_j w[j] * [state | x][t + j]).
  The new state is the last W columns of `[state | x]` (W = K when state is None).
- `causal_conv1d_(x, weight, state, activation="silu", *, bias=None)`: the same with the new state
  written over `state` (float32 or x's dtype), returning y. A decode step on transformers' K-wide
  cache rolls the state in place and convolves it there.
- `l2_norm(x, eps=1e-6)`: `x * rsqrt(sum(x^2) + eps)` over the last dim (transformers' `l2norm`).
- `gates(A_log, a, dt_bias, b)` -> `(g, beta)` float32: `g = -exp(A_log) * softplus(a + dt_bias)`,
  `beta = sigmoid(b)`.
- `gated_rms_norm(x, gate, weight, eps=1e-6)`: `weight * rms_norm(x) * silu(gate)` (Qwen3.5's
  `Qwen3_5RMSNormGated`).

Head dims 32, 64 and 128 (key and value dims equal), float32 / bfloat16 / float16 activations,
float32 state. `layers.Qwen3_5GatedDeltaNet` is the kernels-library layer for transformers'
module of the same name.
"""

from __future__ import annotations

import torch

from . import _checks, layers, reference
from ._checks import HEAD_DIMS
from ._ggml_runtime import BACKEND, EMULATED_METAL, info, same_device
from ._ops import add_op_namespace_prefix, ops

__all__ = [
    "HEAD_DIMS",
    "L2_EPS",
    "causal_conv1d",
    "causal_conv1d_",
    "gated_delta_net",
    "gated_delta_net_",
    "gated_rms_norm",
    "gates",
    "info",
    "l2_norm",
    "layers",
    "reference",
]

if BACKEND in EMULATED_METAL:  # the emulated-Metal builds (never on the Hub) alone have them
    from ._metal_emu import metal_dispatches, reset_metal_dispatches

    __all__ += ["metal_dispatches", "reset_metal_dispatches"]


# transformers' (and FLA's) l2norm epsilon; gated_delta_net(l2_normalize_qk=True) uses it.
L2_EPS = 1e-6



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
    """The gated delta rule over a sequence (prefill, T > 1) or one token (decode, T = 1), with
    ggml's GATED_DELTA_NET. Returns `(output, final_state)`; see the module docstring."""
    return ops.gated_delta_net.default(q, k, v, g, beta, state, bool(l2_normalize_qk), None if scale is None else float(scale))


def gated_delta_net_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    l2_normalize_qk: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """`gated_delta_net` updating `state` in place (ggml's layout: `state.transpose(-1, -2)`
    contiguous, as the states `gated_delta_net` returns are). Returns the output."""
    return ops.gated_delta_net_.default(q, k, v, g, beta, state, bool(l2_normalize_qk), None if scale is None else float(scale))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv with a rolling state: ggml SSM_CONV's sums (+ SiLU), vectorised. Returns
    `(y, new_state)`; y is a `(B, C, T)` view of a `(B, T, C)` buffer (what the layer transposes
    back)."""
    return ops.causal_conv1d.default(x, weight, state, bias, activation)


def causal_conv1d_(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    activation: str | None = "silu",
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv1d` updating `state` in place (its new rolling state); returns y."""
    return ops.causal_conv1d_.default(x, weight, state, bias, activation)


def l2_norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """`x * rsqrt(sum(x^2, -1) + eps)` in x's dtype (computed in float32)."""
    return ops.l2_norm.default(x, float(eps))


def gates(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(g, beta)` float32 for a, b `(..., H)` and A_log, dt_bias `(H,)`."""
    return ops.gates.default(A_log, a, dt_bias, b)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`weight * x * rsqrt(mean(x^2, -1) + eps) * silu(gate)` in x's dtype (computed in float32)."""
    return ops.gated_rms_norm.default(x, gate, weight, float(eps))


# ---- fake (meta) implementations: shapes only, so torch.compile traces without graph breaks ----
# Mixed devices dispatch here too (the meta key outranks the others), so they are refused here; the
# kernel's shape and dtype rules are checked here too (_checks), so a traced call fails as an eager one.



@torch.library.register_fake(add_op_namespace_prefix("gated_delta_net"))
def _gated_delta_net_fake(q, k, v, g, beta, state, l2_normalize_qk, scale):
    same_device("gated_delta_net", q=q, k=k, v=v, g=g, beta=beta, state=state)
    _checks.gated_delta_net(q, k, v, g, beta, state, scale, in_place=False)
    b, t, hv, dv = v.shape
    state_out = q.new_empty((b, hv, dv, q.shape[3]), dtype=torch.float32).transpose(2, 3)  # ggml's layout
    return q.new_empty((b, t, hv, dv)), state_out


@torch.library.register_fake(add_op_namespace_prefix("gated_delta_net_"))
def _gated_delta_net_inplace_fake(q, k, v, g, beta, state, l2_normalize_qk, scale):
    same_device("gated_delta_net_", q=q, k=k, v=v, g=g, beta=beta, state=state)
    _checks.gated_delta_net(q, k, v, g, beta, state, scale, in_place=True)
    return q.new_empty(v.shape)


@torch.library.register_fake(add_op_namespace_prefix("causal_conv1d"))
def _causal_conv1d_fake(x, weight, state, bias, activation):
    same_device("causal_conv1d", x=x, weight=weight, state=state, bias=bias)
    _checks.causal_conv1d(x, weight, state, bias, activation, in_place=False)
    b, c, t = x.shape
    w = state.shape[-1] if state is not None else weight.shape[-1]
    y = x.new_empty((b, t, c)).transpose(1, 2)
    return y, x.new_empty((b, c, w), dtype=state.dtype if state is not None else x.dtype)


@torch.library.register_fake(add_op_namespace_prefix("causal_conv1d_"))
def _causal_conv1d_inplace_fake(x, weight, state, bias, activation):
    same_device("causal_conv1d_", x=x, weight=weight, state=state, bias=bias)
    _checks.causal_conv1d(x, weight, state, bias, activation, in_place=True)
    b, c, t = x.shape
    return x.new_empty((b, t, c)).transpose(1, 2)


@torch.library.register_fake(add_op_namespace_prefix("l2_norm"))
def _l2_norm_fake(x, eps):
    _checks.l2_norm(x, eps)
    return x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("gates"))
def _gates_fake(A_log, a, dt_bias, b):
    same_device("gates", A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    _checks.gates(A_log, a, dt_bias, b)
    return a.new_empty(a.shape, dtype=torch.float32), b.new_empty(b.shape, dtype=torch.float32)


@torch.library.register_fake(add_op_namespace_prefix("gated_rms_norm"))
def _gated_rms_norm_fake(x, gate, weight, eps):
    same_device("gated_rms_norm", x=x, gate=gate, weight=weight)
    _checks.gated_rms_norm(x, gate, weight, eps)
    return x.new_empty(x.shape)

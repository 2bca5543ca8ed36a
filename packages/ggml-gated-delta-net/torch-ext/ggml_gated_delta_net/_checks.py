"""The shape and dtype rules of the ops, as the CPU kernel (gated_delta_net_cpu.cpp) enforces them,
for the fake (meta) implementations: what the kernel refuses from shapes and dtypes alone, a traced
call (torch.compile, the meta device) refuses too, with the kernel's exception type and words. Rules
that need the data (overlapping memory) stay in the kernel."""

from __future__ import annotations

import torch

from ._ggml_runtime import FLOAT32_RANGE, check_dim, check_dtype, dtype_name, fits_float32

# Head dims the op accepts (ggml's GPU kernels are specialised for these; the CPU follows suit).
HEAD_DIMS = (32, 64, 128)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS = ("silu", "swish")
MAX_CONV_TAPS = 64  # causal_conv1d kernel sizes (Qwen3.5 and Mamba use 4); the kernel's kMaxConvTaps


def gated_delta_net(q, k, v, g, beta, state, scale: float | None, in_place: bool) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_dtype(t, FLOAT_DTYPES, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {dtype_name(q.dtype)}, k {dtype_name(k.dtype)}, "
                        f"v {dtype_name(v.dtype)}")
    check_dim(q, 4, "q (batch, tokens, key heads, head dim)")
    check_dim(k, 4, "k (batch, tokens, key heads, head dim)")
    check_dim(v, 4, "v (batch, tokens, value heads, head dim)")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {list(q.shape)}, got {list(k.shape)}")
    b, t, hv, d = v.shape
    hk = q.shape[2]
    if q.shape[0] != b or q.shape[1] != t:
        raise ValueError(f"q {list(q.shape)} and v {list(v.shape)} must agree on batch and tokens (dims 0 and 1)")
    if q.shape[3] != d:
        raise ValueError(f"key head dim {q.shape[3]} differs from value head dim {d}: ggml's gated delta net needs "
                         "equal head dims")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d} is not supported (32, 64 or 128)")
    if hk <= 0 or hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    for x, name in ((g, "g"), (beta, "beta")):
        check_dtype(x, FLOAT_DTYPES, name)
        if x.dim() != 3 or list(x.shape) != [b, t, hv]:
            raise ValueError(f"{name} must be (batch, tokens, value heads) = {[b, t, hv]}, got {list(x.shape)}")
    if state is not None:
        check_dtype(state, (torch.float32,), "state")
        if list(state.shape) != [b, hv, d, d]:
            raise ValueError(f"state must be (batch, value heads, key dim, value dim) = {[b, hv, d, d]}, got "
                             f"{list(state.shape)}")
    if scale is not None and not fits_float32(scale):
        raise ValueError(f"scale must be finite{FLOAT32_RANGE}, got {scale:g}")
    if in_place and not state.transpose(2, 3).is_contiguous():  # (the in-place op's state is never None)
        raise ValueError(
            "gated_delta_net_ updates the state in place, so it must be in ggml's layout: a state gated_delta_net "
            f"returned (or a zeros_like of one), i.e. state.transpose(-1, -2) contiguous; got strides {list(state.stride())}"
        )


def causal_conv1d(x, weight, state, bias, activation: str | None, in_place: bool) -> None:
    check_dtype(x, FLOAT_DTYPES, "x")
    check_dim(x, 3, "x (batch, channels, tokens)")
    check_dtype(weight, FLOAT_DTYPES, "weight")
    if not (weight.dim() == 2 or (weight.dim() == 3 and weight.shape[1] == 1)):
        raise ValueError(f"weight must be (channels, 1, kernel) or (channels, kernel), got shape {list(weight.shape)}")
    b, c, _ = x.shape
    kernel = weight.shape[-1]
    if weight.shape[0] != c:
        raise ValueError(f"weight has {weight.shape[0]} channels but x (batch, channels, tokens) {list(x.shape)} has {c}")
    if not 1 <= kernel <= MAX_CONV_TAPS:
        raise ValueError(f"the kernel size must be 1 to {MAX_CONV_TAPS}, got weight shape {list(weight.shape)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got '{activation}'")
    if state is not None:
        check_dtype(state, FLOAT_DTYPES, "state")
        if state.dim() != 3 or state.shape[0] != b or state.shape[1] != c or state.shape[2] < kernel - 1:
            raise ValueError(f"state must be (batch, channels, >= kernel - 1) = {[b, c, kernel - 1]} or wider "
                             f"(transformers keeps {kernel} columns), got {list(state.shape)}")
    if bias is not None:
        check_dtype(bias, FLOAT_DTYPES, "bias")
        if bias.dim() != 1 or bias.shape[0] != c:
            raise ValueError(f"bias must be (channels,) = ({c},), got {list(bias.shape)}")
    if in_place:
        if state is None:
            raise ValueError("causal_conv1d_ updates a state in place: state must not be None")
        if state.dtype not in (torch.float32, x.dtype):
            raise TypeError(f"state must be float32 or x's dtype ({dtype_name(x.dtype)}), got {dtype_name(state.dtype)}")


def _rows_with_last_dim(x, name: str) -> None:
    if x.dim() < 1 or x.shape[-1] <= 0:
        raise ValueError(f"{name} must have a non-empty last dim, got shape {list(x.shape)}")


def _eps(eps: float) -> None:
    if not (fits_float32(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0{FLOAT32_RANGE}, got {eps:g}")


def l2_norm(x, eps: float) -> None:
    check_dtype(x, FLOAT_DTYPES, "x")
    _rows_with_last_dim(x, "x")
    _eps(eps)


def gates(A_log, a, dt_bias, b) -> None:
    for t, name in ((A_log, "A_log"), (dt_bias, "dt_bias"), (a, "a"), (b, "b")):
        check_dtype(t, FLOAT_DTYPES, name)
    check_dim(A_log, 1, "A_log (value heads)")
    heads = A_log.shape[0]
    if dt_bias.dim() != 1 or dt_bias.shape[0] != heads:
        raise ValueError(f"dt_bias must be ({heads},) like A_log, got {list(dt_bias.shape)}")
    if a.dim() < 1 or a.shape[-1] != heads:
        raise ValueError(f"a must be (..., {heads}) (one value per head), got {list(a.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"b must have a's shape {list(a.shape)}, got {list(b.shape)}")


def gated_rms_norm(x, gate, weight, eps: float) -> None:
    for t, name in ((x, "x"), (gate, "gate"), (weight, "weight")):
        check_dtype(t, FLOAT_DTYPES, name)
    _rows_with_last_dim(x, "x")
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {list(x.shape)}, got {list(gate.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be ({x.shape[-1]},), got {list(weight.shape)}")
    _eps(eps)

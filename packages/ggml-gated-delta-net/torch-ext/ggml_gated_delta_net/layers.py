"""kernels-library layer for transformers' `Qwen3_5GatedDeltaNet` (Qwen3.5's linear attention).

`kernelize` swaps only `forward`; it runs on the original module's attributes: `in_proj_qkv`,
`in_proj_z`, `in_proj_a`, `in_proj_b`, `out_proj` (called as modules, so packed GGUF linears
work), `conv1d.weight` / `conv1d.bias`, `A_log`, `dt_bias`, `norm.weight` /
`norm.variance_epsilon`, `activation`, head counts and dims, `layer_idx`. The cache is read and
written through transformers' own `Cache` methods, in the same order and on the same branches as
transformers 5.22.2's forward (decode: in-place conv-state update; prefill and prefill continuing a
cache: `update_conv_state`, then the conv over [cached columns | new tokens]), except that a fresh
cache's first states are the ops' own outputs, stored as transformers would leave them.

Every step but the projections runs on this package's ops: `causal_conv1d` (SSM_CONV's sums + SiLU),
`gates`, `gated_delta_net` (ggml GATED_DELTA_NET, q/k L2-normalised and q scaled by Dk^-0.5
inside), `gated_rms_norm`; decode steps use the in-place `causal_conv1d_` / `gated_delta_net_` on
the cache's own state tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from ._ops import ops

__all__ = ["Qwen3_5GatedDeltaNet"]


def _check_cache(module: nn.Module, cache, batch_size: int) -> None:
    """A clear error when the cache cannot belong to this layer (built for another model or
    layout, or for another batch), instead of a shape error deep inside an op."""
    idx = module.layer_idx
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cache_params must be a transformers Cache (e.g. DynamicCache(config=...)), got {type(cache).__name__}")
    if not 0 <= idx < len(layers):
        raise ValueError(
            f"cache_params has {len(layers)} layers but this linear-attention layer has layer_idx={idx}: "
            "the cache was built for another model; build it with DynamicCache(config=model.config)"
        )
    layer = layers[idx]
    if not (hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")):
        raise ValueError(
            f"cache layer {idx} is a {type(layer).__name__}, not a linear-attention cache layer: "
            f"layer_idx={idx} does not match the cache's layout (was it built for another model?)"
        )
    conv = layer.conv_states.get(0) if layer.is_conv_states_initialized.get(0) else None
    if conv is not None and (conv.dim() != 3 or conv.shape[1] != module.conv_dim or conv.shape[2] < module.conv_kernel_size - 1):
        raise ValueError(
            f"cache layer {idx} holds a conv state of shape {tuple(conv.shape)}, but layer_idx={idx} "
            f"needs (batch, {module.conv_dim}, {module.conv_kernel_size}): the cache belongs to another layer or model"
        )
    rec = layer.recurrent_states.get(0) if layer.is_recurrent_states_initialized.get(0) else None
    want = (module.num_v_heads, module.head_k_dim, module.head_v_dim)
    if rec is not None and (rec.dim() != 4 or tuple(rec.shape[1:]) != want):
        raise ValueError(
            f"cache layer {idx} holds a recurrent state of shape {tuple(rec.shape)}, but layer_idx={idx} "
            f"needs (batch, {want[0]}, {want[1]}, {want[2]}): the cache belongs to another layer or model"
        )
    if rec is not None and rec.dtype != torch.float32:
        raise TypeError(f"cache layer {idx} holds a {rec.dtype} recurrent state; it must be float32")
    for name, t in (("conv", conv), ("recurrent", rec)):
        if t is not None and layer.has_previous_state.get(0) and t.shape[0] != batch_size:
            raise ValueError(
                f"cache layer {idx} holds a {name} state for batch size {t.shape[0]}, "
                f"but hidden_states has batch size {batch_size}"
            )


def _first_prefill(cache, idx: int, kernel_size: int, weight: torch.Tensor) -> bool:
    """Whether this is the cache's first prefill, of the usual kind: no conv state yet, no past being
    recorded, and the cache's state as wide as the kernel (what transformers' cache keeps)."""
    layer = cache.layers[idx]
    return (
        not layer.is_conv_states_initialized.get(0)
        and not layer.has_previous_state.get(0)
        and not cache.is_recording_past(idx)
        and kernel_size == weight.shape[-1]
    )


def _store_first_conv_state(cache, idx: int, state: torch.Tensor) -> None:
    """The conv's rolling state after a first prefill (the last kernel-size columns of [zeros | x],
    as the op returns it) becomes the cache's conv state, as transformers' `update_conv_state` would
    leave it, without its zeros, padded copy of x and copy in (~20 us a layer)."""
    layer = cache.layers[idx]
    if layer.device is None:
        layer.dtype, layer.device = state.dtype, state.device
    layer.conv_kernel_size[0] = state.shape[-1]
    layer.conv_states[0] = state
    layer.is_conv_states_initialized[0] = True
    layer.has_previous_state[0] = True


def _store_recurrent_state(cache, idx: int, state: torch.Tensor) -> None:
    """The state a prefill returned, into the cache. The first one becomes the cache's state as it
    is: transformers' `update_recurrent_state` would first allocate a zeros_like of it (fresh pages,
    ~0.4 ms for a Qwen3.5 MoE layer's 2 MiB state, 7 ms a first forward) and copy it in. Later ones
    (and a cache recording its past) go through `update_recurrent_state`."""
    layer = cache.layers[idx]
    if layer.is_recurrent_states_initialized.get(0) or cache.is_recording_past(idx):
        cache.update_recurrent_state(state, idx)
        return
    layer.recurrent_states[0] = state
    layer.is_recurrent_states_initialized[0] = True


def _forward(module: nn.Module, hidden_states: torch.Tensor, cache_params, attention_mask) -> torch.Tensor:
    if attention_mask is not None:  # a 2-D padding mask: padded tokens enter as zeros
        dtype = hidden_states.dtype
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)

    batch_size, seq_len, _ = hidden_states.shape
    idx = module.layer_idx
    if cache_params is not None:
        _check_cache(module, cache_params, batch_size)
        conv_state = cache_params.get_conv_state(idx, state_idx=0)
        recurrent_state = cache_params.get_recurrent_state(idx, state_idx=0)
    else:
        conv_state, recurrent_state = None, None

    mixed_qkv = module.in_proj_qkv(hidden_states).transpose(1, 2)  # (B, conv_dim, T)
    z = module.in_proj_z(hidden_states)
    b = module.in_proj_b(hidden_states)
    a = module.in_proj_a(hidden_states)

    weight, bias, activation = module.conv1d.weight, module.conv1d.bias, module.activation
    if conv_state is not None and seq_len == 1 and not cache_params.is_recording_past(idx):
        # decode: the rolling conv state is updated in place, as transformers' causal_conv1d_update does
        mixed_qkv = ops.causal_conv1d_.default(mixed_qkv, weight, conv_state, bias, activation)
    elif cache_params is not None and _first_prefill(cache_params, idx, module.conv_kernel_size, weight):
        mixed_qkv, first_state = ops.causal_conv1d.default(mixed_qkv, weight, None, bias, activation)
        _store_first_conv_state(cache_params, idx, first_state)
    else:
        if cache_params is not None:  # prefill: the cache stores the last columns, returns [cached | new]
            mixed_qkv = cache_params.update_conv_state(mixed_qkv, idx, conv_kernel_size=module.conv_kernel_size)
        mixed_qkv, _ = ops.causal_conv1d.default(mixed_qkv, weight, None, bias, activation)
        if cache_params is not None:
            mixed_qkv = mixed_qkv[:, :, -seq_len:]

    mixed_qkv = mixed_qkv.transpose(1, 2)  # (B, T, conv_dim), rows dense: q, k, v stay views
    query, key, value = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(batch_size, seq_len, -1, module.head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, module.head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, module.head_v_dim)

    g, beta = ops.gates.default(module.A_log, a, module.dt_bias, b)
    if (
        recurrent_state is not None
        and recurrent_state.transpose(-1, -2).is_contiguous()
        and not cache_params.is_recording_past(idx)
    ):
        # the cache holds a state in ggml's layout (its zeros_like of one this op returned): updated
        # in place, which is all transformers' update_recurrent_state (a copy_) would do
        core_attn_out = ops.gated_delta_net_.default(query, key, value, g, beta, recurrent_state, True, None)
    else:
        core_attn_out, last_recurrent_state = ops.gated_delta_net.default(query, key, value, g, beta, recurrent_state, True, None)
        if cache_params is not None:
            _store_recurrent_state(cache_params, idx, last_recurrent_state)

    norm = module.norm
    core_attn_out = ops.gated_rms_norm.default(
        core_attn_out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim), norm.weight, float(norm.variance_epsilon)
    )
    return module.out_proj(core_attn_out.reshape(batch_size, seq_len, -1))


class Qwen3_5GatedDeltaNet(nn.Module):
    """Drop-in `forward` for transformers' `Qwen3_5GatedDeltaNet` (inference only)."""

    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask: torch.Tensor | None = None, **kwargs):
        return _forward(self, hidden_states, cache_params, attention_mask)

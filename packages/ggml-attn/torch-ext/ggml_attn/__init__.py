"""Flash attention on ggml's kernels (ggml_flash_attn_ext), for prefill and decode.

- `flash_attn(q, k, v, mask=None, scale=None, causal=False, softcap=None, sinks=None)`: SDPA's
  layout, q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D) with Hq a multiple of Hkv (GQA without repeating
  K/V) -> (B, Hq, Sq, D).
- `flash_attn_forward(module, query, key, value, attention_mask, ...)`: transformers' attention
  interface (`model.set_attn_implementation("ggml-org/ggml-attn")`), returns ((B, Sq, Hq, D), None).
- `supports_flash_attn(head_dim, dtype, *, value_head_dim=None)`: what the kernel handles.
- `apply_rotary(q, k, cos, sin, unsqueeze_dim=1)`: transformers' `apply_rotary_pos_emb` (Llama family,
  rotate_half form) on its own cos / sin tables, q and k in one call; `layers.RotaryPosEmb` is the
  kernels-library layer for the `rotary_pos_emb` function kernel transformers maps.
- `kv_write(keys, values, k, v, position)`: a key/value cache append in place, both in one call.
- `info()`, and on the emulated-Metal build `metal_dispatches()` / `reset_metal_dispatches()`: the kernels
  upstream's Metal host code dispatched.

A query whose keys are all masked (left padding) gets zeros, never NaN.
"""

from __future__ import annotations

import torch

from . import _checks, layers, reference
from ._checks import MAX_HEAD_DIM, METAL_HEAD_DIM_PAIRS, METAL_HEAD_DIMS, SUPPORTED_DTYPES
from ._ggml_runtime import BACKEND, EMULATED_METAL, info, same_device
from ._ops import add_op_namespace_prefix, ops

__all__ = [
    "MAX_HEAD_DIM", "METAL_HEAD_DIM_PAIRS", "METAL_HEAD_DIMS", "SUPPORTED_DTYPES", "apply_rotary", "flash_attn",
    "flash_attn_forward", "info", "kv_write", "layers", "reference", "supports_flash_attn",
]

if BACKEND in EMULATED_METAL:  # the emulated-Metal builds (never on the Hub) alone have them
    from ._metal_emu import metal_dispatches, reset_metal_dispatches

    __all__ += ["metal_dispatches", "reset_metal_dispatches"]


def supports_flash_attn(
    head_dim: int, dtype: torch.dtype = torch.float32, *, value_head_dim: int | None = None
) -> bool:
    """Whether this build computes attention for these head dims and dtype: float32/float16/bfloat16
    q/k/v; on the CPU any query/key head dim and value head dim (`value_head_dim`, by default
    `head_dim`) up to MAX_HEAD_DIM, on Metal the (key, value) pairs in METAL_HEAD_DIM_PAIRS (those
    upstream's Metal kernels are instantiated for: 128 with 128, but not 128 with 64)."""
    if dtype not in SUPPORTED_DTYPES:
        return False
    dims = (int(head_dim), int(head_dim if value_head_dim is None else value_head_dim))
    if _BACKEND == "cpu":
        return all(1 <= dim <= MAX_HEAD_DIM for dim in dims)
    return dims in METAL_HEAD_DIM_PAIRS


_BACKEND = info()["backend"]


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [softcapped] + mask) v, like SDPA: (B, Hq, Sq, D) -> (B, Hq, Sq, Dv).

    mask: bool (True = attend) or additive float, broadcastable to (B, Hq, Sq, Skv) from (Sq, Skv),
    (B, Sq, Skv) or (B, 1|Hq, Sq, Skv). causal: keys after each query's position are masked,
    aligned bottom-right (the last query sees every key), combined with mask if both are given.
    softcap: logits -> softcap * tanh(logits / softcap). sinks: one extra logit per query head.
    """
    out = ops.flash_attn.default(q, k, v, mask, bool(causal), float(scale or 0.0), float(softcap or 0.0), sinks)
    return out.transpose(1, 2)


def flash_attn_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: attention_mask a bool (B, 1, Sq, Skv) mask, True = attend,
    or None, which means what it means to SDPA (transformers builds this kernel's masks with
    `sdpa_mask`, and leaves one out only where SDPA's `is_causal` gives the same result): causal
    aligned top-left, query i seeing keys 0..i. transformers leaves it out for one query (every key),
    as many queries as keys, and a prefill from position 0 into a static cache longer than the prompt,
    whose positions past it are empty: there only the first Sq keys are read. Returns
    ((B, Sq, Hq, D), None)."""
    if dropout and module.training:
        raise ValueError("ggml-attn is an inference kernel: dropout is not supported")
    if attention_mask is None:
        causal = True if is_causal is None else bool(is_causal)
        queries = query.shape[-2]
        if causal and 1 < queries < key.shape[-2]:  # top-left: bottom-right over the first Sq keys
            key, value = key[..., :queries, :], value[..., :queries, :]
    else:
        causal = False
    softcap = kwargs.get("softcap") or _softcap_of(module)
    sinks = kwargs.get("s_aux")
    out = ops.flash_attn.default(query, key, value, attention_mask, causal, float(scaling or 0.0), float(softcap or 0.0), sinks)
    return out, None


def _softcap_of(module: torch.nn.Module) -> float | None:
    """The module's `attn_logit_softcapping` (Gemma 2 sets one in __init__), if any. Looked up in the
    instance and class dicts: asking nn.Module for a name it lacks raises inside, ~1 us per call."""
    value = module.__dict__.get("attn_logit_softcapping")
    return value if value is not None else getattr(type(module), "attn_logit_softcapping", None)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q * cos + rotate_half(q) * sin` and the same for k, as transformers' `apply_rotary_pos_emb`:
    q (B, Hq, T, D), k (B, Hk, T, D), cos / sin (B or 1, T, D) broadcast over the heads
    (`unsqueeze_dim=1`). float32 CPU tensors of that layout run the op (same values as transformers'
    torch ops); anything else (other dtypes, devices or layouts) runs `reference.apply_rotary`."""
    if (
        unsqueeze_dim == 1
        and q.dim() == 4
        and cos.dim() == 3
        and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32
        and q.is_cpu
    ):
        return ops.rotary_half.default(q, k, cos, sin)
    return reference.apply_rotary(q, k, cos, sin, unsqueeze_dim)


@torch.library.register_fake(add_op_namespace_prefix("rotary_half"))
def _rotary_half_fake(q, k, cos, sin):
    same_device("rotary_half", q=q, k=k, cos=cos, sin=sin)
    _checks.rotary_half(q, k, cos, sin)
    return q.new_empty(q.shape), k.new_empty(k.shape)


def kv_write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
    """Write k (..., n, D) and v (..., n, Dv) into rows [position, position + n) of the cache
    buffers keys (..., capacity, D) and values (..., capacity, Dv), in place (a decode step's append:
    one call for both, instead of a narrow and a copy_ each). float32, float16 or bfloat16 caches (others
    raise TypeError), k / v in the cache's dtype, matching leading dims."""
    ops.kv_write.default(keys, values, k, v, int(position))


@torch.library.register_fake(add_op_namespace_prefix("kv_write"))
def _kv_write_fake(keys, values, k, v, position):
    same_device("kv_write", keys=keys, values=values, k=k, v=v)
    _checks.kv_write(keys, values, k, v, position)


@torch.library.register_fake(add_op_namespace_prefix("flash_attn"))
def _flash_attn_fake(q, k, v, mask, causal, scale, softcap, sinks):
    same_device("flash_attn", q=q, k=k, v=v, mask=mask, sinks=sinks)
    _checks.flash_attn(q, k, v, mask, scale, softcap, sinks)
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[3]))

"""Mixture-of-experts routing on the CPU: softmax over the experts -> top-k -> optional
renormalisation of the chosen weights, fused into one pass per token.

Every function takes logits `(..., E)` in float32, bfloat16 or float16 and returns `(weights,
indices)` of shape `(..., k)`, largest weight first. Indices are int64 by default (what
`torch.topk` returns and transformers' experts expect); tied experts come out in the order
`torch.topk` puts them on the CPU. Softmax is computed in float32; weights are returned in the
logits' dtype unless `dtype` says otherwise (transformers' routers return them in the logits' dtype).

Inputs the routing is not defined for raise `ValueError`: NaN anywhere in a row, or (with softmax) a
row whose logits are all -inf. A row holding +inf gets softmax's limit: its +inf experts share the
weight 1 equally, every other expert gets 0 (torch's own softmax returns NaN there).
"""

from __future__ import annotations

import operator

import torch

from . import layers, reference
from ._ggml_runtime import BACKEND, EMULATED_METAL, check_dtype, check_size, dtype_name, info
from ._ops import add_op_namespace_prefix, ops

__all__ = [
    "info",
    "layers",
    "reference",
    "softmax_top_k",
    "top_k",
    "top_k_ggml",
]

if BACKEND in EMULATED_METAL:  # the emulated-Metal builds (never on the Hub) alone have them
    from ._metal_emu import metal_dispatches, reset_metal_dispatches

    __all__ += ["metal_dispatches", "reset_metal_dispatches"]


def _k(k) -> int:
    if isinstance(k, bool) or isinstance(k, float):
        raise TypeError(f"k must be an integer, got {k!r}")
    try:
        return operator.index(k)
    except TypeError:
        raise TypeError(f"k must be an integer, got {type(k).__name__}") from None


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dim (experts last), got a 0-D tensor")
    if logits.dim() == 2:
        return logits
    check_size(logits, "logits")  # before a reshape that may copy
    return logits.reshape(-1, logits.shape[-1])


def _unflatten(logits: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]):
    if logits.dim() == 2:
        return out
    w, i = out
    shape = (*logits.shape[:-1], w.shape[-1])
    return w.view(shape), i.view(shape)


def top_k(
    logits: torch.Tensor,
    k: int,
    softmax: bool = True,
    *,
    dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of `logits (..., E)`, largest first: `(weights, indices)`, `(..., k)`.

    softmax=True: weights are `softmax(logits.float(), -1)` of the chosen experts (what
    `torch.topk(torch.softmax(logits, -1, dtype=torch.float), k)` gives), in `dtype` (default: the
    logits' dtype). softmax=False: exactly `torch.topk(logits, k)` (values in `dtype` if given).
    """
    out = ops.top_k.default(_rows(logits), _k(k), bool(softmax), False, dtype, index_dtype)
    return _unflatten(logits, out)


def softmax_top_k(
    logits: torch.Tensor,
    k: int,
    norm_topk_prob: bool = True,
    *,
    dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing in one op: softmax over the experts, top-k, and (norm_topk_prob) the k weights
    divided by their sum, as transformers' SoftmaxTopKRouter / Qwen MoE routers compute them from
    their router logits. Weights in `dtype` (default: the logits' dtype), indices int64 (or int32)."""
    out = ops.top_k.default(_rows(logits), _k(k), True, bool(norm_topk_prob), dtype, index_dtype)
    return _unflatten(logits, out)


def top_k_ggml(
    logits: torch.Tensor, k: int, softmax: bool = True, norm_topk_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing as ggml graphs (ggml-cpu's soft_max_ext -> top_k -> get_rows [-> sum_rows,
    div], llama.cpp's MoE routing), for comparison: slower than `softmax_top_k` (see README), ties
    broken ggml's way, +inf refused. Weights in the logits' dtype, indices int64."""
    out = ops.top_k_ggml.default(_rows(logits), _k(k), bool(softmax), bool(norm_topk_prob))
    return _unflatten(logits, out)


# ---- fake (meta) implementations: shapes only, so torch.compile traces without graph breaks ----
# They check what can be checked from shapes and dtypes, with the kernel's words, so a compiled call
# fails as an eager one.


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_fake(logits, k, softmax, normalize):
    check_dtype(logits, _FLOAT_DTYPES, "logits")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (tokens, experts), got shape {list(logits.shape)}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got k={k}")
    if k > logits.shape[1]:
        raise ValueError(f"k={k} is larger than the number of experts ({logits.shape[1]}, logits shape "
                         f"{list(logits.shape)})")
    if normalize and not softmax:
        raise ValueError("normalize=True needs softmax=True (renormalising raw logits is not defined)")


def _check_out_dtypes(dtype, index_dtype):
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype (of the weights) must be float32, bfloat16 or float16, got {dtype_name(dtype)}")
    if index_dtype is not None and index_dtype not in (torch.int64, torch.int32):
        raise TypeError(f"index_dtype must be int64 or int32, got {dtype_name(index_dtype)}")


@torch.library.register_fake(add_op_namespace_prefix("top_k"))
def _top_k_fake(logits, k, softmax=True, normalize=False, dtype=None, index_dtype=None):
    _check_fake(logits, k, softmax, normalize)
    _check_out_dtypes(dtype, index_dtype)
    shape = (logits.shape[0], k)
    return (
        logits.new_empty(shape, dtype=dtype or logits.dtype),
        logits.new_empty(shape, dtype=index_dtype or torch.int64),
    )


@torch.library.register_fake(add_op_namespace_prefix("top_k_ggml"))
def _top_k_ggml_fake(logits, k, softmax=True, normalize=False):
    _check_fake(logits, k, softmax, normalize)
    shape = (logits.shape[0], k)
    return logits.new_empty(shape), logits.new_empty(shape, dtype=torch.int64)

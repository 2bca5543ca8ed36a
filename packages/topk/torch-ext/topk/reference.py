"""Pure-PyTorch reference of every function of the package: same arguments, same results (the
weights to float32 rounding, the indices exactly), same errors for the inputs routing is not defined
for. Slow (several ops per call), portable, and the definition the tests hold the kernel to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["router_forward", "softmax", "softmax_top_k", "top_k", "top_k_ggml"]


def _check(logits: torch.Tensor, k: int, softmax: bool) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must have dtype Float, BFloat16, Half; got {logits.dtype}")
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dim (experts last), got a 0-D tensor")
    if isinstance(k, (bool, float)) or not isinstance(k, int):
        raise TypeError(f"k must be an integer, got {k!r}")
    experts = logits.shape[-1]
    if k < 1:
        raise ValueError(f"k must be at least 1, got k={k}")
    if k > experts:
        raise ValueError(f"k={k} is larger than the number of experts ({experts})")
    x = logits.reshape(-1, experts).float()
    nan_rows = x.isnan().any(-1).nonzero()
    if len(nan_rows):
        raise ValueError(f"logits contain NaN (first in token row {nan_rows[0].item()})")
    if softmax:
        masked = (x == float("-inf")).all(-1).nonzero()
        if len(masked):
            raise ValueError(f"every logit of token row {masked[0].item()} is -inf")
    return x


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in float32, with rows holding +inf at their limit: the +inf entries
    share 1 equally and the rest get 0 (torch.softmax gives NaN for such rows)."""
    x = logits.float()
    pos_inf = x == float("inf")
    has_inf = pos_inf.any(-1, keepdim=True)
    p = torch.softmax(torch.where(has_inf, torch.zeros_like(x), x), dim=-1)
    limit = pos_inf.float() / pos_inf.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(has_inf, limit, p)


_softmax = softmax  # the functions below take a `softmax` flag


def top_k(
    logits: torch.Tensor,
    k: int,
    softmax: bool = True,
    *,
    dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk of softmax(logits) (softmax=True) or of logits themselves, largest first."""
    x = _check(logits, k, softmax)
    values = _softmax(x) if softmax else x
    w, i = torch.topk(values, k, dim=-1)
    shape = (*logits.shape[:-1], k)
    return w.to(dtype or logits.dtype).reshape(shape), i.to(index_dtype).reshape(shape)


def softmax_top_k(
    logits: torch.Tensor,
    k: int,
    norm_topk_prob: bool = True,
    *,
    dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router after its linear: softmax (float32), top-k, optional renormalisation."""
    x = _check(logits, k, True)
    w, i = torch.topk(softmax(x), k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    shape = (*logits.shape[:-1], k)
    return w.to(dtype or logits.dtype).reshape(shape), i.to(index_dtype).reshape(shape)


def top_k_ggml(
    logits: torch.Tensor, k: int, softmax: bool = True, norm_topk_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """What top_k_ggml computes, with ties among the chosen ordered by index (ggml's choice *among*
    tied experts at the cut-off is its own and not modelled here)."""
    x = _check(logits, k, softmax)
    if softmax and (x == float("inf")).any():
        raise ValueError("top_k_ggml: +inf logits are not supported")
    values = _softmax(x) if softmax else x
    order = torch.sort(-values, dim=-1, stable=True).indices[:, :k]
    w = values.gather(-1, order)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    shape = (*logits.shape[:-1], k)
    return w.to(logits.dtype).reshape(shape), order.reshape(shape)


def router_forward(
    hidden_states: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' softmax top-k router forward: `(router_logits, top_k_weights, top_k_index)`."""
    hidden_states = hidden_states.reshape(-1, weight.shape[1])
    router_logits = F.linear(hidden_states, weight)
    w, i = softmax_top_k(router_logits, top_k, norm_topk_prob)
    return router_logits, w, i

"""Layers for `kernels.kernelize`: each one's `forward` replaces the forward of transformers' layers
registered under the same name (`@use_kernel_forward_from_hub("SoftmaxTopKRouter")`), running on
the original module's own attributes. By `kernels`' rules a layer has no `__init__` and no members
but `forward`, `has_backward` and `can_torch_compile`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._ops import ops

__all__ = ["SoftmaxTopKRouter"]


class SoftmaxTopKRouter(nn.Module):
    """transformers' softmax top-k MoE router (Qwen3.5-MoE's `Qwen3_5MoeTopKRouter`; Qwen2/Qwen3-MoE's
    routers have the same forward) with softmax -> top-k -> renormalisation fused into one op.

    Uses the module's `weight` (num_experts, hidden_dim), `hidden_dim`, `top_k` and, if it has one,
    `norm_topk_prob` (Qwen3.5-MoE's router has none and always renormalises). Returns what the
    original returns: `(router_logits, top_k_weights, top_k_index)` with the raw router logits
    (tokens, num_experts) in the hidden states' dtype, the weights in that dtype and int64 indices.

    The router linear stays `F.linear(hidden_states, self.weight)`, as in the original: transformers'
    GGUF loader never packs a router weight (it only swaps `nn.Linear` / `nn.Embedding` / experts
    modules for packed ones), so it is a dense tensor here. A router this kernel does not compute
    (sigmoid scoring with a correction bias, logit soft-capping: Laguna's router shares the name)
    runs its own class's forward unchanged.
    """

    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states):
        if getattr(self, "e_score_correction_bias", None) is not None or getattr(
            self, "router_logit_softcapping", None
        ):
            return type(self).forward(self, hidden_states)
        if self.weight.dtype == torch.uint8:
            raise TypeError(
                "SoftmaxTopKRouter: the router weight is packed GGUF data (uint8); this layer needs it "
                "dense (num_experts, hidden_dim), as transformers' GGUF loader leaves it"
            )
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)  # (tokens, num_experts)
        weights, indices = ops.top_k.default(
            router_logits, self.top_k, True, bool(getattr(self, "norm_topk_prob", True)), None, None
        )
        return router_logits, weights, indices

"""kernels-library layers of ggml-attn. Attention itself needs none: transformers reaches it
through its attention interface (`model.set_attn_implementation("ggml-org/ggml-attn")` calls
`flash_attn_forward`).

    RotaryPosEmb  the `rotary_pos_emb` function kernel: transformers' `apply_rotary_pos_emb` of the
                  Llama family (LlamaAttention and the models copied from it), q and k in one op

Per kernels' rules a layer has no constructor and no members but `forward` and the two flags.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryPosEmb"]


class RotaryPosEmb(nn.Module):
    """`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` -> (q_embed, k_embed)."""

    has_backward = False
    can_torch_compile = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
        return (_APPLY_ROTARY or _apply_rotary())(q, k, cos, sin, unsqueeze_dim)


def _apply_rotary():
    """The package's `apply_rotary` (this module is imported before the package defines it)."""
    global _APPLY_ROTARY
    if _APPLY_ROTARY is None:
        from . import apply_rotary

        _APPLY_ROTARY = apply_rotary
    return _APPLY_ROTARY


_APPLY_ROTARY = None

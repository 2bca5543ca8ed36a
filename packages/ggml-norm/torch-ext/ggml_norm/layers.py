"""Drop-in forwards for transformers' norm modules, for `kernels.kernelize`.

Each class replaces the forward of the modules transformers marks with
`use_kernel_forward_from_hub(<class name>)`, reading that module's own attributes, and returns what
the original returns (values and dtype):

    RMSNormZeroCentered  Qwen3_5RMSNorm / Qwen3_5MoeRMSNorm: norm(x) * (1 + weight), in x's dtype
    RMSNorm              LlamaRMSNorm, Qwen3RMSNorm, ...: weight * norm(x).to(x.dtype)
    RMSNormGated         Qwen3_5RMSNormGated (and the other silu-gated ones: Qwen3-Next,
                         OLMo-hybrid): weight * norm(x).to(x.dtype) * silu(gate), in x's dtype

Per kernels' rules they have no constructor and no members but `forward` and the two flags.
"""

from __future__ import annotations

import torch
from torch import nn

from ._ops import ops

__all__ = ["RMSNorm", "RMSNormGated", "RMSNormZeroCentered"]


def _weight(module: nn.Module) -> torch.Tensor:
    """The module's `weight`: its parameter straight from `_parameters` (nn.Module's __getattr__
    costs ~0.4 us per lookup), else whatever the attribute is."""
    w = module._parameters.get("weight")
    return w if w is not None else module.weight


def _eps(module: nn.Module, name: str, other: str) -> float:
    """The module's epsilon, stored as `name` (or else `other`). Plain attributes live in the
    instance __dict__; asking nn.Module for a missing one costs ~1.5 µs, a tenth of a decode norm."""
    d = module.__dict__
    return float(d[name] if name in d else getattr(module, other))


class RMSNormZeroCentered(nn.Module):
    """`Qwen3_5RMSNorm.forward`: `(norm(x.float()) * (1 + weight.float())).type_as(x)`; attributes
    `weight` and `eps` (or `variance_epsilon`)."""

    has_backward = False
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm.default(x, _weight(self), None, _eps(self, "eps", "variance_epsilon"), True, False)


class RMSNorm(nn.Module):
    """`LlamaRMSNorm.forward`: `weight * norm(x.float()).to(x.dtype)`, in
    `promote_types(weight.dtype, x.dtype)`; attributes `weight` and `variance_epsilon`."""

    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm.default(hidden_states, _weight(self), None, _eps(self, "variance_epsilon", "eps"), False, True)


class RMSNormGated(nn.Module):
    """`Qwen3_5RMSNormGated.forward(hidden_states, gate)`: the norm rounded to x's dtype, times
    `weight`, times `silu(gate.float())`, in x's dtype; attributes `weight`, `variance_epsilon`
    and `activation` (only "silu" is implemented)."""

    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        activation = self.__dict__.get("activation", "silu")
        if activation != "silu":
            raise NotImplementedError(
                f"ggml-norm's RMSNormGated implements the silu gate only (Qwen3.5); this module uses {activation!r}"
            )
        return ops.rms_norm_gated.default(hidden_states, gate, _weight(self), _eps(self, "variance_epsilon", "eps"), True)

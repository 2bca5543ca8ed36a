"""Sibling projections that read the same activations run as one kernel call.

A decoder layer calls several packed linears on one tensor, one after the other: an attention
block's q/k/v projections, an MLP's gate/up, a Qwen3.5 linear-attention block's in_proj_qkv/z/b/a.
On a decode step each call is a small mat-vec whose fixed costs (Python and dispatch, quantizing the
activation row, starting and joining the second thread) are a good part of it, and a 192-row key
projection is too small to be worth a second thread at all. ggml-quantization's `mul_mat_group` does
all of a layer's siblings in one call: one quantization per dot-product type and one parallel region
over all their rows (bit-identical to separate `mul_mat_vec` calls).

`install(model)` (run by `enable()` after a GGUF model's weights are loaded) gives every such group of
`GgufLinear` modules a shared `ProjectionGroup`; nothing else in the model changes. When the first
sibling is called on the CPU, the group computes every sibling's output and keeps the others' until
they are asked for: a decode step's rows (at most `MAX_GEMV_ROWS`) with the op `mul_mat_group`
directly, a prompt's with ggml-quantization's `mul_mat_group` as `dense_prefill` allows it (each
sibling what its own `mul_mat` would give; its block-32 weights on the dense path, the others' rows
split over the threads together up to 128 rows: SmolLM2's first token after 12-16 tokens ~5 %
sooner than with one call per sibling, 2 threads, AMD EPYC zen4, 2026-12-05). A sibling gets a
kept output only if it is called with the very same tensor object (`is`) and, for tensors that
track one, the same version counter (no in-place change in between); anything else (another input,
torch.compile tracing) runs the module's own forward, and siblings with a bias or an input
permutation are not grouped. Kept outputs belong to the thread that computed them. Groups are only
formed in the layer classes listed in `SIBLINGS`, whose forward (transformers 5.22 and 5.23, and our
layer kernels) calls the siblings back to back on one unchanged tensor.

A SiLU-gated MLP of `GATED_MLPS` (Llama's, Qwen3.5's, the Qwen3.5 MoE shared expert's) whose gate/up
form a group and whose down projection is a plain `GgufLinear` also gets a `GatedMLP`: its class's
forward (patched through enable()'s `PatchSet`, undone by `disable()`) runs a decode step as the
group's call, `silu(gate) * up` and the down mat-vec, skipping the module calls between them.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from . import compat, dense_prefill

# the packed linears grouped and the MLPs' forwards taken over, up to transformers' row bound
compat.needs(
    ("transformers.integrations.gguf.kernels", "MAX_GEMV_ROWS", None),
    ("transformers.integrations.gguf.utils", "GgufLinear.forward", ("self", "x")),
    ("transformers.integrations.gguf.utils", "GgufLinear.__init__", ("self", "in_features", "out_features", "ggml_type")),
    # the gated MLPs whose forward (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) GatedMLP stands in
    # for: transformers gives them no kernel layer name, so kernelize cannot put a layer there
    ("transformers.models.llama.modeling_llama", "LlamaMLP.forward", ("self", "x")),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5MLP.forward", ("self", "x")),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeMLP.forward", ("self", "x")),
)


# layer class name -> its sibling projections, in the order the layer's forward calls them
SIBLINGS: dict[str, tuple[str, ...]] = {
    "LlamaAttention": ("q_proj", "k_proj", "v_proj"),
    "LlamaMLP": ("gate_proj", "up_proj"),
    "Qwen3_5Attention": ("q_proj", "k_proj", "v_proj"),
    "Qwen3_5MLP": ("gate_proj", "up_proj"),
    "Qwen3_5GatedDeltaNet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "Qwen3_5MoeAttention": ("q_proj", "k_proj", "v_proj"),
    "Qwen3_5MoeMLP": ("gate_proj", "up_proj"),
    "Qwen3_5MoeGatedDeltaNet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}
GROUP_ATTR = "_ggml_kernels_projection_group"
# MLP classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (transformers 5.22, 5.23)
GATED_MLPS = ("LlamaMLP", "Qwen3_5MLP", "Qwen3_5MoeMLP")
MLP_ATTR = "_ggml_kernels_gated_mlp"

def _version(x: torch.Tensor) -> int | None:
    # inference tensors keep no version counter (asking raises, and an exception costs ~10 us)
    return None if x.is_inference() else x._version


class ProjectionGroup:
    """The `GgufLinear` siblings of one layer, and the outputs computed for them ahead of their call.

    What is kept lives per thread: two threads decoding with one model never see each other's."""

    def __init__(self, members: list, max_rows: int, mul_mat_group, prefill_group):
        self.members = members
        self.max_rows = max_rows  # a decode step's rows: the op directly
        self.mul_mat_group = mul_mat_group  # ggml-quantization's op
        self.prefill_group = prefill_group  # more rows: (weights, x, types, out_features) -> outputs
        self.out_features = [m.out_features for m in members]
        self._thread = threading.local()  # .kept: (source tensor, its version, {id(member): output})

    def forward(self, member, x: torch.Tensor) -> torch.Tensor | None:
        """`member`'s output for `x`, or None where the module's own forward has to run."""
        thread = self._thread
        kept = getattr(thread, "kept", None)
        if kept is not None:
            source, version, outputs = kept
            out = outputs.pop(id(member), None) if x is source and _version(x) == version else None
            if out is not None:
                if not outputs:
                    thread.kept = None
                return out
            thread.kept = None
        outs = self.outputs(x)
        if outs is None:
            return None
        if x.dtype != torch.float32:
            outs = [out.to(x.dtype) for out in outs]
        result, outputs = None, {}
        for m, out in zip(self.members, outs, strict=True):
            if m is member:
                result = out
            else:
                outputs[id(m)] = out
        if outputs:
            thread.kept = (x, _version(x), outputs)
        return result


    def outputs(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every member's float32 output for `x` from one kernel call, or None where `x` is not a
        CPU input of theirs."""
        in_features = self.members[0].in_features
        if not x.is_cpu or x.dim() == 0 or x.size(-1) != in_features:
            return None
        # the members' current weights: `_parameters` directly, nn.Module's __getattr__ costs ~0.4 us each
        weights = [m._parameters["weight"] for m in self.members]
        types = [m.ggml_type for m in self.members]  # as they are now: `repacking` changes them
        group = self.mul_mat_group if x.numel() <= self.max_rows * in_features else self.prefill_group
        return group(weights, x, types, self.out_features)  # (..., N_i) each


class GatedMLP:
    """A SiLU-gated MLP whose gate/up projections are a group: a decode step is the group's call,
    `silu(gate) * up` and the down projection's mat-vec, without the four module calls (and the
    group's bookkeeping) between them: ~15 us a layer, bit for bit what the MLP's own forward gives."""

    def __init__(self, group: ProjectionGroup, down, mul_mat_vec):
        self.group = group
        self.down = down
        self.mul_mat_vec = mul_mat_vec  # ggml-quantization's op

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The MLP's output for `x`, or None where its own forward has to run."""
        group = self.group
        decode = x.dtype == torch.float32 and x.numel() <= group.max_rows * group.members[0].in_features
        outs = group.outputs(x) if decode else None
        if outs is None:
            return None
        gate, up = outs
        hidden = torch.nn.functional.silu(gate).mul_(up)
        down = self.down
        return self.mul_mat_vec(down._parameters["weight"], hidden, down.ggml_type, down.out_features)


def _gated_mlp(module, group: ProjectionGroup, quant) -> GatedMLP | None:
    """The fused decode path of an MLP of `GATED_MLPS` whose gate/up are `group`, if it has one."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.gguf.utils import GgufLinear

    down = getattr(module, "down_proj", None)
    if (
        [getattr(module, "gate_proj", None), getattr(module, "up_proj", None)] != group.members
        or type(getattr(module, "act_fn", None)) not in (SiLUActivation, nn.SiLU)
        or type(down) is not GgufLinear
        or down.bias is not None
        or down.input_permutation is not None
        or down.in_features != group.members[0].out_features
    ):
        return None
    return GatedMLP(group, down, quant.ops.mul_mat_vec.default)


def _patch_gated_mlp_class(patches, cls) -> None:
    """`cls.forward` takes a module's `GatedMLP` first (once per `patches`)."""
    try:
        patches.original(cls, "forward")
        return
    except KeyError:
        pass
    is_compiling = torch.compiler.is_compiling

    def make(original):
        def forward(self, x):
            fused = self.__dict__.get(MLP_ATTR)
            if fused is not None and not is_compiling():
                out = fused.forward(x)
                if out is not None:
                    return out
            return original(self, x)

        return forward

    patches.wrap(cls, "forward", make)


def install(model, quant, patches=None) -> int:
    """Give the `GgufLinear` siblings of every layer in `SIBLINGS` a shared group computing with
    `quant` (the ggml-quantization kernel), and with `patches` (a `PatchSet`) the SiLU-gated MLPs of
    `GATED_MLPS` their fused decode path; returns how many groups."""
    from transformers.integrations.gguf.kernels import MAX_GEMV_ROWS
    from transformers.integrations.gguf.utils import GgufLinear

    def prefill_group(weights, x, types, out_features):
        return dense_prefill.mul_mat_group(quant, weights, x, types, out_features)

    groups = 0
    for module in model.modules():
        names = SIBLINGS.get(type(module).__name__)
        if names is None:
            continue
        members = [getattr(module, name, None) for name in names]
        if (
            any(type(m) is not GgufLinear for m in members)
            or len({m.in_features for m in members}) != 1
            or any(m.bias is not None or m.input_permutation is not None for m in members)
        ):
            continue
        group = ProjectionGroup(members, MAX_GEMV_ROWS, quant.ops.mul_mat_group.default, prefill_group)
        for m in members:
            m.__dict__[GROUP_ATTR] = group  # a plain attribute: not a submodule, not in the state dict
        groups += 1
        fused = _gated_mlp(module, group, quant) if patches is not None and type(module).__name__ in GATED_MLPS else None
        if fused is not None:
            _patch_gated_mlp_class(patches, type(module))
            module.__dict__[MLP_ATTR] = fused
    return groups


def patch_forward(patches, quant) -> None:
    """Make `GgufLinear.forward` ask its group first, and run a CPU decode step of an ungrouped module
    without a bias on the kernel op directly (its input permutation applied first, as transformers
    does): the same op transformers' forward reaches through three Python wrappers (its
    `mul_mat_vec`, the resolved kernel's, the package's). Through `patches` (a `PatchSet`)."""
    from transformers.integrations.gguf.kernels import MAX_GEMV_ROWS
    from transformers.integrations.gguf.utils import GgufLinear

    original = GgufLinear.forward
    is_compiling = torch.compiler.is_compiling
    mul_mat_vec = quant.ops.mul_mat_vec.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_compiling():
            return original(self, x)
        group = self.__dict__.get(GROUP_ATTR)
        if group is not None:
            out = group.forward(self, x)
            if out is not None:
                return out
        # `_parameters` / `_buffers` directly: nn.Module's __getattr__ costs ~0.4 us per lookup
        in_features = self.in_features
        if (
            x.dtype == torch.float32
            and x.is_cpu
            and x.size(-1) == in_features
            and x.numel() <= MAX_GEMV_ROWS * in_features
            and self._parameters.get("bias") is None
        ):
            permutation = self._buffers.get("input_permutation")  # e.g. Qwen3.5's value-head order
            if permutation is not None:  # gathered on x as a matrix: along a 3-D tensor's last dim
                # index_select takes ~16x longer at 4 rows (96 against 6 us, 2 threads)
                x = x.reshape(-1, in_features).index_select(1, permutation).view(x.shape)
            return mul_mat_vec(self._parameters["weight"], x, self.ggml_type, self.out_features)  # (..., N)
        return original(self, x)

    patches.set_attr(GgufLinear, "forward", forward)

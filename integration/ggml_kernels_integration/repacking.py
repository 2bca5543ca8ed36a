"""Packed linears in ggml-cpu's repacked layout, as llama.cpp's CPU backend holds its weights.

ggml-cpu has tiled gemm kernels for Q4_0, Q4_K, IQ4_NL and MXFP4 weights (x86 with AVX2; Q2_K with
AVX-512) that read 8 weight rows interleaved block by block. With the weight in that layout a
product with 2-47 activation rows (a short prompt, the first token of a chat turn) runs those
kernels: 1.2-1.6x ggml's plain kernels on Q4_K, 2-4x on Q4_0 (ggml-quantization's README). ggml-quantization's `repack`
makes the layout and every op of the package takes it (type id + the package's `REPACKED`, read from
the loaded package: one source); longer products
unpack each slice to the plain layout first, decode steps run ggml's repacked gemv (1.3-2.1x the
plain layout's one-row products on an Intel Xeon, 0.94-0.98x on an AMD EPYC: ggml-quantization's
`cpu`, where the default's rule and its measurements are).

`install(model, quant, types)` (after a GGUF load; `chosen_types` reads `enable(repack_weights=...)`:
by default the types ggml-quantization measured faster repacked on this CPU) repacks every
`GgufLinear` weight of those types whose row count is a multiple of 8, of at least `MIN_REPACK_BYTES`,
that no other module shares (a tied embedding is read by get_rows), and sets the module's
`ggml_type` to the repacked id. `state_dict()` still returns the GGUF bytes (a hook unpacks them) and
`load_state_dict()` takes GGUF bytes (a hook repacks them).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch

REPACK_ROWS = 8
# Weights smaller than this stay in the GGUF layout: their products are too short for the gemm to
# win anything, and a repacked product costs a few microseconds more to set up (a Qwen3.5 decode
# step has 36 16-row in_proj_b/a and ten 512-row k/v projections: 3.8 -> 5.4 us and 13.4 -> 18.1 us
# each when repacked).
MIN_REPACK_BYTES = 1 << 20
_repacked: weakref.WeakSet = weakref.WeakSet()  # modules holding a repacked weight now


def is_repacked(quant, ggml_type: int) -> bool:
    """Whether a type id of ggml-quantization (`quant`) is a weight in the repacked layout."""
    return ggml_type >= quant.REPACKED


def base_type(quant, ggml_type: int) -> int:
    """The GGUF type of a type id, repacked or not."""
    return ggml_type - quant.REPACKED if is_repacked(quant, ggml_type) else ggml_type


def _shared_parameters(model) -> set[int]:
    counts = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    return {pid for pid, n in counts.items() if n > 1}


def chosen_types(quant, option: bool | str) -> frozenset[int]:
    """The GGUF types `enable(repack_weights=option)` repacks: "auto" those ggml-quantization measured
    faster repacked on this CPU (`faster_repacked_types`; none from a build without it), True every
    type this CPU's ggml repacks, False none."""
    if option == "auto":
        faster = getattr(quant, "faster_repacked_types", None)
        return frozenset(faster()) if faster is not None else frozenset()
    return frozenset(quant.repacked_types()) if option else frozenset()


def install(model, quant, types: frozenset[int] | None = None) -> int:
    """Repack the model's eligible `GgufLinear` weights of `types` (every type this CPU's ggml repacks
    by default) in place; returns how many."""
    from transformers.integrations.gguf.utils import GgufLinear

    types = quant.repacked_types() if types is None else types & quant.repacked_types()
    shared = _shared_parameters(model)
    done = 0
    for module in model.modules():
        if type(module) is not GgufLinear or module.ggml_type not in types:
            continue
        weight = module.weight
        if (
            weight.device.type != "cpu"
            or module.out_features % REPACK_ROWS
            or weight.numel() < MIN_REPACK_BYTES
            or id(weight) in shared
        ):
            continue
        with torch.no_grad():
            weight.data = quant.repack(weight.data, module.ggml_type)
        module.ggml_type = quant.repacked_type(module.ggml_type)
        if not getattr(module, "_ggml_kernels_state_dict_hooks", False):
            _keep_gguf_bytes_in_state_dict(module, quant)
            module._ggml_kernels_state_dict_hooks = True
        _repacked.add(module)
        done += 1
    return done


def by_type(model, quant) -> dict[str, int]:
    """GGUF type name -> how many of the model's modules hold a weight repacked by `install` now."""
    found: Counter[str] = Counter()
    for module in model.modules():
        if module in _repacked and is_repacked(quant, module.ggml_type):
            found[quant.type_name(base_type(quant, module.ggml_type))] += 1
    return dict(found)


def count_in(model) -> int:
    """How many of the model's modules hold a weight repacked by `install` now."""
    return sum(1 for module in model.modules() if module in _repacked)


def unpack_all(quant) -> int:
    """Put every repacked weight still alive back in the GGUF layout (for `disable()`: transformers'
    own code reads only that one); returns how many."""
    done = 0
    for module in list(_repacked):
        if is_repacked(quant, module.ggml_type):
            plain_type = base_type(quant, module.ggml_type)
            with torch.no_grad():
                module.weight.data = quant.unrepack(module.weight.data, plain_type)
            module.ggml_type = plain_type
            done += 1
    _repacked.clear()
    return done


def _keep_gguf_bytes_in_state_dict(module, quant) -> None:
    plain_type = base_type(quant, module.ggml_type)

    def unpack(mod, state_dict, prefix, local_metadata):
        key = prefix + "weight"
        if key in state_dict and is_repacked(quant, mod.ggml_type):
            state_dict[key] = quant.unrepack(state_dict[key], plain_type)
        return state_dict

    def repack(mod, state_dict, prefix, *args):
        key = prefix + "weight"
        if key in state_dict and is_repacked(quant, mod.ggml_type):
            state_dict[key] = quant.repack(state_dict[key].contiguous(), plain_type)

    module._register_state_dict_hook(unpack)
    module._register_load_state_dict_pre_hook(repack, with_module=True)

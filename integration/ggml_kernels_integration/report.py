"""What runs on our kernels in a loaded model, said once instead of one warning per layer.

kernels' `kernelize` warns "No kernel mapping found for layer ..." for every layer class that has a
Hub kernel somewhere but none in the mapping transformers passes it (114 lines for a Qwen3.5 file).
`quiet_kernelize()` holds those back while transformers grafts the layers, and `summary(model)` /
`describe(model)` say what runs where, in one message logged after each packed GGUF load.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import compat

# kernels' per-layer "No kernel mapping" warning, summarised
compat.needs(("kernels.layer.layer", "kernelize_layer", ("module",)))


LOGGER = logging.getLogger("ggml_kernels_integration")
KERNELIZE_LOGGER = "kernels.layer.layer"


def _not_a_missing_mapping(record: logging.LogRecord) -> bool:
    return "No kernel mapping found for layer" not in record.getMessage()


@contextmanager
def quiet_kernelize():
    """Drop kernels' per-layer "No kernel mapping" warnings inside the block."""
    logger = logging.getLogger(KERNELIZE_LOGGER)
    logger.addFilter(_not_a_missing_mapping)
    try:
        yield
    finally:
        logger.removeFilter(_not_a_missing_mapping)


@dataclass
class Summary:
    """What a model runs on: our kernels (by package) and transformers' own code (with the reason)."""

    model: str
    device: str
    attention: str
    packed: Counter = field(default_factory=Counter)  # module class (GgufLinear, ...) -> count
    dense_linears: int = 0  # nn.Linear left dense (a type without a kernel, unpacked at load)
    ours: Counter = field(default_factory=Counter)  # (layer name, hub id) -> count
    theirs: Counter = field(default_factory=Counter)  # (layer name, reason) -> count
    compiled_decode: str = ""  # compiled_decode.Record.describe(): compile seconds per shape, or the failure
    repacked: int = 0  # packed linears held in ggml-cpu's repacked layout (`repacking`)


def _kernel_layers(model):
    """Every module or kernel function `kernelize` considers, once each, except those inside a module
    whose forward our kernel replaced (that forward does their work; they never run)."""
    seen, replaced = set(), []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in replaced):
            continue
        own = [module] if hasattr(type(module), "kernel_layer_name") else []
        if own and _runs_kernel(module):
            replaced.append(f"{name}.")
            yield module
            continue
        for obj in own + list(getattr(module, "_kernel_funcs", {}).values()):
            if id(obj) not in seen:
                seen.add(id(obj))
                yield obj


def _runs_kernel(obj) -> bool:
    forward = obj.__dict__.get("forward")
    return forward is not None and getattr(forward, "__func__", None) is not type(obj).forward


def summary(model, layer_kernels: dict[str, tuple[str, str]]) -> Summary:
    """`layer_kernels`: kernel layer name -> (Hub id, layer class), what `enable()` maps. `model` is a
    transformers model (an nn.Module with a `config`); anything else is a TypeError."""
    import torch

    from . import compiled_decode, repacking

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        module = isinstance(model, torch.nn.Module)
        got = f"{type(model).__module__}.{type(model).__qualname__}" if module else repr(model)[:80]
        raise TypeError(f"summary() takes a transformers model (an nn.Module with a .config, as from_pretrained "
                        f"returns), got {got}")
    packed = Counter(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf"))
    dense = sum(type(m) is torch.nn.Linear for m in model.modules())
    out = Summary(
        model=type(model).__name__,
        device=str(getattr(model, "device", "cpu")),
        attention=str(getattr(model.config, "_attn_implementation", None)),
        packed=packed,
        dense_linears=dense,
        repacked=repacking.count_in(model),
    )
    rec = compiled_decode.record(model)
    out.compiled_decode = rec.describe() if rec is not None else ""
    for obj in _kernel_layers(model):
        name = type(obj).kernel_layer_name
        if _runs_kernel(obj):
            out.ours[(name, layer_kernels.get(name, ("?", ""))[0])] += 1
        elif name in layer_kernels:
            out.theirs[(name, f"{layer_kernels[name][0]} is not built for this torch")] += 1
        else:
            out.theirs[(name, "no ggml kernel for this layer")] += 1
    return out


def describe(s: Summary) -> str:
    packed = ", ".join(f"{n} x{c}" for n, c in sorted(s.packed.items())) or "none"
    ours = ", ".join(f"{name} x{c} ({repo})" for (name, repo), c in sorted(s.ours.items())) or "none"
    lines = [
        f"ggml-kernels: {s.model} on {s.device}",
        f"  on our kernels: packed weights ({packed}) via ggml-org/ggml-quantization; attention: {s.attention}",
        f"  layer kernels: {ours}",
    ]
    if s.repacked:
        lines.append(f"  {s.repacked} linears in ggml-cpu's repacked layout (enable(repack_weights=...))")
    theirs = [f"{name} x{c} ({why})" for (name, why), c in sorted(s.theirs.items())]
    if s.dense_linears:
        theirs.append(f"nn.Linear x{s.dense_linears} (dense: a float weight in the file, or a storage type without a kernel)")
    if theirs:
        lines.append("  transformers' own code: " + ", ".join(theirs))
    if s.compiled_decode:
        lines.append(f"  {s.compiled_decode}")
    return "\n".join(lines)

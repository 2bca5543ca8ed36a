"""transformers' kernels gate, opened for our own kernels where transformers closed it.

transformers decides once, at import, whether the installed `kernels` is a version it supports
(`transformers.utils.import_utils.is_kernels_available`): 5.22 takes kernels 0.17.x, 5.23 only
>= 0.18.2, which the package index does not serve. With a kernels it does not take, its GGUF path
uses no kernel at all: the packed weights are dequantized at load, the `ggml-org/ggml-attn`
attention is refused, the layer kernels are never grafted, and its model classes are defined
without kernels' hooks (its decorators are stubs then). Our builds load with kernels 0.17.2, and
what transformers' GGUF path calls in kernels is there in that version (`compat.INTERNALS`), so
where the gate is closed `install` opens it for our kernels only:

- the kernel lookups: enable() routes transformers' `get_kernel` to kernels for our Hub ids on every
  version (`_point_hub_ids_at`), so the packed weights stay packed;
- the attention: `ggml-org/ggml-attn` is registered as transformers registers a kernel exporting
  `flash_attn_forward`: that function, with the SDPA mask;
- the layer kernels: before transformers grafts them, the layers of the loaded model get the hooks
  transformers' decorators give them where it takes kernels (`LAYER_CLASSES`, `FUNCTION_USERS`),
  and the GGUF module's gate, whose one use is that grafting, says yes.

Everything else transformers gates on kernels (`use_kernels=True`, Hub kernels of other models)
stays off, and `disable()` takes the hooks off the classes again.
"""

from __future__ import annotations

import sys

from . import compat, locate

# transformers' kernels gate and what is opened where it is closed: the layer kernels grafted with
# kernels' own API (what transformers' GGUF path calls in kernels), the attention registered as
# transformers registers it
compat.needs(
    ("transformers.utils.import_utils", "is_kernels_available", ()),
    ("transformers.integrations.gguf.kernels", "is_kernels_available", ()),
    ("transformers.integrations.gguf.kernels", "kernelize_ggml_layers", ("model",)),
    ("kernels", "kernelize", ("model",)),
    ("kernels", "use_kernel_mapping", ("mapping",)),
    ("kernels", "register_kernel_mapping", ("mapping",)),
    ("transformers.integrations.hub_kernels", "load_and_register_attn_kernel",
     ("attn_implementation", "attention_wrapper", "allow_all_kernels")),
    ("transformers", "AttentionInterface.register.__func__", ("cls", "key", "value")),  # a classmethod
    ("transformers", "AttentionMaskInterface.register.__func__", ("cls", "key", "value")),
    ("transformers.masking_utils", "sdpa_mask", None),
)


# transformers class -> the kernel layer name its `use_kernel_forward_from_hub` decorator gives it
# (the layers of the architectures enable() keeps packed that we have a kernel for)
LAYER_CLASSES = {
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": "RMSNorm",
    "transformers.models.lfm2.modeling_lfm2.Lfm2RMSNorm": "RMSNorm",
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm": "RMSNormZeroCentered",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm": "RMSNormZeroCentered",
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": "Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": "Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter": "SoftmaxTopKRouter",
}
# transformers class -> (the module-level function its forward calls, that function's kernel layer
# name), attached by its `use_kernelized_func` decorator
FUNCTION_USERS = {
    "transformers.models.llama.modeling_llama.LlamaAttention": ("apply_rotary_pos_emb", "rotary_pos_emb"),
    "transformers.models.lfm2.modeling_lfm2.Lfm2Attention": ("apply_rotary_pos_emb", "rotary_pos_emb"),
}


def install(patches, ours: dict) -> None:
    """Open the gate for `ours` (Hub id -> build folder); nothing to do where transformers takes
    the installed kernels."""
    if compat.transformers_uses_kernels():
        return
    from transformers.integrations.gguf import kernels as gguf_kernels

    patches.set_attr(gguf_kernels, "is_kernels_available", _our_kernels_are_available)

    def make(original):
        def kernelize_ggml_layers(model) -> None:
            add_kernel_hooks(model, patches)
            return original(model)

        return kernelize_ggml_layers

    patches.wrap(gguf_kernels, "kernelize_ggml_layers", make)
    if locate.ATTENTION in ours:
        _register_attention_ourselves(patches)


def _our_kernels_are_available(*args, **kwargs) -> bool:
    return True


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def add_kernel_hooks(model, patches) -> None:
    """Give `model`'s layers of `LAYER_CLASSES` / `FUNCTION_USERS` the hooks kernels' `kernelize`
    looks for, where their class was defined without them (through `patches`: undone by disable())."""
    import kernels

    for module in model.modules():
        cls = type(module)
        layer = LAYER_CLASSES.get(_qualified_name(cls))
        if layer is not None and not hasattr(cls, "kernel_layer_name"):
            patches.set_attr(cls, "kernel_layer_name", layer)
        function, layer = FUNCTION_USERS.get(_qualified_name(cls), (None, None))
        if function is None:
            continue
        owner = sys.modules[cls.__module__]
        kernel_function = getattr(owner, function)
        if not hasattr(kernel_function, "kernel_layer_name"):
            kernel_function = kernels.use_kernel_forward_from_hub(layer)(kernel_function)
            patches.set_attr(owner, function, kernel_function)
        module.__dict__.setdefault("_kernel_funcs", {})[layer] = kernel_function


def _register_attention_ourselves(patches) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations import hub_kernels
    from transformers.masking_utils import sdpa_mask

    def make(original):
        def load_and_register_attn_kernel(attn_implementation, attention_wrapper=None, allow_all_kernels=False):
            if attn_implementation != locate.ATTENTION:
                return original(attn_implementation, attention_wrapper, allow_all_kernels)
            kernel = hub_kernels.get_kernel(attn_implementation, version=1)
            AttentionInterface.register(attn_implementation, attention_wrapper or kernel.flash_attn_forward)
            AttentionMaskInterface.register(attn_implementation, sdpa_mask)
            return kernel

        return load_and_register_attn_kernel

    patches.wrap(hub_kernels, "load_and_register_attn_kernel", make)

"""A prefill into a static cache attends as transformers means it to on ggml-attn.

transformers leaves the attention mask out (`attention_mask=None`) where SDPA's `is_causal` gives the
same result (transformers 5.22 `masking_utils._ignore_causal_mask_sdpa`): one query, as many queries
as keys, and a prefill from position 0 into a `StaticCache` longer than the prompt. SDPA aligns
`is_causal` top-left: query i sees keys 0..i, and the cache's empty positions past the prompt never.
ggml-attn's `flash_attn_forward` reads a missing mask as causal aligned bottom-right (query i sees
keys up to i + Skv - Sq): the same in the first two cases, and in the third every query also saw the
next positions, the empty ones among them. That moved a tiny llama's logits by 6-16 % and Qwen3.5
tiny's first token's by 1.7 % with `cache_implementation="static"` (its one full-attention layer).

`install()` wraps the attention function transformers registers for ggml-attn: with no mask, more
than one query and more keys than queries, it attends to the first Sq keys (views, no copy), where
bottom-right and top-left causal are the same. Everything else goes to ggml-attn unchanged.
"""

from __future__ import annotations

from . import locate


def top_left_causal(attention):
    """`attention` (transformers' attention interface, a missing mask meaning bottom-right causal)
    with a missing mask over more keys than queries read top-left, as transformers means it."""

    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        queries = query.shape[-2]
        if attention_mask is None and 1 < queries < key.shape[-2]:
            key, value = key[..., :queries, :], value[..., :queries, :]
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    forward.top_left_of = attention
    return forward


def install(patches) -> None:
    """Through `patches` (a `PatchSet`): when transformers registers ggml-attn's attention, the
    registered function is `top_left_causal` of it (the entry before is restored on undo)."""
    from transformers import AttentionInterface
    from transformers.integrations import hub_kernels

    mapping = AttentionInterface._global_mapping

    def make(original):
        def load_and_register_attn_kernel(attn_implementation, *args, **kwargs):
            kernel = original(attn_implementation, *args, **kwargs)
            registered = mapping.get(attn_implementation)
            ours = attn_implementation.partition("@")[0].partition(":")[0].strip() == locate.ATTENTION
            if ours and registered is not None and not hasattr(registered, "top_left_of"):
                patches.set_item(mapping, attn_implementation, top_left_causal(registered), "AttentionInterface")
            return kernel

        return load_and_register_attn_kernel

    patches.wrap(hub_kernels, "load_and_register_attn_kernel", make)

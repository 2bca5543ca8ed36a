"""Packed-load support for GGUF architectures transformers (5.22, 5.23) still sends to its legacy,
dequantizing loader.

transformers keeps a file's blocks packed only for the architectures in its `GGUF_ARCHS` table
(qwen35, qwen35moe, lfm2); any other falls back to a loader that unpacks every weight to a dense
float tensor. `register()` adds entries here for `llama` (SmolLM2, Llama, Mistral-style files), in
transformers' own vocabulary (renamings plus converters whose ops are safe on packed rows), so the
same `GgufLinear` / `GgufEmbedding` modules hold the blocks and our kernels compute on them.

What llama.cpp's converter does to a llama checkpoint, and how it is undone:
- names: `blk.N.attn_q` etc. (renamed back);
- q_proj and k_proj rows are permuted per head from rotate-half order to interleaved pairs, since
  ggml's plain rope rotates adjacent pairs: row (h, i, j) of the file, i < head_dim/2, j < 2, is
  row (h, j, i) of the original. A row permutation never splits a block, so the weight stays packed
  and only the row order changes back (`PermuteRows`).
Norms are stored as they are (no `1 + w` offset in llama files).
"""

from __future__ import annotations

import torch

from . import compat

# llama files kept packed: transformers' own table, renamings and row permutation
compat.needs(
    ("transformers.integrations.gguf.gguf_conversion_mapping", "GGUF_ARCHS", None),
    ("transformers.integrations.gguf.gguf_conversion_mapping", "DENSE_DECODER_RENAMINGS", None),
    ("transformers.integrations.gguf.gguf_conversion_mapping", "PermuteRows", None),
    ("transformers.core_model_loading", "WeightConverter", None),
    ("transformers.core_model_loading", "WeightRenaming", None),
)


def rope_rows_to_rotate_half(n_head: int, head_dim: int) -> torch.Tensor:
    """Index `p` with `original = file[p]` for a q/k weight of `n_head` heads of `head_dim` rows."""
    # file row of original (h, j, i) is (h, i, j): h * head_dim + i * 2 + j
    # on the CPU explicitly: the mapping is built under a meta default device, where an index
    # tensor holds no data
    h = torch.arange(n_head, device="cpu").view(-1, 1, 1)
    j = torch.arange(2, device="cpu").view(1, -1, 1)
    i = torch.arange(head_dim // 2, device="cpu").view(1, 1, -1)
    return (h * head_dim + i * 2 + j).reshape(-1)


def _llama(config) -> list:
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    from transformers.integrations.gguf.gguf_conversion_mapping import DENSE_DECODER_RENAMINGS, PermuteRows

    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    norms = [
        WeightRenaming(r"^output_norm\.", "model.norm."),
        WeightRenaming(r"\.attn_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.ffn_norm\.", ".post_attention_layernorm."),
    ]
    rope = [
        WeightConverter(
            source_patterns="self_attn.q_proj.weight",
            target_patterns="self_attn.q_proj.weight",
            operations=[PermuteRows(rope_rows_to_rotate_half(text.num_attention_heads, head_dim))],
        ),
        WeightConverter(
            source_patterns="self_attn.k_proj.weight",
            target_patterns="self_attn.k_proj.weight",
            operations=[PermuteRows(rope_rows_to_rotate_half(text.num_key_value_heads, head_dim))],
        ),
    ]
    return list(DENSE_DECODER_RENAMINGS) + norms + rope


ARCHS = {"llama": _llama}


def register(patches) -> list[str]:
    """Add our architectures to transformers' packed GGUF table through `patches` (a `PatchSet`);
    returns the ones added."""
    from transformers.integrations.gguf import gguf_conversion_mapping

    added = [arch for arch in ARCHS if arch not in gguf_conversion_mapping.GGUF_ARCHS]
    for arch in added:
        patches.set_item(gguf_conversion_mapping.GGUF_ARCHS, arch, ARCHS[arch], label="GGUF_ARCHS")
    return added

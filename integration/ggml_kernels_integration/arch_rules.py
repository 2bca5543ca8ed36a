"""What a model of each architecture reads from a GGUF file: the tables `validate` checks a file against.

- `KINDS`: what a hyperparameter of each kind must be (a positive integer, a finite positive number, ...);
- `GENERAL_PARAMS`: hyperparameters checked on every architecture, where the file has them;
- `ARCH_RULES` (qwen35, qwen35moe, llama): the hyperparameters a model's config reads (`Param`: the
  `<arch>.<key>` it comes from, its default from the ones before it, its kind), the relations
  between them, and the groups of `TENSORS` the whole model and each block need;
- `TENSORS`: each tensor's shape as the file lists it, from the hyperparameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from .gguf_header import is_int


@dataclass(frozen=True)
class Param:
    """A hyperparameter read from `<arch>.<key>`."""

    key: str
    default: Callable[[SimpleNamespace], object] | None = None  # from the ones before it; None: required
    kind: str = "size"  # see KINDS


KINDS = {  # kind -> (test, what the value must be)
    "size": (lambda v: is_int(v) and v >= 1, "a positive integer"),
    "count": (lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    "real": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
             "a finite positive number"),
    "sizes": (lambda v: isinstance(v, list) and v and all(is_int(x) and x >= 0 for x in v),
              "a list of non-negative integers"),
}

# Checked on every architecture where the file has them (`<arch>.<key>`: kind).
GENERAL_PARAMS = {
    "block_count": "size", "context_length": "size", "embedding_length": "size", "attention.head_count": "size",
    "vocab_size": "size", "rope.freq_base": "real", "attention.layer_norm_rms_epsilon": "real",
    "attention.layer_norm_epsilon": "real",
}


@dataclass(frozen=True)
class ArchRules:
    """What a model of one architecture reads from a file: its hyperparameters (name -> where the
    file states it), relations between them, and the tensors (groups of `TENSORS`) of the whole
    model and of block `i`."""

    params: dict[str, Param]
    relations: tuple[tuple[str, Callable[[SimpleNamespace], bool]], ...]  # (statement, holds)
    block_groups: Callable[[SimpleNamespace, int], tuple[str, ...]]
    model_groups: tuple[str, ...] = ("model",)


# Tensor shapes as the file lists them (ggml order: the row length first), from the hyperparameters
# above (and `tokens`, the tokenizer's length); `blk.{i}.` goes in front of the block ones.
TENSORS: dict[str, dict[str, Callable[[SimpleNamespace], tuple[int, ...]]]] = {
    "model": {
        "token_embd.weight": lambda p: (p.embd, p.vocab),
        "output_norm.weight": lambda p: (p.embd,),
        "output.weight": lambda p: (p.embd, p.vocab),
    },
    "llama_attention": {
        "attn_norm.weight": lambda p: (p.embd,),
        "attn_q.weight": lambda p: (p.embd, p.heads * p.head_dim),
        "attn_k.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_v.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_output.weight": lambda p: (p.heads * p.head_dim, p.embd),
        "ffn_norm.weight": lambda p: (p.embd,),
    },
    "qwen35_norms": {
        "attn_norm.weight": lambda p: (p.embd,),
        "post_attention_norm.weight": lambda p: (p.embd,),
    },
    "gated_attention": {  # each head's query followed by its output gate
        "attn_q.weight": lambda p: (p.embd, 2 * p.heads * p.head_dim),
        "attn_k.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_v.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_output.weight": lambda p: (p.heads * p.head_dim, p.embd),
        "attn_q_norm.weight": lambda p: (p.head_dim,),
        "attn_k_norm.weight": lambda p: (p.head_dim,),
    },
    "linear_attention": {  # gated delta net: fused q/k/v, then a convolution over it
        "attn_qkv.weight": lambda p: (p.embd, 2 * p.k_heads * p.k_dim + p.v_size),
        "attn_gate.weight": lambda p: (p.embd, p.v_size),
        "ssm_conv1d.weight": lambda p: (p.conv, 2 * p.k_heads * p.k_dim + p.v_size),
        "ssm_dt.bias": lambda p: (p.v_heads,),
        "ssm_a": lambda p: (p.v_heads,),
        "ssm_beta.weight": lambda p: (p.embd, p.v_heads),
        "ssm_alpha.weight": lambda p: (p.embd, p.v_heads),
        "ssm_norm.weight": lambda p: (p.v_size // p.v_heads,),
        "ssm_out.weight": lambda p: (p.v_size, p.embd),
    },
    "dense_ffn": {
        "ffn_gate.weight": lambda p: (p.embd, p.ff),
        "ffn_up.weight": lambda p: (p.embd, p.ff),
        "ffn_down.weight": lambda p: (p.ff, p.embd),
    },
    "moe_ffn": {  # routed experts, and a shared one with its gate
        "ffn_gate_inp.weight": lambda p: (p.embd, p.experts),
        "ffn_gate_exps.weight": lambda p: (p.embd, p.expert_ff, p.experts),
        "ffn_up_exps.weight": lambda p: (p.embd, p.expert_ff, p.experts),
        "ffn_down_exps.weight": lambda p: (p.expert_ff, p.embd, p.experts),
        "ffn_gate_inp_shexp.weight": lambda p: (p.embd,),
        "ffn_gate_shexp.weight": lambda p: (p.embd, p.shared_ff),
        "ffn_up_shexp.weight": lambda p: (p.embd, p.shared_ff),
        "ffn_down_shexp.weight": lambda p: (p.shared_ff, p.embd),
    },
}
# llama.cpp writes the output projection only when it is not the embedding matrix
OPTIONAL_TENSORS = {"output.weight"}

# What transformers' Qwen3.5 config reads (gguf_config_mapping._qwen35_config).
_QWEN35_PARAMS = {
    "blocks": Param("block_count"),
    "mtp": Param("nextn_predict_layers", lambda p: 0, "count"),  # the file counts them in block_count
    "context": Param("context_length"),
    "embd": Param("embedding_length"),
    "heads": Param("attention.head_count"),
    "kv_heads": Param("attention.head_count_kv"),
    "head_dim": Param("attention.key_length"),
    "eps": Param("attention.layer_norm_rms_epsilon", kind="real"),
    "rope_base": Param("rope.freq_base", kind="real"),
    "rope_dims": Param("rope.dimension_count"),
    "rope_sections": Param("rope.dimension_sections", kind="sizes"),
    "interval": Param("full_attention_interval"),
    "conv": Param("ssm.conv_kernel"),
    "k_dim": Param("ssm.state_size"),
    "k_heads": Param("ssm.group_count"),
    "v_heads": Param("ssm.time_step_rank"),
    "v_size": Param("ssm.inner_size"),
}
_QWEN35_RELATIONS = (
    ("{mtp} must be less than {blocks}", lambda p: p.mtp < p.blocks),
    ("{heads} must be a multiple of {kv_heads}", lambda p: p.heads % p.kv_heads == 0),
    ("{v_heads} must be a multiple of {k_heads}", lambda p: p.v_heads % p.k_heads == 0),
    ("{v_size} must be a multiple of {v_heads}", lambda p: p.v_size % p.v_heads == 0),
    ("{rope_dims} must be even and at most {head_dim}", lambda p: p.rope_dims % 2 == 0 and p.rope_dims <= p.head_dim),
    ("{rope_sections} must add up to half {rope_dims}", lambda p: 2 * sum(p.rope_sections) == p.rope_dims),
)


def _qwen35_blocks(ffn: str) -> Callable[[SimpleNamespace, int], tuple[str, ...]]:
    # every `interval`-th layer is full attention, the others linear (transformers' layer_types)
    return lambda p, i: ("qwen35_norms", "gated_attention" if (i + 1) % p.interval == 0 else "linear_attention", ffn)


ARCH_RULES = {
    "qwen35": ArchRules(
        params=_QWEN35_PARAMS | {"ff": Param("feed_forward_length")},
        relations=_QWEN35_RELATIONS,
        block_groups=_qwen35_blocks("dense_ffn"),
    ),
    "qwen35moe": ArchRules(
        params=_QWEN35_PARAMS | {
            "experts": Param("expert_count"),
            "experts_used": Param("expert_used_count"),
            "expert_ff": Param("expert_feed_forward_length"),
            "shared_ff": Param("expert_shared_feed_forward_length"),
        },
        relations=_QWEN35_RELATIONS + (("{experts_used} must be at most {experts}", lambda p: p.experts_used <= p.experts),),
        block_groups=_qwen35_blocks("moe_ffn"),
    ),
    # transformers' legacy llama config (integrations/ggml.py), which our packed llama load uses too
    "llama": ArchRules(
        params={
            "blocks": Param("block_count"),
            "context": Param("context_length"),
            "embd": Param("embedding_length"),
            "ff": Param("feed_forward_length"),
            "heads": Param("attention.head_count"),
            "kv_heads": Param("attention.head_count_kv", lambda p: p.heads),
            "head_dim": Param("rope.dimension_count", lambda p: p.embd // p.heads),
            "vocab": Param("vocab_size", lambda p: p.tokens),
        },
        relations=(
            ("{heads} must be a multiple of {kv_heads}", lambda p: p.heads % p.kv_heads == 0),
            ("{head_dim} must be even", lambda p: p.head_dim % 2 == 0),  # ggml's rope rotates pairs
            ("{tokens} must not outnumber {vocab}", lambda p: p.tokens <= p.vocab),
        ),
        block_groups=lambda p, i: ("llama_attention", "dense_ffn"),
    ),
}

"""GGUF files of Qwen3.5 (dense, arch `qwen35`) and Qwen3.5-MoE (`qwen35moe`) with random weights.

No Qwen3.5 GGUF can be downloaded here, so these stand in for one: real shapes (or tiny ones for
tests), weights drawn at a trained model's scale, quantized by ggml's own quantizers (the
`ggml-quantization` kernel, bit-identical to llama.cpp's), and a small byte-level BPE tokenizer
(`tools/models/bpe_tokenizer.py`). llama.cpp b11312 (`llama_cpp.Llama`) and transformers 5.22.2
(`from_pretrained(dir, gguf_file=name)`) both load them, so the same file can be run by both.

    python -m tools.models.make_gguf                    # the tiny test models, into <cache>/models/
    python -m tools.models.make_gguf --which bench      # Qwen3.5-0.8B shape + its MoE counterpart
    python -m tools.models.make_gguf --which all --out DIR
    python -m tools.models.make_gguf --config qwen35-tiny --mix F32

    from tools.models import make_gguf; path = make_gguf.ensure("qwen35-tiny", "Q4_K_M")   # generate if missing

Files that exist (and were written by this version of the generator) are kept.

The file is laid out as llama.cpp's converter lays out a real checkpoint, and transformers undoes
the same conventions at load: every `*_norm.weight` except the linear-attention gated norm
(`ssm_norm`) holds `1 + w`, `ssm_a` holds `-exp(A_log)`, `ssm_conv1d` is 2-D, and the value heads
of the linear attention are in llama.cpp's tiled order (which only matters to a reader, since the
weights are random: both readers must agree on one function).

Quantization mixes:
  Q4_K_M  llama.cpp's Q4_K_M rules: Q4_K by default; Q6_K for `attn_v` / `attn_qkv` (the
          linear attention's fused q/k/v, which llama.cpp's quantizer counts as a value
          projection) and every `ffn_down*` on the layers llama.cpp's `use_more_bits` picks
          (the first and last eighth, and every third in between); `output` Q6_K; an untied
          `token_embd` Q8_0 (a tied one is the output, Q6_K). Rows whose length is not a
          multiple of 256 fall back: Q6_K -> Q8_0 as in llama.cpp, and Q4_K -> Q4_0 (llama.cpp
          takes Q5_0, which transformers 5.22.2 cannot read).
  Q8_0, Q4_0, F16  every quantizable matrix in that type.
  F32     nothing quantized: llama.cpp then computes in float32 too, and agrees with transformers
          to ~1e-4 of the logits, which pins every convention above.
In all mixes norms, 1-D tensors, `ssm_conv1d` and the router `ffn_gate_inp` stay F32, as llama.cpp
leaves them. Every mix of one config holds the same float weights (one seed per tensor name).

The weights are random but scaled so the model is neither degenerate nor chaotic (see the
constants above `init_values`), and A_log / dt_bias / conv1d are drawn as Qwen3.5 / Mamba
initialise them. On quantized files llama.cpp also rounds the activations to 8 bits, which
transformers does not; on these models that gives (Q4_K_M, 16 tokens) an rms logit difference of
4-5% and top-1 agreement of 94-100% on the tiny ones, 5% / 94% at the 0.8B shape and 8% / 94% for
its MoE counterpart (an F32 file: 2e-5, 100%).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.build import files, upstream
from tools.models import bpe_tokenizer

GENERATOR_VERSION = "3"
VERSION_KEY = "ggml_kernels.generator_version"
MIXES = ("Q4_K_M", "Q8_0", "Q4_0", "F16", "F32")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    arch: str  # "qwen35" or "qwen35moe"
    vocab: int
    hidden: int
    layers: int
    n_head: int
    n_head_kv: int
    head_dim: int  # full attention
    lin_k_heads: int  # linear attention (gated delta net)
    lin_v_heads: int
    lin_head_dim: int  # key and value head dim: llama.cpp takes both from ssm.state_size
    intermediate: int = 0  # dense FFN
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    tied: bool = False
    conv_kernel: int = 4
    full_attention_interval: int = 4
    partial_rotary: float = 0.25
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)
    rope_theta: float = 10_000_000.0
    rms_eps: float = 1e-6
    context: int = 262_144
    seed: int = 0
    # routed experts: quantize this many experts' worth of rows per tensor and build every expert
    # from a random selection of those rows (None: every expert drawn and quantized on its own)
    expert_row_pool: int | None = None

    @property
    def moe(self) -> bool:
        return self.arch == "qwen35moe"

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if self.is_full_attention(i) else "linear_attention" for i in range(self.layers)]


CONFIGS = {
    # Tests. Everything a reader can get wrong is there, at a few MB: hybrid layers (3 linear + 1
    # full), more value heads than key heads (the tiled value order), tied embeddings, head_dim 256
    # with the real mrope sections.
    "qwen35-tiny": ModelConfig(
        name="qwen35-tiny", arch="qwen35", vocab=2048, hidden=256, layers=4, intermediate=512,
        n_head=4, n_head_kv=2, head_dim=256, lin_k_heads=2, lin_v_heads=4, lin_head_dim=128,
        tied=True, context=4096, seed=1,
    ),
    # MoE: untied output, head_dim 128 (so rope sections 6/5/5), 16 experts top-4, and a shared
    # expert 384 wide, whose ffn_down rows fall back from the K-quants.
    "qwen35moe-tiny": ModelConfig(
        name="qwen35moe-tiny", arch="qwen35moe", vocab=2048, hidden=256, layers=4,
        n_head=4, n_head_kv=2, head_dim=128, lin_k_heads=2, lin_v_heads=2, lin_head_dim=128,
        experts=16, experts_used=4, expert_ff=256, shared_ff=384, rope_sections=(6, 5, 5, 0),
        tied=False, context=4096, seed=2,
    ),
    # Qwen3.5-0.8B's shapes, with the vocabulary cut from 248320 to 32768.
    "qwen35-0.8b": ModelConfig(
        name="qwen35-0.8b", arch="qwen35", vocab=32768, hidden=1024, layers=24, intermediate=3584,
        n_head=8, n_head_kv=2, head_dim=256, lin_k_heads=16, lin_v_heads=16, lin_head_dim=128,
        tied=True, seed=3,
    ),
    # The 0.8B trunk with Qwen3.5-MoE's FFN: 64 routed experts (top 8) and a shared expert, each
    # 256 wide, and the MoE's 2:1 value:key heads. 1.64B weights, 0.55B read per token. Experts
    # are built from a pool of quantized rows (8 experts' worth per tensor), to write them fast.
    "qwen35moe-1.6b-a0.5b": ModelConfig(
        name="qwen35moe-1.6b-a0.5b", arch="qwen35moe", vocab=32768, hidden=1024, layers=24,
        n_head=8, n_head_kv=2, head_dim=256, lin_k_heads=16, lin_v_heads=32, lin_head_dim=128,
        experts=64, experts_used=8, expert_ff=256, shared_ff=256, tied=False, seed=4,
        expert_row_pool=8,
    ),
}
SETS = {
    "tiny": [(name, mix) for name in ("qwen35-tiny", "qwen35moe-tiny") for mix in ("Q4_K_M", "Q8_0", "Q4_0")],
    "bench": [("qwen35-0.8b", "Q4_K_M"), ("qwen35moe-1.6b-a0.5b", "Q4_K_M")],
}
SETS["all"] = SETS["tiny"] + SETS["bench"]


def file_name(config: str, mix: str) -> str:
    return f"{config}.{mix}.gguf"


def default_dir() -> Path:
    return upstream.cache_dir() / "models"


# ---------------------------------------------------------------------------------------------
# tensors: names and shapes (numpy order: rows first; GGUF lists the same dims reversed)
# ---------------------------------------------------------------------------------------------


def tensor_plan(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    H = cfg.hidden
    key_dim = cfg.lin_k_heads * cfg.lin_head_dim
    value_dim = cfg.lin_v_heads * cfg.lin_head_dim
    conv_dim = 2 * key_dim + value_dim
    plan = [("token_embd.weight", (cfg.vocab, H))]
    for il in range(cfg.layers):
        b = f"blk.{il}."
        plan += [(b + "attn_norm.weight", (H,)), (b + "post_attention_norm.weight", (H,))]
        if cfg.is_full_attention(il):
            q = cfg.n_head * cfg.head_dim
            kv = cfg.n_head_kv * cfg.head_dim
            plan += [
                (b + "attn_q.weight", (2 * q, H)),  # per head: query then its output gate
                (b + "attn_k.weight", (kv, H)),
                (b + "attn_v.weight", (kv, H)),
                (b + "attn_output.weight", (H, q)),
                (b + "attn_q_norm.weight", (cfg.head_dim,)),
                (b + "attn_k_norm.weight", (cfg.head_dim,)),
            ]
        else:
            plan += [
                (b + "attn_qkv.weight", (conv_dim, H)),
                (b + "attn_gate.weight", (value_dim, H)),
                (b + "ssm_conv1d.weight", (conv_dim, cfg.conv_kernel)),
                (b + "ssm_dt.bias", (cfg.lin_v_heads,)),
                (b + "ssm_a", (cfg.lin_v_heads,)),
                (b + "ssm_beta.weight", (cfg.lin_v_heads, H)),
                (b + "ssm_alpha.weight", (cfg.lin_v_heads, H)),
                (b + "ssm_norm.weight", (cfg.lin_head_dim,)),
                (b + "ssm_out.weight", (H, value_dim)),
            ]
        if cfg.moe:
            E, F, S = cfg.experts, cfg.expert_ff, cfg.shared_ff
            plan += [
                (b + "ffn_gate_inp.weight", (E, H)),
                (b + "ffn_gate_exps.weight", (E, F, H)),
                (b + "ffn_up_exps.weight", (E, F, H)),
                (b + "ffn_down_exps.weight", (E, H, F)),
                (b + "ffn_gate_inp_shexp.weight", (H,)),
                (b + "ffn_gate_shexp.weight", (S, H)),
                (b + "ffn_up_shexp.weight", (S, H)),
                (b + "ffn_down_shexp.weight", (H, S)),
            ]
        else:
            ff = cfg.intermediate
            plan += [(b + "ffn_gate.weight", (ff, H)), (b + "ffn_up.weight", (ff, H)), (b + "ffn_down.weight", (H, ff))]
    plan.append(("output_norm.weight", (H,)))
    if not cfg.tied:
        plan.append(("output.weight", (cfg.vocab, H)))
    return plan


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active): the weights one token reads, i.e. its routed experts only, one embedding row,
    and the output projection (which is the embedding when tied)."""
    total = active = 0
    for name, shape in tensor_plan(cfg):
        n = math.prod(shape)
        total += n
        if name == "token_embd.weight":
            active += cfg.hidden + (n if cfg.tied else 0)
        else:
            active += n * cfg.experts_used // cfg.experts if "_exps." in name else n
    return total, active


# ---------------------------------------------------------------------------------------------
# storage types
# ---------------------------------------------------------------------------------------------


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama.cpp's choice of layers that get more bits in the *_M mixes
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and not name.endswith("_norm.weight")
        and "ffn_gate_inp.weight" not in name
        and "ssm_conv1d" not in name
    )


def storage_type(cfg: ModelConfig, mix: str, name: str, shape: tuple[int, ...]) -> str:
    """The ggml type name `name` is stored in, in `mix`."""
    if not quantizable(name, shape):
        return "F32"
    if mix in ("Q8_0", "Q4_0", "F16", "F32"):
        return mix
    if mix != "Q4_K_M":
        raise ValueError(f"unknown mix {mix!r}; known: {MIXES}")
    if name == "output.weight" or (name == "token_embd.weight" and cfg.tied):
        wanted = "Q6_K"
    elif name == "token_embd.weight":
        wanted = "Q8_0"
    elif ".attn_v." in name or ".attn_qkv." in name or ".ffn_down" in name:
        # one value projection per layer, so llama.cpp's attn_v counter is the layer index
        wanted = "Q6_K" if _use_more_bits(_layer(name), cfg.layers) else "Q4_K"
    else:
        wanted = "Q4_K"
    if shape[-1] % 256:
        wanted = {"Q6_K": "Q8_0", "Q5_K": "Q8_0", "Q4_K": "Q4_0"}.get(wanted, wanted)
    return wanted


# ---------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------

# Scales. The matrices that read a normalized input get std 1/sqrt(fan-in) (0.02-0.03 at the real
# shapes), so every projection has unit-scale outputs. The rest is set so that the model is neither
# degenerate nor chaotic:
# - the logits have std LOGIT_STD (output / tied embedding std LOGIT_STD / sqrt(hidden));
# - the projections that write into the residual stream (RESIDUAL_PROJECTIONS) are large in layer 0
#   (FIRST_LAYER_GAIN: the block's output has rms ~LOGIT_STD / 2, far above the embedding, so a tied
#   model does not just predict its input token back) and small after it (LAYER_GAIN: each later
#   block adds ~15% of that). With unit gains everywhere instead, a block's output is as large as
#   the residual stream it is added to, and a random network then amplifies small perturbations layer
#   after layer: llama.cpp's rounding of the activations to 8 bits (1% per matmul) grew to 33% of the
#   logits at 24 layers, against 5% with these gains (transformers vs llama.cpp on the same file).
# - the router's logits have std ROUTER_STD: a clear top-k, which a rounding error rarely reorders.
LOGIT_STD = 2.5
NORM_STD = 0.05  # zero-centred norm weights w: the file holds 1 + w
FIRST_LAYER_GAIN = 1.0
LAYER_GAIN = 0.15
ROUTER_STD = 4.0
RESIDUAL_PROJECTIONS = ("attn_output", "ssm_out", "ffn_down", "ffn_down_exps", "ffn_down_shexp")


def _rng(cfg: ModelConfig, name: str, part: int = 0) -> np.random.Generator:
    # per tensor, so every mix of one config quantizes the same float weights
    return np.random.default_rng([cfg.seed, zlib.crc32(name.encode()), part])


def _normal(rng: np.random.Generator, shape, std: float) -> np.ndarray:
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)
    return out


def init_values(cfg: ModelConfig, name: str, shape: tuple[int, ...], part: int = 0) -> np.ndarray:
    """Float32 values for one tensor, at the scale of a trained model, as the file stores them."""
    rng = _rng(cfg, name, part)
    H = cfg.hidden
    if name.endswith("_norm.weight"):
        # near 1 either way: the gated `ssm_norm` multiplies by its weight as stored, the others
        # are stored as 1 + w for a zero-centred w
        return 1.0 + _normal(rng, shape, NORM_STD)
    if name.endswith(".ssm_a"):  # -exp(A_log), A in [1, 16] as Qwen3.5 initialises it
        return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):  # softplus(dt_bias) = dt, log-uniform in [1e-3, 0.1]
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(0.1), shape))
        return np.log(np.expm1(dt)).astype(np.float32)
    if ".ssm_conv1d." in name:  # depthwise conv, fan-in = kernel size
        bound = 1.0 / math.sqrt(cfg.conv_kernel)
        return rng.uniform(-bound, bound, shape).astype(np.float32)
    if name in ("output.weight", "token_embd.weight"):
        return _normal(rng, shape, LOGIT_STD / math.sqrt(H))
    if any(f".{proj}." in name for proj in RESIDUAL_PROJECTIONS):
        gain = FIRST_LAYER_GAIN if _layer(name) == 0 else LAYER_GAIN
        return _normal(rng, shape, gain * LOGIT_STD / math.sqrt(shape[-1]))
    if ".ffn_gate_inp." in name:
        return _normal(rng, shape, ROUTER_STD / math.sqrt(H))
    if ".ffn_gate_inp_shexp." in name:  # the shared expert's sigmoid gate: mostly between 0.3 and 0.7
        return _normal(rng, shape, 1.0 / math.sqrt(H))
    # every other matrix: std 1/sqrt(fan-in), 0.02-0.03 at the real shapes
    return _normal(rng, shape, 1.0 / math.sqrt(shape[-1]))


# ---------------------------------------------------------------------------------------------
# quantization through our kernel
# ---------------------------------------------------------------------------------------------

_GQ = None


def _quantizer():
    global _GQ
    if _GQ is None:
        from tools.testing import kernel_testing

        # LOCAL_KERNELS only for this load: left set, it would also make transformers (in the same
        # process) pick up our builds when it loads a GGUF file, instead of its stock path.
        saved = {key: os.environ.get(key) for key in ("LOCAL_KERNELS", "HF_HUB_OFFLINE")}
        try:
            kernel_testing.point_hub_ids_at_local_builds()
            _GQ = kernel_testing.load_kernel("ggml-org/ggml-quantization")
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return _GQ


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 (..., cols) -> the packed uint8 rows (..., row_bytes) ggml stores for `type_name`."""
    import torch

    packed = _quantizer().quantize(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), type_name)
    return packed.numpy()


def stored_nbytes(shape: tuple[int, ...], type_name: str) -> int:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def _store(values: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    return quantize(values, type_name)


def tensor_data(cfg: ModelConfig, mix: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes of one tensor as the file stores them (float32, float16 or packed uint8 rows)."""
    type_name = storage_type(cfg, mix, name, shape)
    if "_exps." in name and cfg.expert_row_pool and cfg.expert_row_pool < shape[0]:
        # a pool of independently drawn rows, stored once; each expert takes a random subset of them
        n_experts, rows, cols = shape
        pool_rows = cfg.expert_row_pool * rows
        pool = _store(init_values(cfg, name, (pool_rows, cols)), type_name)
        rng = _rng(cfg, name, part=1)
        picks = np.stack([rng.permutation(pool_rows)[:rows] for _ in range(n_experts)])
        return pool[picks]
    return _store(init_values(cfg, name, shape), type_name)


# ---------------------------------------------------------------------------------------------
# the file
# ---------------------------------------------------------------------------------------------


def _add_metadata(writer, cfg: ModelConfig, mix: str) -> None:
    import gguf

    ftype = {"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "F16": gguf.LlamaFileType.MOSTLY_F16,
             "F32": gguf.LlamaFileType.ALL_F32}[mix]
    writer.add_name(f"{cfg.name} (random weights)")
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_string(VERSION_KEY, GENERATOR_VERSION)

    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.hidden)
    writer.add_block_count(cfg.layers)
    if not cfg.moe:
        writer.add_feed_forward_length(cfg.intermediate)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_head_kv)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    n_rot = int(cfg.head_dim * cfg.partial_rotary)
    if sum(cfg.rope_sections) * 2 != n_rot:
        raise ValueError(f"{cfg.name}: rope sections {cfg.rope_sections} must cover {n_rot // 2} rotary pairs")
    writer.add_rope_dimension_count(n_rot)
    writer.add_rope_dimension_sections(list(cfg.rope_sections))
    writer.add_full_attention_interval(cfg.full_attention_interval)
    writer.add_ssm_conv_kernel(cfg.conv_kernel)
    writer.add_ssm_state_size(cfg.lin_head_dim)
    writer.add_ssm_group_count(cfg.lin_k_heads)
    writer.add_ssm_time_step_rank(cfg.lin_v_heads)
    writer.add_ssm_inner_size(cfg.lin_v_heads * cfg.lin_head_dim)
    if cfg.moe:
        writer.add_expert_count(cfg.experts)
        writer.add_expert_used_count(cfg.experts_used)
        writer.add_expert_feed_forward_length(cfg.expert_ff)
        writer.add_expert_shared_feed_forward_length(cfg.shared_ff)

    vocab = bpe_tokenizer.build_vocab(cfg.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(vocab.chat_template)


def write_model(cfg: ModelConfig, mix: str, path: Path, log=print) -> None:
    """Write `cfg` in `mix` to `path`, one tensor at a time (`ensure` writes a file of its own first)."""
    import gguf

    plan = [(name, shape, storage_type(cfg, mix, name, shape)) for name, shape in tensor_plan(cfg)]
    writer = gguf.GGUFWriter(path, cfg.arch)
    _add_metadata(writer, cfg, mix)
    for name, shape, type_name in plan:
        if type_name in ("F32", "F16"):
            dtype = np.dtype(np.float32 if type_name == "F32" else np.float16)
            writer.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize)
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), stored_nbytes(shape, type_name), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0 = time.time()
    for i, (name, shape, _) in enumerate(plan):
        writer.write_tensor_data(tensor_data(cfg, mix, name, shape))
        if time.time() - t0 > 10 and i % 16 == 0:
            log(f"  {path.name}: {i + 1}/{len(plan)} tensors, {time.time() - t0:.0f} s")
    writer.close()


def _current(path: Path) -> bool:
    """Whether `path` exists and was written by this version of the generator."""
    if not path.exists():
        return False
    try:
        import gguf

        field = gguf.GGUFReader(path).get_field(VERSION_KEY)
        return field is not None and field.contents() == GENERATOR_VERSION
    except Exception:  # noqa: BLE001 - unreadable: write it again
        return False


def ensure(config: str, mix: str = "Q4_K_M", out_dir: Path | str | None = None, log=print) -> Path:
    """The path of `config` in `mix`, generated first if missing or stale (once, however many processes
    ask for it at the same time)."""
    cfg = CONFIGS[config]
    out = Path(out_dir) if out_dir is not None else default_dir()
    path = out / file_name(config, mix)
    t0 = time.time()
    if files.made_once(path, _current, lambda tmp: write_model(cfg, mix, tmp, log=log)):
        total, active = parameter_counts(cfg)
        log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {total / 1e6:.0f}M params, "
            f"{active / 1e6:.0f}M active) in {time.time() - t0:.1f} s")
    return path


def generate(which: str = "tiny", out_dir: Path | str | None = None, log=print) -> list[Path]:
    return [ensure(config, mix, out_dir, log=log) for config, mix in SETS[which]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--which", choices=sorted(SETS), default="tiny")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="one model instead of a set")
    parser.add_argument("--mix", choices=MIXES, default="Q4_K_M", help="with --config")
    parser.add_argument("--out", type=Path, default=None, help=f"output folder (default {default_dir()})")
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    paths = [ensure(args.config, args.mix, args.out, log=log)] if args.config else generate(args.which, args.out, log=log)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()

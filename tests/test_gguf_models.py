"""The generated Qwen3.5 GGUF files (tools/models/make_gguf.py) load in llama.cpp and in transformers, and
both compute the same model from them.

The tiny models are written into a temporary folder. Against llama.cpp b11312 (llama-cpp-python):
the same token ids for the same text, and per-position logits that agree. An F32 file must agree
to float precision: that pins every storage convention (the `1 + w` norms, `-exp(A_log)`, the 2-D
conv1d, the tiled value heads, the gated q projection, the mrope sections). On quantized files
llama.cpp also quantizes the activations (Q8_0 / Q8_K) and transformers does not, and that noise
grows layer after layer (transformers with its activations rounded the same way reproduces
llama.cpp's differences), so those agree to a few % of the logits, with now and
then a flipped top-1 where the two best logits are close, or an MoE token routed to another
expert. A misread tensor shows as a KL of nats, far above these bounds.

transformers runs its stock path here (weights dequantized to float32, no kernel), so the other
side of the comparison is independent of this repo's kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tools.models import make_gguf

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

try:
    import llama_cpp
except ImportError:  # the oracle is optional: its parts of these tests are skipped
    llama_cpp = None

needs_llama = pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python (llama.cpp b11312) is not installed")

pytestmark = pytest.mark.slow  # whole models in transformers and llama.cpp

DENSE, MOE = "qwen35-tiny", "qwen35moe-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was a little model that"
TEXTS = [
    "Hello world",
    "Hello world!\n\nThe quick brown fox's 12345 jumps.",
    "  leading spaces\tand tabs",
    "héllo wörld, ünïcödé 日本語 🙂",
    "<|im_start|>user\nHi<|im_end|>",
    "<think>ok</think> done",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-models")


def model_path(model_dir: Path, config: str, mix: str) -> Path:
    return make_gguf.ensure(config, mix, model_dir, log=lambda message: None)


@pytest.fixture
def stock_transformers(monkeypatch):
    """transformers' own GGUF path: no kernel from this repo (conftest points the Hub ids at our builds)."""
    from transformers.integrations.gguf import kernels as gguf_kernels
    from transformers.utils import logging

    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.setattr(gguf_kernels, "_gguf_kernel", False)
    logging.disable_progress_bar()


def load_transformers(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load_llama(path: Path, **kwargs):
    return llama_cpp.Llama(model_path=str(path), n_threads=2, logits_all=True, verbose=False, n_ctx=128, **kwargs)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(reference: np.ndarray, other: np.ndarray) -> dict:
    """Per-position agreement of two (positions, vocab) logit arrays."""
    a, b = log_softmax(reference), log_softmax(other)
    kl = (np.exp(a) * (a - b)).sum(-1)
    return {
        "top1": float((reference.argmax(-1) == other.argmax(-1)).mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "rel_rms": float(np.sqrt(((reference - other) ** 2).mean()) / reference.std()),
        "max_abs": float(np.abs(reference - other).max()),
    }


# ---- the files themselves -------------------------------------------------------------------


@pytest.mark.parametrize("config", [DENSE, MOE])
def test_tensor_types_follow_the_mix(model_dir, config):
    cfg = make_gguf.CONFIGS[config]
    path = model_path(model_dir, config, "Q4_K_M")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    plan = dict(make_gguf.tensor_plan(cfg))
    assert set(types) == set(plan)
    for name, shape in plan.items():
        assert types[name] == make_gguf.storage_type(cfg, "Q4_K_M", name, shape), name
    assert {"Q4_K", "Q6_K", "F32"} <= set(types.values())
    small = [n for n in types if n.endswith(("_norm.weight", ".ssm_a", ".ssm_dt.bias", ".ffn_gate_inp_shexp.weight"))]
    assert small and all(types[n] == "F32" for n in small)
    assert types["blk.0.ssm_conv1d.weight"] == "F32"
    if cfg.tied:
        assert "output.weight" not in types and types["token_embd.weight"] == "Q6_K"
    else:
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q8_0"
    if cfg.moe:  # the shared expert's 384-wide rows are not a multiple of 256
        assert types["blk.0.ffn_gate_inp.weight"] == "F32"
        assert {types[f"blk.{i}.ffn_down_shexp.weight"] for i in range(cfg.layers)} <= {"Q4_0", "Q8_0"}
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    assert fields["general.architecture"] == cfg.arch
    assert fields[f"{cfg.arch}.full_attention_interval"] == 4
    assert fields[f"{cfg.arch}.rope.dimension_sections"] == list(cfg.rope_sections)


def test_mixes_quantize_the_same_weights(model_dir):
    """Every mix of a config holds the same float weights; Q8_0 / Q4_0 bytes equal gguf-py's quantizer's."""
    from gguf import quants

    tensors = {}
    for mix in ("F32", "Q8_0", "Q4_0", "Q4_K_M"):
        reader = gguf.GGUFReader(model_path(model_dir, DENSE, mix))
        tensors[mix] = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.2.ffn_down.weight", "token_embd.weight"):
        exact = np.asarray(tensors["F32"][name].data, dtype=np.float32)
        for mix in ("Q8_0", "Q4_0"):
            t = tensors[mix][name]
            assert np.array_equal(np.asarray(t.data), quants.quantize(exact, t.tensor_type)), (mix, name)
        for mix in ("Q8_0", "Q4_0", "Q4_K_M"):
            t = tensors[mix][name]
            values = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(exact.shape)
            rel = np.sqrt(((values - exact) ** 2).mean()) / exact.std()
            assert rel < {"Q8_0": 0.01, "Q4_0": 0.15, "Q4_K_M": 0.1}[mix], (mix, name, rel)


# ---- transformers ---------------------------------------------------------------------------


@pytest.mark.parametrize("config,mix", [(DENSE, "Q4_K_M"), (MOE, "Q4_K_M"), (DENSE, "Q4_0"), (MOE, "Q8_0")])
def test_transformers_config(model_dir, stock_transformers, config, mix):
    cfg = make_gguf.CONFIGS[config]
    model = load_transformers(model_path(model_dir, config, mix))
    c = model.config
    assert type(model).__name__ == ("Qwen3_5MoeForCausalLM" if cfg.moe else "Qwen3_5ForCausalLM")
    assert c.num_hidden_layers == cfg.layers and c.hidden_size == cfg.hidden
    assert c.layer_types == cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (cfg.n_head, cfg.n_head_kv, cfg.head_dim)
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (cfg.lin_k_heads, cfg.lin_v_heads)
    assert c.linear_key_head_dim == c.linear_value_head_dim == cfg.lin_head_dim
    assert c.linear_conv_kernel_dim == cfg.conv_kernel
    assert c.vocab_size == cfg.vocab and c.tie_word_embeddings == cfg.tied
    assert c.rope_parameters["mrope_section"] == [s for s in cfg.rope_sections if s]
    assert c.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary
    if cfg.moe:
        assert (c.num_experts, c.num_experts_per_tok) == (cfg.experts, cfg.experts_used)
        assert (c.moe_intermediate_size, c.shared_expert_intermediate_size) == (cfg.expert_ff, cfg.shared_ff)
    else:
        assert c.intermediate_size == cfg.intermediate
    with torch.no_grad():
        out = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


@pytest.mark.parametrize("config", [DENSE, MOE])
def test_tokenizer_round_trip(model_dir, config):
    tok = load_tokenizer(model_path(model_dir, config, "Q4_K_M"))
    assert len(tok) == make_gguf.CONFIGS[config].vocab
    assert tok("Hello world")["input_ids"] == [tok.convert_tokens_to_ids("Hello"), tok.convert_tokens_to_ids("Ġworld")]
    for text in TEXTS:
        assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# ---- llama.cpp ------------------------------------------------------------------------------


@needs_llama
@pytest.mark.llama_cpp
@pytest.mark.parametrize("config", [DENSE, MOE])
def test_llama_cpp_tokenizes_like_transformers(model_dir, config):
    path = model_path(model_dir, config, "Q4_K_M")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    tok = load_tokenizer(path)
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)  # the file says: no BOS
        assert ids == tok(text)["input_ids"], text
        assert llm.detokenize(ids, special=True).decode() == text
    assert llm.tokenize(b"Hello world", add_bos=False) == tok("Hello world")["input_ids"]
    # prose and code: this repo's README and this file, paragraph by paragraph
    for source in (Path(__file__).parents[1] / "README.md", Path(__file__)):
        for text in source.read_text().split("\n\n"):
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok(text)["input_ids"], text
    assert (llm.token_eos(), llm.n_vocab()) == (tok.eos_token_id, len(tok))


# About 3x what llama.cpp b11312 gives on an AVX-512 x86-64 CPU (2 threads):
#   F32            top-1 1.0, KL ~1e-9, rms 2e-5 of the logits
#   dense Q8_0     top-1 1.0, KL mean 0.0013, max 0.0025, rms 2.3%
#   dense Q4_K_M   top-1 1.0, KL mean 0.0037, max 0.0081, rms 3.7%
#   MoE Q4_0       top-1 0.94, KL mean 0.0020, max 0.0048, rms 2.6%
#   MoE Q4_K_M     top-1 0.94, KL mean 0.0080, max 0.052 (one routing flip), rms 4.9%
LOGIT_BOUNDS = {
    # (config, mix): (min top-1 agreement, max mean KL, max KL, max rms difference / logit std)
    (DENSE, "F32"): (1.0, 1e-5, 1e-4, 1e-3),
    (MOE, "F32"): (1.0, 1e-5, 1e-4, 1e-3),
    (DENSE, "Q8_0"): (0.8, 0.005, 0.01, 0.06),
    (DENSE, "Q4_K_M"): (0.8, 0.012, 0.03, 0.1),
    (MOE, "Q4_0"): (0.75, 0.008, 0.02, 0.08),
    (MOE, "Q4_K_M"): (0.75, 0.03, 0.15, 0.12),
}


@needs_llama
@pytest.mark.llama_cpp
@pytest.mark.parametrize("config,mix", list(LOGIT_BOUNDS))
def test_logits_agree_with_llama_cpp(model_dir, stock_transformers, config, mix):
    path = model_path(model_dir, config, mix)
    tok = load_tokenizer(path)
    ids = tok(PROMPT)["input_ids"][:16]
    assert len(ids) == 16

    llm = load_llama(path)
    assert llm.tokenize(PROMPT.encode(), add_bos=False)[:16] == ids
    llm.eval(ids)
    ours = np.array(llm.scores[: len(ids)], dtype=np.float64)
    llm.close()

    model = load_transformers(path)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()

    assert np.isfinite(ours).all() and np.isfinite(theirs).all()
    assert theirs.std() > 1.0, "degenerate logits"
    stats = compare(theirs, ours)
    print(f"\n{config} {mix}: " + " ".join(f"{k} {v:.4g}" for k, v in stats.items()))
    top1, kl_mean, kl_max, rel = LOGIT_BOUNDS[(config, mix)]
    assert stats["top1"] >= top1 and stats["kl_mean"] <= kl_mean and stats["kl_max"] <= kl_max, stats
    assert stats["rel_rms"] <= rel, stats


@needs_llama
@pytest.mark.llama_cpp
@pytest.mark.parametrize("config", [DENSE, MOE])
def test_llama_cpp_generates(model_dir, config):
    llm = load_llama(model_path(model_dir, config, "Q4_K_M"))
    out = llm("Hello world", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1
    assert np.isfinite(np.array(llm.scores[: llm.n_tokens])).all()
    llm.close()

"""`check_gguf` refuses a file whose metadata or tensors cannot make the model it declares, in one
sentence that names the key or tensor, before anything is built.

Each file is a small qwen35, qwen35moe or llama model written by gguf-py's `GGUFWriter` from a spec
(metadata and tensor shapes, all weights zero), with one thing changed. Damage below the metadata
(bytes cut, offsets, nesting) is in integration/tests/test_integration_bad_input.py, on a real generated file.
"""

from __future__ import annotations

import dataclasses
import math

import ggml_kernels_integration as gk
import numpy as np
import pytest
from gguf import GGUFValue, GGUFValueType, GGUFWriter

from tools.models import make_gguf

T = GGUFValueType

# make_gguf's tiny test models, smaller still: only the header is checked
QWEN35 = dataclasses.replace(
    make_gguf.CONFIGS["qwen35-tiny"], vocab=320, hidden=32, intermediate=64, n_head=2, n_head_kv=1, head_dim=32,
    lin_k_heads=1, lin_v_heads=2, lin_head_dim=16, rope_sections=(2, 1, 1, 0),
)
QWEN35MOE = dataclasses.replace(
    make_gguf.CONFIGS["qwen35moe-tiny"], vocab=320, hidden=32, n_head=2, n_head_kv=1, head_dim=32,
    lin_k_heads=1, lin_v_heads=2, lin_head_dim=16, experts=4, experts_used=2, expert_ff=32, shared_ff=32,
    rope_sections=(2, 1, 1, 0),
)


def qwen35_spec(cfg) -> tuple[dict, dict]:
    """(metadata, tensor name -> numpy shape) of a make_gguf config."""
    writer = GGUFWriter(None, cfg.arch)
    make_gguf._add_metadata(writer, cfg, "F32")
    return dict(writer.kv_data[0]), dict(make_gguf.tensor_plan(cfg))


def llama_spec(tied: bool = True) -> tuple[dict, dict]:
    """A 2-block llama (SmolLM2's layout: GQA, tied output) of hidden size 32."""
    hidden, ff, heads, kv_heads, vocab = 32, 64, 4, 2, 64
    head_dim = hidden // heads
    metadata = {
        "general.architecture": GGUFValue("llama", T.STRING),
        "llama.block_count": GGUFValue(2, T.UINT32),
        "llama.context_length": GGUFValue(2048, T.UINT32),
        "llama.embedding_length": GGUFValue(hidden, T.UINT32),
        "llama.feed_forward_length": GGUFValue(ff, T.UINT32),
        "llama.attention.head_count": GGUFValue(heads, T.UINT32),
        "llama.attention.head_count_kv": GGUFValue(kv_heads, T.UINT32),
        "llama.rope.freq_base": GGUFValue(100000.0, T.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": GGUFValue(1e-5, T.FLOAT32),
        "llama.vocab_size": GGUFValue(vocab, T.UINT32),
        "llama.rope.dimension_count": GGUFValue(head_dim, T.UINT32),
        "tokenizer.ggml.model": GGUFValue("gpt2", T.STRING),
        "tokenizer.ggml.tokens": GGUFValue([f"t{i}" for i in range(vocab)], T.ARRAY, T.STRING),
        "tokenizer.ggml.bos_token_id": GGUFValue(1, T.UINT32),
        "tokenizer.ggml.eos_token_id": GGUFValue(2, T.UINT32),
    }
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        tensors["output.weight"] = (vocab, hidden)
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_gate.weight": (ff, hidden), f"blk.{i}.ffn_up.weight": (ff, hidden), f"blk.{i}.ffn_down.weight": (hidden, ff),
        }
    return metadata, tensors


def legacy_spec() -> tuple[dict, dict]:
    """The llama file as a qwen3 one: an architecture transformers' legacy loader reads, with no
    table here, so only the checks every architecture gets apply."""
    metadata, tensors = llama_spec()
    metadata = {key.replace("llama.", "qwen3."): value for key, value in metadata.items()}
    metadata["general.architecture"] = GGUFValue("qwen3", T.STRING)
    return metadata, tensors


SPECS = {"qwen35": lambda: qwen35_spec(QWEN35), "qwen35moe": lambda: qwen35_spec(QWEN35MOE), "llama": llama_spec,
         "llama-untied": lambda: llama_spec(tied=False), "qwen3": legacy_spec}


def write(path, metadata: dict, tensors: dict) -> None:
    writer = GGUFWriter(path, metadata["general.architecture"].value)
    for key, value in metadata.items():
        if key != "general.architecture":  # the writer adds it
            writer.add_key_value(key, value.value, value.type, value.sub_type)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def set_key(key: str, value, value_type=T.UINT32, sub_type=None):
    def edit(metadata, tensors):
        metadata[key] = GGUFValue(value, value_type, sub_type)
    return edit


def drop_key(key: str):
    return lambda metadata, tensors: metadata.pop(key)


def drop_tensor(name: str):
    return lambda metadata, tensors: tensors.pop(name)


def rename_tensor(old: str, new: str):
    def edit(metadata, tensors):
        tensors[new] = tensors.pop(old)
    return edit


def no_tensors(metadata, tensors):
    tensors.clear()


# name: (spec, change, what the error must say)
BAD = {
    # the file's layout
    "alignment-0": ("qwen35", set_key("general.alignment", 0), "general.alignment is 0; it must be a power of two"),
    "alignment-48": ("qwen35", set_key("general.alignment", 48), "general.alignment is 48; it must be a power of two"),
    "zero-dimension": ("llama", lambda metadata, tensors: tensors.update({"output_norm.weight": (0,)}),
                       "corrupt tensor table: 'output_norm.weight' has shape [0]"),
    "nested-array": ("qwen35", set_key("general.nested", [[1, 2], [3]], T.ARRAY),
                     "metadata 'general.nested' is an array of arrays, which transformers' GGUF reader cannot read"),
    # sizes the tensors pin down
    "block-count-2**31": ("qwen35", set_key("qwen35.block_count", 2**31),
                          "qwen35.block_count is 2,147,483,648, but the file has tensors for blk.0 to blk.3"),
    "block-count-short": ("llama", set_key("llama.block_count", 1),
                          "llama.block_count is 1, but the file has tensors for blk.0 to blk.1"),
    "legacy-block-count": ("qwen3", set_key("qwen3.block_count", 3),
                           "qwen3.block_count is 3, but the file has tensors for blk.0 to blk.1"),
    "legacy-head-count-0": ("qwen3", set_key("qwen3.attention.head_count", 0),
                            "qwen3.attention.head_count is 0; it must be a positive integer"),
    "block-count-string": ("qwen35", set_key("qwen35.block_count", "4", T.STRING),
                           "qwen35.block_count is '4'; it must be a positive integer"),
    "embedding-length": ("qwen35", set_key("qwen35.embedding_length", 48),
                         "tensor 'token_embd.weight' has shape [32, 320], but qwen35.embedding_length (48), "
                         "the tokenizer's 320 tokens make it [48, 320]"),
    "feed-forward-length": ("llama", set_key("llama.feed_forward_length", 96),
                            "tensor 'blk.0.ffn_gate.weight' has shape [32, 64], but llama.embedding_length (32), "
                            "llama.feed_forward_length (96) make it [32, 96]"),
    "head-count": ("qwen35", set_key("qwen35.attention.head_count", 4), "tensor 'blk.3.attn_q.weight' has shape"),
    "head-count-0": ("qwen35", set_key("qwen35.attention.head_count", 0),
                     "qwen35.attention.head_count is 0; it must be a positive integer"),
    "head-count-kv-0": ("qwen35", set_key("qwen35.attention.head_count_kv", 0),
                        "qwen35.attention.head_count_kv is 0; it must be a positive integer"),
    "llama-head-count-kv-0": ("llama", set_key("llama.attention.head_count_kv", 0),
                              "llama.attention.head_count_kv is 0; it must be a positive integer"),
    "head-count-kv-not-divisor": ("llama", set_key("llama.attention.head_count_kv", 3),
                                  "llama hyperparameters disagree: llama.attention.head_count (4) must be a multiple "
                                  "of llama.attention.head_count_kv (3)"),
    "value-heads-not-multiple": ("qwen35", set_key("qwen35.ssm.group_count", 3),
                                 "qwen35.ssm.time_step_rank (2) must be a multiple of qwen35.ssm.group_count (3)"),
    "rope-sections": ("qwen35", set_key("qwen35.rope.dimension_sections", [2, 2, 1, 0], T.ARRAY, T.INT32),
                      "qwen35.rope.dimension_sections ([2, 2, 1, 0]) must add up to half qwen35.rope.dimension_count (8)"),
    "ssm-inner-size": ("qwen35", set_key("qwen35.ssm.inner_size", 64), "tensor 'blk.0.attn_qkv.weight' has shape"),
    "context-2**40": ("qwen35", set_key("qwen35.context_length", 2**40, T.UINT64),
                      "qwen35.context_length is 1,099,511,627,776, more than the 16,777,216 tokens we accept"),
    "expert-count": ("qwen35moe", set_key("qwen35moe.expert_count", 8),
                     "tensor 'blk.0.ffn_gate_inp.weight' has shape [32, 4], but qwen35moe.embedding_length (32), "
                     "qwen35moe.expert_count (8) make it [32, 8]"),
    "expert-count-0": ("qwen35moe", set_key("qwen35moe.expert_count", 0),
                       "qwen35moe.expert_count is 0; it must be a positive integer"),
    "experts-used-above-count": ("qwen35moe", set_key("qwen35moe.expert_used_count", 5),
                                 "qwen35moe.expert_used_count (5) must be at most qwen35moe.expert_count (4)"),
    "expert-feed-forward-length": ("qwen35moe", set_key("qwen35moe.expert_feed_forward_length", 16),
                                   "tensor 'blk.0.ffn_gate_exps.weight' has shape [32, 32, 4]"),
    # the vocabulary
    "vocab-size-0": ("llama", set_key("llama.vocab_size", 0), "llama.vocab_size is 0; it must be a positive integer"),
    "vocab-size": ("llama", set_key("llama.vocab_size", 128),
                   "tensor 'token_embd.weight' has shape [32, 64], but llama.embedding_length (32), "
                   "llama.vocab_size (128) make it [32, 128]"),
    "tokens-outnumber-vocab-size": ("llama", set_key("llama.vocab_size", 32),
                                    "the tokenizer's 64 tokens must not outnumber llama.vocab_size (32)"),
    "tokens-not-strings": ("qwen35", set_key("tokenizer.ggml.tokens", [1, 2, 3], T.ARRAY, T.INT32),
                           "tokenizer.ggml.tokens is empty or not a list of strings"),
    "bos-id-2**32-1": ("qwen35", set_key("tokenizer.ggml.bos_token_id", 2**32 - 1),
                       "tokenizer.ggml.bos_token_id is 4294967295, not a token of the 320-token vocabulary"),
    "eos-id-vocab": ("llama", set_key("tokenizer.ggml.eos_token_id", 64),
                     "tokenizer.ggml.eos_token_id is 64, not a token of the 64-token vocabulary"),
    "legacy-unk-id": ("qwen3", set_key("tokenizer.ggml.unknown_token_id", 64),
                      "tokenizer.ggml.unknown_token_id is 64, not a token of the 64-token vocabulary"),
    "pad-id-negative": ("qwen35", set_key("tokenizer.ggml.padding_token_id", -1, T.INT32),
                        "tokenizer.ggml.padding_token_id is -1, not a token of the 320-token vocabulary"),
    # numbers that must be finite and positive
    "rope-freq-base-nan": ("qwen35", set_key("qwen35.rope.freq_base", math.nan, T.FLOAT32),
                           "qwen35.rope.freq_base is nan; it must be a finite positive number"),
    "rope-freq-base-inf": ("llama", set_key("llama.rope.freq_base", math.inf, T.FLOAT32),
                           "llama.rope.freq_base is inf; it must be a finite positive number"),
    "rope-freq-base-0": ("qwen35moe", set_key("qwen35moe.rope.freq_base", 0.0, T.FLOAT32),
                         "qwen35moe.rope.freq_base is 0.0; it must be a finite positive number"),
    "rope-freq-base-negative": ("llama", set_key("llama.rope.freq_base", -1e4, T.FLOAT32),
                                "llama.rope.freq_base is -10000.0; it must be a finite positive number"),
    "legacy-rope-freq-base-nan": ("qwen3", set_key("qwen3.rope.freq_base", math.nan, T.FLOAT32),
                                  "qwen3.rope.freq_base is nan; it must be a finite positive number"),
    "rms-epsilon-0": ("qwen35", set_key("qwen35.attention.layer_norm_rms_epsilon", 0.0, T.FLOAT32),
                      "qwen35.attention.layer_norm_rms_epsilon is 0.0; it must be a finite positive number"),
    # text that is not UTF-8: transformers' config read called it "not a valid JSON file", its tokenizer
    # raised a bare UnicodeDecodeError
    "name-not-utf8": ("llama", set_key("general.name", b"caf\xe9", T.STRING),
                      "corrupt GGUF file: metadata 'general.name' is not valid UTF-8 (byte 0xe9 at position 3 of its "
                      "4 bytes b'caf\\xe9')"),
    "token-not-utf8": ("qwen3", set_key("tokenizer.ggml.tokens", ["t0", "t1", b"t\xff\xfe", *(f"t{i}" for i in range(3, 64))],
                                        T.ARRAY, T.STRING),
                       "metadata 'tokenizer.ggml.tokens' (item 2) is not valid UTF-8 (byte 0xff at position 1"),
    # keys a config needs
    "no-state-size": ("qwen35", drop_key("qwen35.ssm.state_size"),
                      "qwen35.ssm.state_size is missing; a qwen35 model's config needs it"),
    "no-rope-freq-base": ("qwen35moe", drop_key("qwen35moe.rope.freq_base"),
                          "qwen35moe.rope.freq_base is missing; a qwen35moe model's config needs it"),
    "no-embedding-length": ("llama", drop_key("llama.embedding_length"),
                            "llama.embedding_length is missing; a llama model's config needs it"),
    # tensors the model needs
    "no-tensors": ("qwen35", no_tensors, "the file has no tensors"),
    "no-token-embd": ("llama", drop_tensor("token_embd.weight"),
                      "the file has no tensor 'token_embd.weight', which a llama model needs"),
    "no-ffn-up": ("qwen35", drop_tensor("blk.1.ffn_up.weight"),
                  "the file has no tensor 'blk.1.ffn_up.weight', which a qwen35 model needs"),
    "renamed-ssm-a": ("qwen35", rename_tensor("blk.2.ssm_a", "blk.2.ssm_A"),
                      "the file has no tensor 'blk.2.ssm_a', which a qwen35 model needs (tensors it does not use: "
                      "blk.2.ssm_A)"),
    "no-q-norm": ("qwen35", drop_tensor("blk.3.attn_q_norm.weight"), "no tensor 'blk.3.attn_q_norm.weight'"),
    "no-shared-expert": ("qwen35moe", drop_tensor("blk.0.ffn_down_shexp.weight"),
                         "no tensor 'blk.0.ffn_down_shexp.weight', which a qwen35moe model needs"),
    "no-attn-norm": ("llama", drop_tensor("blk.1.attn_norm.weight"),
                     "no tensor 'blk.1.attn_norm.weight', which a llama model needs"),
    "output-shape": ("llama-untied", lambda metadata, tensors: tensors.update({"output.weight": (32, 32)}),
                     "tensor 'output.weight' has shape [32, 32], but llama.embedding_length (32), llama.vocab_size (64) "
                     "make it [32, 64]"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_passes(tmp_path, name):
    metadata, tensors = SPECS[name]()
    write(tmp_path / "model.gguf", metadata, tensors)
    summary = gk.check_gguf(tmp_path / "model.gguf")
    assert summary.architecture == name.split("-")[0]
    assert len(summary.tensors) == len(tensors)


@pytest.mark.parametrize("name", list(BAD))
def test_check_gguf_names_the_problem(tmp_path, name):
    spec, change, message = BAD[name]
    metadata, tensors = SPECS[spec]()
    change(metadata, tensors)
    path = tmp_path / "model.gguf"
    write(path, metadata, tensors)
    with pytest.raises(gk.GgufFileError) as error:
        gk.check_gguf(path)
    assert message in str(error.value)
    assert str(error.value).startswith(f"{path}: ")


def test_mtp_block_is_counted_but_not_required(tmp_path):
    """Qwen3.5 files count the multi-token-prediction block in block_count; transformers drops it."""
    metadata, tensors = SPECS["qwen35"]()
    metadata["qwen35.nextn_predict_layers"] = GGUFValue(1, T.UINT32)
    metadata["qwen35.block_count"] = GGUFValue(QWEN35.layers + 1, T.UINT32)
    tensors[f"blk.{QWEN35.layers}.nextn.eh_proj.weight"] = (QWEN35.hidden, 2 * QWEN35.hidden)
    write(tmp_path / "model.gguf", metadata, tensors)
    gk.check_gguf(tmp_path / "model.gguf")


def test_a_2d_shared_expert_gate_passes(tmp_path):
    """ggml pads shapes with ones: the shared expert's gate stored as (1, hidden) is the same tensor."""
    metadata, tensors = SPECS["qwen35moe"]()
    tensors["blk.0.ffn_gate_inp_shexp.weight"] = (1, QWEN35MOE.hidden)
    write(tmp_path / "model.gguf", metadata, tensors)
    gk.check_gguf(tmp_path / "model.gguf")


def test_a_file_without_tensors_may_end_where_its_header_does(tmp_path):
    """With no tensors there is no data section to align: a header cut from its padding is still
    read, and the file is refused for having no tensors."""
    metadata, tensors = SPECS["qwen35"]()
    no_tensors(metadata, tensors)
    path = tmp_path / "model.gguf"
    write(path, metadata, tensors)
    path.write_bytes(path.read_bytes()[:-1])  # the writer pads the header to the alignment
    with pytest.raises(gk.GgufFileError, match="the file has no tensors"):
        gk.check_gguf(path)

"""Bad GGUF files get one clear error naming the problem, before anything is built or loaded.

Each bad file is the tiny Qwen3.5 file with a few bytes changed, inserted or cut, so everything
else about it is valid (integration/tests/test_gguf_validation.py covers the metadata and tensor rules on files
written from a spec). `check_gguf` is tested directly; then, in a fresh process with `enable()`,
transformers' own `from_pretrained` / `AutoTokenizer` on the same files must raise the same
`GgufFileError` without having built a model, and leave no file descriptor open on the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ggml_kernels_integration as gk
import pytest

from tools.models import bpe_tokenizer, make_gguf
from tools.testing.kernel_testing import fresh_process


def _patch(data: bytearray, old: bytes, new: bytes) -> bytearray:
    assert len(old) == len(new) and data.count(old) == 1, old
    at = data.index(old)
    data[at : at + len(old)] = new
    return data


def _type_field(data: bytearray, tensor: str) -> int:
    """Where a tensor's ggml type id is in the tensor table (after its name and dims); its data
    offset (uint64) follows."""
    at = data.index(_string(tensor)) + 8 + len(tensor)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims


def _retype(data: bytearray, tensor: str, type_id: int) -> bytearray:
    struct.pack_into("<I", data, _type_field(data, tensor), type_id)
    return data


def _move(data: bytearray, tensor: str, offset) -> bytearray:
    """Set a tensor's data offset; `offset(offset_of)` may use other tensors' offsets."""
    offset_of = lambda name: struct.unpack_from("<Q", data, _type_field(data, name) + 4)[0]  # noqa: E731
    struct.pack_into("<Q", data, _type_field(data, tensor) + 4, offset(offset_of))
    return data


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def _set_key(data: bytearray, key: str, fmt: str, value, new_key: str | None = None) -> bytearray:
    """Overwrite a scalar metadata value (struct format `fmt`), and its key with one as long."""
    at = data.index(_string(key)) + 8 + len(key) + 4
    struct.pack_into(fmt, data, at, value)
    return _patch(data, _string(key), _string(new_key)) if new_key else data


def _insert_keys(data: bytearray, entries: bytes, count: int) -> bytearray:
    """Put `count` metadata entries (key, type, value) first, with a filler entry that makes the
    insertion a multiple of the 32-byte alignment, so that the tensor data stays where it was."""
    filler_key = "general.filler" + "_" * (-(len(entries) + 27) % 32)
    entries += _string(filler_key) + struct.pack("<IB", 0, 0)  # a uint8
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    struct.pack_into("<Q", data, 16, n_kv + count + 1)
    return data[:24] + entries + data[24:]


# a vocabulary entry of the tiny files (bpe_tokenizer's 2048 tokens), spelled once in them
TOKEN_ID = 1000
TOKEN = bpe_tokenizer.build_vocab(2048).tokens[TOKEN_ID]

# an array of arrays ... of an empty uint32 array, 2000 deep
DEEP_ARRAY = _string("general.nested") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 1999 + struct.pack("<IQ", 4, 0)
EMPTY_VOCABULARY = _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 0)


BAD_FILES = {
    # name: (how to damage the tiny file, what the error must say)
    "truncated-data": (lambda d: d[: len(d) * 2 // 3], "truncated GGUF file: tensor"),
    "truncated-header": (lambda d: d[:5000], "truncated GGUF file: it ends inside the header"),
    "not-gguf": (lambda d: bytearray(b"PK\x03\x04") + d[4:], "not a GGUF file"),
    "future-version": (lambda d: d[:4] + struct.pack("<I", 9) + d[8:], "GGUF version 9 is not supported"),
    "unsupported-arch": (
        lambda d: _patch(d, _string("general.architecture") + struct.pack("<I", 8) + _string("qwen35"),
                         _string("general.architecture") + struct.pack("<I", 8) + _string("mamba2")),
        "architecture 'mamba2' is not supported",
    ),
    "no-tokenizer": (
        lambda d: _patch(_patch(d, _string("tokenizer.ggml.model"), _string("tokenizer.ggml.mode_")),
                         _string("tokenizer.ggml.tokens"), _string("tokenizer.ggml.token_")),
        "has no tokenizer (missing tokenizer.ggml.model, tokenizer.ggml.tokens)",
    ),
    "unknown-type-id": (lambda d: _retype(d, "blk.0.attn_qkv.weight", 99), "'blk.0.attn_qkv.weight' has ggml type id 99"),
    # Q5_1 has Q8_0's block size per 32 values minus 10 bytes: the file stays in bounds, and transformers'
    # packed reader has no block table for it
    "type-transformers-cannot-read": (
        lambda d: _retype(d, "token_embd.weight", 7),  # Q8_0 (34 B / 32) -> Q5_1 (24 B / 32)
        "'token_embd.weight' is Q5_1, a ggml type transformers' GGUF reader cannot read",
    ),
    "tensor-past-the-end": (lambda d: _move(d, "output_norm.weight", lambda offset_of: 1 << 40),
                            "truncated GGUF file: tensor 'output_norm.weight' ends at byte"),
    "overlapping-tensors": (
        lambda d: _move(d, "blk.0.attn_norm.weight", lambda offset_of: offset_of("token_embd.weight")),
        "corrupt tensor table: the data of tensors 'blk.0.attn_norm.weight' and 'token_embd.weight' overlap",
    ),
    "misaligned-tensor": (
        lambda d: _move(d, "blk.0.attn_norm.weight", lambda offset_of: offset_of("blk.0.attn_norm.weight") + 4),
        "the data of tensor 'blk.0.attn_norm.weight' starts at offset",
    ),
    "tensor-listed-twice": (lambda d: _patch(d, _string("blk.3.attn_k.weight"), _string("blk.3.attn_v.weight")),
                            "tensor 'blk.3.attn_v.weight' is listed twice"),
    "key-twice": (
        lambda d: _patch(d, _string("qwen35.attention.key_length"), _string("qwen35.attention.head_count")),
        "metadata key 'qwen35.attention.head_count' appears twice",
    ),
    "nested-2000-deep": (lambda d: _insert_keys(d, DEEP_ARRAY, 1), "metadata 'general.nested' nests arrays more than"),
    # the adversarial probe's findings: each of these built a model (or failed inside transformers)
    "alignment-0": (lambda d: _set_key(d, "general.file_type", "<I", 0, new_key="general.alignment"),
                    "general.alignment is 0; it must be a power of two"),
    "block-count-2**31": (lambda d: _set_key(d, "qwen35.block_count", "<I", 2**31),
                          "qwen35.block_count is 2,147,483,648, but the file has tensors for blk.0 to blk.3"),
    "head-count-0": (lambda d: _set_key(d, "qwen35.attention.head_count", "<I", 0),
                     "qwen35.attention.head_count is 0; it must be a positive integer"),
    "empty-vocabulary": (
        lambda d: _insert_keys(_patch(d, _string("tokenizer.ggml.tokens"), _string("tokenizer.ggml.tokenz")),
                               EMPTY_VOCABULARY, 1),
        "tokenizer.ggml.tokens is empty",
    ),
    "bos-id-2**32-1": (lambda d: _set_key(d, "tokenizer.ggml.bos_token_id", "<I", 2**32 - 1),
                       "tokenizer.ggml.bos_token_id is 4294967295, not a token of the 2,048-token vocabulary"),
    "no-tensors": (lambda d: d[:8] + struct.pack("<Q", 0) + d[16:], "the file has no tensors"),
    "renamed-tensor": (lambda d: _patch(d, _string("blk.1.ffn_up.weight"), _string("blk.1.ffn_UP.weight")),
                       "the file has no tensor 'blk.1.ffn_up.weight', which a qwen35 model needs"),
    "rope-freq-base-nan": (lambda d: _set_key(d, "qwen35.rope.freq_base", "<f", float("nan")),
                           "qwen35.rope.freq_base is nan; it must be a finite positive number"),
    # text that is not UTF-8: from_pretrained said "not a valid JSON file", AutoTokenizer raised a bare
    # UnicodeDecodeError, the CLI named neither the file nor the key
    "value-not-utf8": (
        lambda d: _patch(d, _string("tokenizer.ggml.model") + struct.pack("<I", 8) + _string("gpt2"),
                         _string("tokenizer.ggml.model") + struct.pack("<I", 8) + struct.pack("<Q", 4) + b"gp\xff2"),
        "metadata 'tokenizer.ggml.model' is not valid UTF-8 (byte 0xff at position 2 of its 4 bytes b'gp\\xff2')",
    ),
    "token-not-utf8": (
        lambda d: _patch(d, _string(TOKEN), struct.pack("<Q", len(TOKEN)) + TOKEN.encode()[:-1] + b"\xfe"),
        f"metadata 'tokenizer.ggml.tokens' (item {TOKEN_ID:,}) is not valid UTF-8 (byte 0xfe",
    ),
    "key-not-utf8": (
        lambda d: _patch(d, _string("general.file_type"), struct.pack("<Q", 17) + b"general.file_typ\xe9"),
        "is not valid UTF-8 (byte 0xe9 at position 16 of its 17 bytes b'general.file_typ\\xe9')",
    ),
}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    good = make_gguf.ensure("qwen35-tiny", "Q4_K_M", log=lambda message: None)
    assert gk.check_gguf(good).architecture == "qwen35"
    folder = tmp_path_factory.mktemp("bad-gguf")
    out = {}
    for name, (damage, _) in BAD_FILES.items():
        path = folder / name / "model.gguf"
        path.parent.mkdir()
        path.write_bytes(bytes(damage(bytearray(good.read_bytes()))))
        out[name] = path
    return out


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_check_gguf_names_the_problem(bad_files, name):
    with pytest.raises(gk.GgufFileError) as error:
        gk.check_gguf(bad_files[name])
    assert BAD_FILES[name][1] in str(error.value)
    assert str(bad_files[name]) in str(error.value)  # and the file


def test_check_gguf_missing_file(tmp_path):
    with pytest.raises(gk.GgufFileError, match="no such GGUF file"):
        gk.check_gguf(tmp_path / "absent.gguf")


def test_good_files_pass():
    from tools.models import smollm2

    for path in (make_gguf.ensure("qwen35-tiny", "Q4_K_M"), make_gguf.ensure("qwen35moe-tiny", "Q4_K_M"),
                 smollm2.gguf_path()):
        summary = gk.check_gguf(path)
        assert summary.data_bytes <= summary.file_bytes
        assert summary.tensors


CODE = """
import json, os, sys
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
import ggml_kernels_integration as gk
gk.enable()
built = []
original_init = transformers.PreTrainedModel.__init__
def counting_init(self, *args, **kwargs):
    built.append(type(self).__name__)
    original_init(self, *args, **kwargs)
transformers.PreTrainedModel.__init__ = counting_init

def open_on(path):
    return [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(path)]

res = {}
for name, path in FILES.items():
    for what, load in (("model", AutoModelForCausalLM.from_pretrained), ("tokenizer", AutoTokenizer.from_pretrained)):
        try:
            load(os.path.dirname(path), gguf_file=os.path.basename(path))
            res[name + "/" + what] = {"error": None}
        except Exception as e:
            res[name + "/" + what] = {"error": type(e).__name__, "message": str(e), "built": list(built), "open": open_on(path)}
print("RESULT" + json.dumps(res))
"""


@pytest.mark.slow  # a fresh process
def test_transformers_load_fails_cleanly_after_enable(bad_files):
    files = {name: str(path) for name, path in bad_files.items()}
    proc = fresh_process(f"FILES = {files!r}\n" + CODE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[6:])
    for key, outcome in res.items():
        name = key.split("/")[0]
        assert outcome["error"] == "GgufFileError", (key, outcome)
        assert BAD_FILES[name][1] in outcome["message"], (key, outcome)
        assert outcome["built"] == [], (key, outcome)  # failed before a model was constructed
        assert outcome["open"] == [], (key, outcome)


@pytest.mark.parametrize("model", [None, "x", "linear"])
def test_summary_of_something_else_than_a_model_is_a_type_error(model):
    import torch

    model = torch.nn.Linear(2, 2) if model == "linear" else model
    with pytest.raises(TypeError, match=r"summary\(\) takes a transformers model \(an nn.Module with a .config"):
        gk.summary(model)


AFTER_DISABLE = """
import json, torch
import ggml_kernels_integration as gk
from transformers import AutoModelForCausalLM
from transformers.integrations.gguf import kernels as gguf_kernels
from tools.models import make_gguf

gguf_kernels._gguf_kernel = False  # a lookup before enable() found no kernel, as transformers alone on the CPU

def logits(model):  # the last logits of a 12-token prompt (a prefill), of a 6-token one (mat-vecs, as decode)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 1000, 12, 64, 9, 300]])
    with torch.inference_mode():
        return model(ids).logits[0, -1], model(ids[:, :6]).logits[0, -1]

gk.enable()
models, before = {}, {}
for name in ("qwen35-tiny", "qwen35moe-tiny"):
    path = make_gguf.ensure(name, "Q4_K_M")
    models[name] = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    before[name] = logits(models[name])
gk.disable()
res = {"lookup_restored": gguf_kernels._gguf_kernel is False}
for name, model in models.items():
    prefill, step = logits(model)  # transformers' own forwards: its dequantize for the prefill, the kernel's mat-vec
    ref_prefill, ref_step = before[name]
    res[name] = {"finite": bool(torch.isfinite(prefill).all() and torch.isfinite(step).all()),
                 "prefill_rel": ((prefill - ref_prefill).abs().max() / ref_prefill.abs().max()).item(),
                 "step_rel": ((step - ref_step).abs().max() / ref_step.abs().max()).item(),
                 "own_forwards": sum("forward" in m.__dict__ for m in model.modules() if type(m).__name__.startswith("Gguf"))}
gk.enable()  # the patched classes again: the forwards kept for disable() are taken off
for name, model in models.items():
    res[name]["after_enable"] = sum("forward" in m.__dict__ for m in model.modules() if type(m).__name__.startswith("Gguf"))
    res[name]["again_rel"] = ((logits(model)[1] - before[name][1]).abs().max() / before[name][1].abs().max()).item()
gk.disable()
print("RESULT" + json.dumps(res))
"""


@pytest.mark.slow  # a fresh process, two models
def test_a_model_loaded_while_enabled_runs_after_disable():
    """disable() puts transformers' kernel lookup back (here: "no kernel", False); a model loaded packed
    while enabled failed on its first forward ('bool' object has no attribute 'mul_mat_vec'). Its packed
    modules (GgufLinear: mat-vec; GgufExperts: mul_mat_id) now run transformers' own forwards on the
    ggml-quantization build they were loaded with: mat-vec products (up to 8 rows, as a decode step) give
    the logits they gave while enabled, a prefill (transformers' own dequantize-and-matmul, float
    activations instead of ggml's 8-bit ones) close ones."""
    proc = fresh_process(AFTER_DISABLE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[6:])
    assert res.pop("lookup_restored")
    for name, outcome in res.items():
        assert outcome["finite"] and outcome["own_forwards"] > 0 and outcome["after_enable"] == 0, (name, outcome)
        assert outcome["step_rel"] < 1e-5 and outcome["again_rel"] < 1e-5, (name, outcome)
        assert outcome["prefill_rel"] < 1e-1, (name, outcome)  # 3.5-3.7e-2 measured on these random tiny models

"""Bad GGUF files get one clear error naming the problem, before anything is built or loaded.

Each bad file is the tiny Qwen3.5 file with a few bytes changed (or cut short), so everything else
about it is valid. `check_gguf` is tested directly; then, in a fresh process with `enable()`,
transformers' own `from_pretrained` / `AutoTokenizer` on the same files must raise the same
`GgufFileError` without having built a model, and leave no file descriptor open on the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ggml_kernels_integration as gk
from tools.models import make_gguf
import pytest
from tools.testing.kernel_testing import fresh_process


def _patch(data: bytearray, old: bytes, new: bytes) -> bytearray:
    assert len(old) == len(new) and data.count(old) == 1, old
    at = data.index(old)
    data[at : at + len(old)] = new
    return data


def _retype(data: bytearray, tensor: str, type_id: int) -> bytearray:
    """Set a tensor's ggml type id in the tensor table (the bytes after its name and dims)."""
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    return data


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


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

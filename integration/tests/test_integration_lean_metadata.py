"""The compact metadata read of `ggml_kernels_integration.lean_metadata`: transformers'
`load_gguf_checkpoint(..., return_tensors=False)` returns exactly what it returns with gguf-py's own
reader (config, tokenizer and tokenizer_config), on the real SmolLM2 file (a 49k-token vocabulary
and merges, float scores, int token types; transformers reads Qwen3.5 configs with its own newer
reader, which never comes here); other uses of gguf-py's reader are untouched."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_kernels_integration import lean_metadata
from ggml_kernels_integration.patching import PatchSet

from tools.models import smollm2


@pytest.fixture(scope="module")
def loaders():
    """(transformers' load_gguf_checkpoint with gguf-py's own parts, the installed one). Installs as
    enable() does and restores both patches afterwards."""
    from gguf import GGUFReader
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original_load, original_parts = gguf_utils.load_gguf_checkpoint, GGUFReader._get_field_parts
    patches = PatchSet()
    lean_metadata.install(patches)
    assert gguf_utils.load_gguf_checkpoint is not original_load
    yield original_load, gguf_utils.load_gguf_checkpoint
    patches.restore()
    assert (gguf_utils.load_gguf_checkpoint, GGUFReader._get_field_parts) == (original_load, original_parts)


@pytest.mark.slow  # reads the real SmolLM2 file's metadata twice
def test_same_config_and_tokenizer_as_gguf_py_parts(loaders):
    original, lean = loaders
    path = str(smollm2.gguf_path())
    want = original(path, return_tensors=False)
    got = lean(path, return_tensors=False)
    assert set(got) == set(want)
    for part in ("config", "tokenizer", "tokenizer_config"):
        assert got[part] == want[part], part
    # the long arrays were there to be read compactly (and the config's vocab_size comes from them)
    assert len(got["tokenizer"]["tokens"]) == 49152 and len(got["tokenizer"]["merges"]) == 48900
    assert got["config"]["vocab_size"] == 49152


@pytest.mark.slow
def test_compact_parts_only_inside_a_config_read(loaders):
    """Outside the wrapped call (another caller of GGUFReader, or another thread) the reader makes
    gguf-py's own memory-mapped parts; inside, string elements are bytes."""
    from gguf import GGUFReader

    path = str(smollm2.gguf_path())
    field = GGUFReader(path).fields["tokenizer.ggml.tokens"]
    assert isinstance(field.parts[field.data[0]], np.memmap)
    lean_metadata._local.active = True
    try:
        compact = GGUFReader(path).fields["tokenizer.ggml.tokens"]
    finally:
        lean_metadata._local.active = False
    assert isinstance(compact.parts[compact.data[0]], bytes)
    assert compact.data == field.data and len(compact.parts) == len(field.parts)
    assert [bytes(compact.parts[i]) for i in compact.data[:100]] == [bytes(field.parts[i]) for i in field.data[:100]]

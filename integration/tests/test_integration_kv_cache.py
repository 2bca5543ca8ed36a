"""The in-place growing key/value cache (`ggml_kernels_integration.kv_cache`) against transformers'
own `torch.cat` cache: same keys and values after every operation transformers performs on a
`DynamicLayer` (prefill, decode steps, crop, beam reordering, batch selection and repetition, reset),
and growth without a copy per step."""

from __future__ import annotations

import pytest
import torch
from ggml_kernels_integration import kv_cache
from ggml_kernels_integration.patching import PatchSet


@pytest.fixture(scope="module", params=["kv_write", "torch"])
def layers(request):
    """(transformers' DynamicLayer.update, ours). Installs ours as enable() does, with ggml-attn's
    `kv_write` op for decode appends or (as without that build) torch's narrow + copy_ only, and
    puts transformers' back afterwards, so later tests comparing against stock transformers really
    run transformers' own cache."""
    from transformers.cache_utils import DynamicLayer

    from tools.testing.kernel_testing import load_kernel

    write = None
    if request.param == "kv_write":
        write = load_kernel("ggml-org/ggml-attn").ops.kv_write.default
    original = DynamicLayer.update
    patches = PatchSet()
    kv_cache.install(patches, write)
    ours = DynamicLayer.update
    assert ours is not original  # the test compares two different implementations
    yield original, ours
    patches.restore()
    assert DynamicLayer.update is original


def _pair():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer(), DynamicLayer()


def _step(reference, ours, original, patched, k, v):
    want = original(reference, k, v)
    got = patched(ours, k, v)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert ours.get_seq_length() == reference.get_seq_length()


def _kv(batch, tokens, heads=2, dim=8):
    return torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim)


def test_prefill_then_decode_matches_cat_and_reuses_the_buffer(layers):
    original, patched = layers
    reference, ours = _pair()
    _step(reference, ours, original, patched, *_kv(2, 5))
    buffer = ours.keys.data_ptr()
    for _ in range(40):
        _step(reference, ours, original, patched, *_kv(2, 1))
    assert ours.keys.data_ptr() == buffer  # 45 positions fit the first buffer: no reallocation
    assert not ours.keys.is_contiguous()  # a view of the first seq_len positions
    # transposed new rows, as a model's k/v projections give them (head stride != rows * dim)
    k, v = (t.view(2, 1, 2, 8).transpose(1, 2) for t in _kv(2, 1))
    _step(reference, ours, original, patched, k, v)
    assert ours.keys.data_ptr() == buffer


def test_decode_append_writes_only_its_rows(layers):
    """What a decode append writes lands in its own rows: the rest of the buffer, spare rows
    included, is untouched (checked through the buffer itself)."""
    original, patched = layers
    reference, ours = _pair()
    _step(reference, ours, original, patched, *_kv(1, 4))
    buffer = ours.__dict__[kv_cache._BUFFERS]["keys"].tensor
    buffer[:, :, 4:].fill_(7.0)
    k, v = _kv(1, 1)
    _step(reference, ours, original, patched, k, v)
    assert ours.__dict__[kv_cache._BUFFERS]["keys"].tensor is buffer
    torch.testing.assert_close(buffer[:, :, 4:5], k, rtol=0, atol=0)
    assert bool((buffer[:, :, 5:] == 7.0).all())


def test_growth_past_the_capacity(layers):
    original, patched = layers
    reference, ours = _pair()
    _step(reference, ours, original, patched, *_kv(1, 3))
    for _ in range(kv_cache.MIN_SPARE_POSITIONS + 10):
        _step(reference, ours, original, patched, *_kv(1, 1))
    _step(reference, ours, original, patched, *_kv(1, 700))  # a long chunk at once


def test_crop_then_update_overwrites_the_cropped_positions(layers):
    original, patched = layers
    reference, ours = _pair()
    _step(reference, ours, original, patched, *_kv(1, 10))
    reference.crop(-4)
    ours.crop(-4)
    _step(reference, ours, original, patched, *_kv(1, 3))
    _step(reference, ours, original, patched, *_kv(1, 1))


def test_reorder_select_repeat_and_reset(layers):
    original, patched = layers
    reference, ours = _pair()
    _step(reference, ours, original, patched, *_kv(3, 6))
    beams = torch.tensor([2, 0, 0])
    reference.reorder_cache(beams)
    ours.reorder_cache(beams)
    _step(reference, ours, original, patched, *_kv(3, 1))
    keep = torch.tensor([0, 2])
    reference.batch_select_indices(keep)
    ours.batch_select_indices(keep)
    _step(reference, ours, original, patched, *_kv(2, 1))
    reference.batch_repeat_interleave(2)
    ours.batch_repeat_interleave(2)
    _step(reference, ours, original, patched, *_kv(4, 2))
    reference.reset()
    ours.reset()
    assert ours.get_seq_length() == 0
    _step(reference, ours, original, patched, *_kv(1, 4))


def test_other_devices_keep_torch_cat(layers):
    original, patched = layers
    reference, ours = _pair()
    k, v = _kv(1, 2)
    k, v = k.to("meta"), v.to("meta")
    got = patched(ours, k, v)
    assert got[0].device.type == "meta" and got[0].shape == (1, 2, 2, 8)
    assert "_ggml_kernels_kv_buffers" not in ours.__dict__

"""Bad input: clear exceptions naming the problem, never a crash."""

from __future__ import annotations

import pytest
import torch


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def test_mismatched_heads(ga):
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        ga.flash_attn(t(1, 6, 2, 64), t(1, 4, 3, 64), t(1, 4, 3, 64))
    with pytest.raises(ValueError, match="must have the same heads and length"):
        ga.flash_attn(t(1, 4, 2, 64), t(1, 2, 3, 64), t(1, 2, 5, 64))


def test_head_dim(ga):
    with pytest.raises(ValueError, match="query head dim 64 != key head dim 32"):
        ga.flash_attn(t(1, 2, 2, 64), t(1, 2, 3, 32), t(1, 2, 3, 32))
    with pytest.raises(ValueError, match="head dim 2048/2048 is not supported"):
        ga.flash_attn(t(1, 1, 1, 2048), t(1, 1, 1, 2048), t(1, 1, 1, 2048))


def test_dtype_mismatch(ga):
    with pytest.raises(TypeError, match="query, key and value must share one dtype"):
        ga.flash_attn(t(1, 2, 2, 64), t(1, 2, 3, 64, dtype=torch.bfloat16), t(1, 2, 3, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="query must have dtype"):
        ga.flash_attn(t(1, 2, 2, 64).double(), t(1, 2, 3, 64).double(), t(1, 2, 3, 64).double())


def test_wrong_dims_and_batch(ga):
    with pytest.raises(ValueError, match="query must be 4-D"):
        ga.flash_attn(t(2, 2, 64), t(1, 2, 3, 64), t(1, 2, 3, 64))
    with pytest.raises(ValueError, match="batch sizes differ"):
        ga.flash_attn(t(2, 2, 2, 64), t(1, 2, 3, 64), t(1, 2, 3, 64))


def test_bad_mask(ga):
    q, k, v = t(2, 4, 3, 64), t(2, 2, 5, 64), t(2, 2, 5, 64)
    with pytest.raises(ValueError, match="does not broadcast to"):
        ga.flash_attn(q, k, v, mask=torch.ones(2, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast to"):
        ga.flash_attn(q, k, v, mask=torch.ones(2, 3, 3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must have dtype"):
        ga.flash_attn(q, k, v, mask=torch.ones(3, 5, dtype=torch.int32))


def test_bad_sinks_and_softcap(ga):
    q, k, v = t(1, 4, 3, 64), t(1, 2, 5, 64), t(1, 2, 5, 64)
    with pytest.raises(ValueError, match="sinks must hold one value per query head"):
        ga.flash_attn(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="softcap finite and >= 0"):
        ga.flash_attn(q, k, v, softcap=-1.0)


def test_device_mismatch(ga):
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        ga.flash_attn(t(1, 2, 2, 64), t(1, 2, 3, 64).to("meta"), t(1, 2, 3, 64))


def test_dropout_in_training_is_refused(ga):
    m = torch.nn.Module().train()
    with pytest.raises(ValueError, match="dropout is not supported"):
        ga.flash_attn_forward(m, t(1, 2, 2, 64), t(1, 2, 3, 64), t(1, 2, 3, 64), None, dropout=0.1)


def test_kv_write_bad_input(ga):
    keys, values = torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8)
    k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    with pytest.raises(IndexError, match=r"rows \[10, 11\) of k do not fit in the 10 rows of keys"):
        ga.kv_write(keys, values, k, v, 10)
    with pytest.raises(IndexError, match="do not fit"):
        ga.kv_write(keys, values, k, v, -1)
    with pytest.raises(TypeError, match="v has dtype Half but values holds Float"):
        ga.kv_write(keys, values, k, v.half(), 0)
    with pytest.raises(ValueError, match="all dims but the rows must match"):
        ga.kv_write(keys, values, torch.randn(1, 3, 1, 8), v, 0)
    with pytest.raises(ValueError, match="same number of dims"):
        ga.kv_write(keys, values, k[0], v, 0)
    with pytest.raises(ValueError, match="last dim must be dense"):
        ga.kv_write(torch.zeros(1, 2, 10, 16)[..., ::2], values, k, v, 0)
    assert not keys.any() and not values.any()  # nothing written by a refused call

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

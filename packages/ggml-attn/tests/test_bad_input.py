"""Bad input: clear exceptions naming the problem, never a crash. Tests taking `build` run on each
build kind of the package (conftest.py: cpu, metal-emu, mps-emu): the checks are shared, the words
the same; those taking `ga` the CPU build alone."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import assert_fake_refuses_as_cpu, on_meta, run_fresh


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def test_mismatched_heads(build):
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        build.flash_attn(t(1, 6, 2, 64), t(1, 4, 3, 64), t(1, 4, 3, 64))
    with pytest.raises(ValueError, match="must have the same heads and length"):
        build.flash_attn(t(1, 4, 2, 64), t(1, 2, 3, 64), t(1, 2, 5, 64))


def test_head_dim(build):
    with pytest.raises(ValueError, match="query head dim 64 != key head dim 32"):
        build.flash_attn(t(1, 2, 2, 64), t(1, 2, 3, 32), t(1, 2, 3, 32))
    with pytest.raises(ValueError, match="head dim 2048/2048 is not supported"):
        build.flash_attn(t(1, 1, 1, 2048), t(1, 1, 1, 2048), t(1, 1, 1, 2048))


def test_dtype_mismatch(build):
    with pytest.raises(TypeError, match="query, key and value must share one dtype"):
        build.flash_attn(t(1, 2, 2, 64), t(1, 2, 3, 64, dtype=torch.bfloat16), t(1, 2, 3, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="query must have dtype"):
        build.flash_attn(t(1, 2, 2, 64).double(), t(1, 2, 3, 64).double(), t(1, 2, 3, 64).double())


def test_wrong_dims_and_batch(build):
    with pytest.raises(ValueError, match="query must be 4-D"):
        build.flash_attn(t(2, 2, 64), t(1, 2, 3, 64), t(1, 2, 3, 64))
    with pytest.raises(ValueError, match="batch sizes differ"):
        build.flash_attn(t(2, 2, 2, 64), t(1, 2, 3, 64), t(1, 2, 3, 64))


def test_bad_mask(build):
    q, k, v = t(2, 4, 3, 64), t(2, 2, 5, 64), t(2, 2, 5, 64)
    with pytest.raises(ValueError, match="does not broadcast to"):
        build.flash_attn(q, k, v, mask=torch.ones(2, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast to"):
        build.flash_attn(q, k, v, mask=torch.ones(2, 3, 3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must have dtype"):
        build.flash_attn(q, k, v, mask=torch.ones(3, 5, dtype=torch.int32))


def test_bad_sinks_and_softcap(build):
    q, k, v = t(1, 4, 3, 64), t(1, 2, 5, 64), t(1, 2, 5, 64)
    with pytest.raises(ValueError, match="sinks must hold one value per query head"):
        build.flash_attn(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="softcap finite and >= 0"):
        build.flash_attn(q, k, v, softcap=-1.0)
    # finite doubles that ggml's float32 holds as inf
    for kwargs in ({"scale": 1e300}, {"softcap": 1e300}, {"scale": -1e39}):
        with pytest.raises(ValueError, match=r"within float32's range \(magnitude at most 3.40282e\+38"):
            build.flash_attn(q, k, v, **kwargs)


def test_device_mismatch(build):
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        build.flash_attn(t(1, 2, 2, 64), t(1, 2, 3, 64).to("meta"), t(1, 2, 3, 64))


def test_dropout_in_training_is_refused(build):
    m = torch.nn.Module().train()
    with pytest.raises(ValueError, match="dropout is not supported"):
        build.flash_attn_forward(m, t(1, 2, 2, 64), t(1, 2, 3, 64), t(1, 2, 3, 64), None, dropout=0.1)


def test_kv_write_bad_input(build):
    keys, values = torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8)
    k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    with pytest.raises(IndexError, match=r"position 10 \+ 1 rows of k do not fit in the 10 rows of keys"):
        build.kv_write(keys, values, k, v, 10)
    with pytest.raises(IndexError, match="do not fit"):
        build.kv_write(keys, values, k, v, -1)
    with pytest.raises(TypeError, match="v has dtype Half but values holds Float"):
        build.kv_write(keys, values, k, v.half(), 0)
    with pytest.raises(ValueError, match="all dims but the rows must match"):
        build.kv_write(keys, values, torch.randn(1, 3, 1, 8), v, 0)
    with pytest.raises(ValueError, match="same number of dims"):
        build.kv_write(keys, values, k[0], v, 0)
    with pytest.raises(ValueError, match="last dim must be dense"):
        build.kv_write(torch.zeros(1, 2, 10, 16)[..., ::2], values, k, v, 0)
    assert not keys.any() and not values.any()  # nothing written by a refused call


# ---- findings of the adversarial probe (2026-12-01) ----
# Snippets that crashed the process run in a fresh one (run_fresh), so a regression fails the test
# instead of taking pytest down.

REPO_ID = "ggml-org/ggml-attn"


def test_kv_write_position_near_int64_max(ga):  # a fresh process loads the CPU build by its Hub id
    """position + rows overflowed past the bound check and the copy wrote before the buffer."""
    res = run_fresh(REPO_ID, """
        import torch
        kb, vb, x = torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64), torch.ones(1, 2, 1, 64)
        res = {}
        for position in (2**63 - 1, 2**63 - 8, 2**62, -(2**63)):
            try:
                k.kv_write(kb, vb, x, x, position)
                res[str(position)] = "written"
            except IndexError as e:
                res[str(position)] = str(e).splitlines()[0]
        res["touched"] = bool(kb.any() or vb.any())
    """)
    assert res.pop("touched") is False
    for position, message in res.items():
        assert message == f"position {position} + 1 rows of k do not fit in the 8 rows of keys"
    meta = on_meta(torch.zeros(1, 2, 8, 64)), on_meta(torch.ones(1, 2, 1, 64))
    with pytest.raises(IndexError, match=r"position 9223372036854775807 \+ 1 rows of k do not fit in the 8 rows of keys"):
        ga.kv_write(meta[0], meta[0], meta[1], meta[1], 2**63 - 1)  # the fake (meta) implementation


def test_kv_write_into_an_expanded_cache(build):
    """A stride-0 cache (expand) would get both heads written to one place; torch's in-place ops
    refuse such a tensor, and so does kv_write, before writing anything."""
    keys = torch.zeros(1, 1, 8, 4).expand(1, 2, 8, 4)
    values = torch.zeros(1, 2, 8, 4)
    k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="keys is written in place but several of its elements share one memory location"):
        build.kv_write(keys, values, k, v, 0)
    with pytest.raises(RuntimeError, match="values is written in place but several"):
        build.kv_write(values.clone(), torch.zeros(1, 2, 1, 4).expand(1, 2, 8, 4), k, v, 0)  # one row for all
    assert not keys.any() and not values.any()


def test_kv_write_input_overlapping_its_rows(build):
    """k read from the rows it is written to, shifted by one, would copy an overwritten row (torch's
    copy_ refuses the same overlap); k at exactly its own rows is a no-op, as for copy_."""
    keys, values = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    before = keys.clone()
    with pytest.raises(RuntimeError, match="k shares memory with the rows of keys written"):
        build.kv_write(keys, values, keys[:, :, 0:2], values[:, :, 5:7], 1)
    with pytest.raises(RuntimeError, match="v shares memory with the rows of values written"):
        build.kv_write(keys, values, torch.randn(1, 1, 3, 4), values[:, :, 2:5], 3)
    assert torch.equal(keys, before)
    v_before = values[:, :, 5:7].clone()
    build.kv_write(keys, values, keys[:, :, 1:3], values[:, :, 5:7], 1)  # same rows: nothing changes
    build.kv_write(keys, values, keys[:, :, 1:3], values[:, :, 5:7].clone(), 3)  # apart in memory: a plain copy
    assert torch.equal(keys[:, :, 3:5], before[:, :, 1:3]) and torch.equal(values[:, :, 3:5], v_before)


# ---- the fake (meta) implementations refuse what the CPU op refuses, with the same words ----


FLASH_ATTN_REFUSED = {  # overrides of a good call: q (1, 4, 3, 64), k / v (1, 2, 5, 64)
    "float64": dict(q=t(1, 4, 3, 64).double(), k=t(1, 2, 5, 64).double(), v=t(1, 2, 5, 64).double()),
    "mixed dtypes": dict(k=t(1, 2, 5, 64, dtype=torch.bfloat16)),
    "3-D query": dict(q=t(4, 3, 64)),
    "batch": dict(q=t(2, 4, 3, 64)),
    "value heads": dict(v=t(1, 1, 5, 64)),
    "value length": dict(v=t(1, 2, 6, 64)),
    "heads not a multiple": dict(q=t(1, 3, 3, 64)),
    "no key heads": dict(k=t(1, 0, 5, 64), v=t(1, 0, 5, 64)),
    "key head dim": dict(k=t(1, 2, 5, 32)),
    "head dim too big": dict(q=t(1, 4, 3, 2048), k=t(1, 2, 5, 2048), v=t(1, 2, 5, 2048)),
    "empty value dim": dict(v=t(1, 2, 5, 0)),
    "negative softcap": dict(softcap=-1.0),
    "infinite scale": dict(scale=float("inf")),
    "scale 1e300 (float32: inf)": dict(scale=1e300),
    "softcap 1e300 (float32: inf)": dict(softcap=1e300),
    "sinks per KV head": dict(sinks=torch.zeros(2)),
    "integer sinks": dict(sinks=torch.zeros(4, dtype=torch.int32)),
    "1-D mask": dict(mask=torch.ones(5, dtype=torch.bool)),
    "5-D mask": dict(mask=torch.ones(1, 1, 1, 3, 5, dtype=torch.bool)),
    "mask keys": dict(mask=torch.ones(3, 4, dtype=torch.bool)),
    "mask queries": dict(mask=torch.ones(1, 2, 5, dtype=torch.bool)),
    "mask heads": dict(mask=torch.ones(1, 2, 3, 5, dtype=torch.bool)),
    "mask batch": dict(mask=torch.ones(2, 1, 3, 5)),
    "integer mask": dict(mask=torch.ones(3, 5, dtype=torch.int32)),
}


@pytest.mark.parametrize("case", FLASH_ATTN_REFUSED)
def test_fake_flash_attn_refuses_as_the_cpu_op(build, case):
    a = dict(q=t(1, 4, 3, 64), k=t(1, 2, 5, 64), v=t(1, 2, 5, 64), mask=None, scale=None, causal=False, softcap=None,
             sinks=None)
    a.update(FLASH_ATTN_REFUSED[case])
    assert_fake_refuses_as_cpu(build.flash_attn, *a.values())


KV_WRITE_REFUSED = {  # overrides of a good call: keys / values (1, 2, 10, 8), k / v (1, 2, 1, 8), position 3
    "dtype": dict(v=t(1, 2, 1, 8, dtype=torch.float16)),
    "dims": dict(k=t(2, 1, 8)),
    "heads": dict(k=t(1, 3, 1, 8)),
    "row size": dict(v=t(1, 2, 1, 4)),
    "past the end": dict(position=10),
    "negative": dict(position=-1),
    "too many rows": dict(k=t(1, 2, 11, 8), v=t(1, 2, 11, 8), position=0),
    "strided rows": dict(keys=torch.zeros(1, 2, 10, 16)[..., ::2]),
}


@pytest.mark.parametrize("case", KV_WRITE_REFUSED)
def test_fake_kv_write_refuses_as_the_cpu_op(build, case):
    a = dict(keys=torch.zeros(1, 2, 10, 8), values=torch.zeros(1, 2, 10, 8), k=t(1, 2, 1, 8), v=t(1, 2, 1, 8), position=3)
    a.update(KV_WRITE_REFUSED[case])
    assert_fake_refuses_as_cpu(build.kv_write, *a.values())


ROTARY_REFUSED = {  # overrides of a good call: q (1, 4, 3, 16), k (1, 2, 3, 16), cos / sin (1, 3, 16)
    "float64 cos": dict(cos=t(1, 3, 16).double()),
    "2-D sin": dict(sin=t(3, 16)),
    "cos and sin differ": dict(sin=t(1, 3, 8)),
    "odd head dim": dict(q=t(1, 4, 3, 15), k=t(1, 2, 3, 15), cos=t(1, 3, 15), sin=t(1, 3, 15)),
    "q tokens": dict(q=t(1, 4, 2, 16)),
    "3-D k": dict(k=t(2, 3, 16)),
    "bf16 q": dict(q=t(1, 4, 3, 16, dtype=torch.bfloat16)),
    "strided q": dict(q=t(1, 4, 3, 32)[..., ::2]),
    "batch": dict(k=t(2, 2, 3, 16), cos=t(2, 3, 16), sin=t(2, 3, 16)),
}


@pytest.mark.parametrize("case", ROTARY_REFUSED)
def test_fake_rotary_half_refuses_as_the_cpu_op(build, case):
    a = dict(q=t(1, 4, 3, 16), k=t(1, 2, 3, 16), cos=t(1, 3, 16), sin=t(1, 3, 16))
    a.update(ROTARY_REFUSED[case])
    assert_fake_refuses_as_cpu(build.ops.rotary_half, *a.values())


def test_fake_accepts_what_the_cpu_op_accepts(build):
    """The checks refuse nothing the CPU op runs: the existing good calls, traced on meta tensors."""
    q, k, v = on_meta(t(2, 4, 3, 64)), on_meta(t(2, 2, 5, 64)), on_meta(t(2, 2, 5, 64))
    for mask in (None, torch.ones(3, 5, dtype=torch.bool), torch.ones(2, 3, 5), torch.ones(2, 4, 3, 5, dtype=torch.half)):
        out = build.flash_attn(q, k, v, mask=on_meta(mask), sinks=on_meta(torch.zeros(4)), softcap=30.0)
        assert out.shape == (2, 4, 3, 64) and out.is_meta
    build.kv_write(on_meta(torch.zeros(1, 2, 10, 8)), on_meta(torch.zeros(1, 2, 10, 8)), on_meta(t(1, 2, 0, 8)),
                on_meta(t(1, 2, 0, 8)), 10)
    build.ops.rotary_half(on_meta(t(1, 4, 3, 16)), on_meta(t(1, 2, 3, 16)), on_meta(t(1, 3, 16)), on_meta(t(1, 3, 16)))

"""`apply_rotary` (the `rotary_pos_emb` function kernel) against transformers' own
`apply_rotary_pos_emb`: the same float32 values bit for bit (each product rounded, then the sum, as
transformers' torch ops do), the fallback for other dtypes and layouts, the layer kernelize uses, and
clear errors from the op for inputs it cannot take. On every build kind (conftest.py's `build`): the
Metal builds' element-wise kernels round as the CPU loop does."""

from __future__ import annotations

import pytest
import torch


def _transformers_rotary():
    """transformers' own apply_rotary_pos_emb, even if something in this process kernelized it:
    kernels turns the function into a module and kernelize replaces that instance's forward, so the
    class's forward is transformers' code. Never our layer (that would compare the kernel with itself)."""
    import functools

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cls_forward = getattr(type(apply_rotary_pos_emb), "forward", None)
    fn = functools.partial(cls_forward, apply_rotary_pos_emb) if cls_forward is not None else apply_rotary_pos_emb
    target = cls_forward or apply_rotary_pos_emb
    assert "RotaryPosEmb" not in getattr(target, "__qualname__", ""), target
    return fn


def _inputs(b, hq, hk, t, d, table_batch=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g).to(dtype).transpose(1, 2)  # the layout LlamaAttention passes
    k = torch.randn(b, t, hk, d, generator=g).to(dtype).transpose(1, 2)
    cos = torch.randn(table_batch, t, d, generator=g).to(dtype)
    sin = torch.randn(table_batch, t, d, generator=g).to(dtype)
    return q, k, cos, sin


@pytest.mark.parametrize(
    "shape", [(1, 9, 3, 1, 64), (2, 4, 2, 7, 128), (1, 2, 1, 5, 6), (3, 8, 8, 33, 256)], ids=str
)
@pytest.mark.parametrize("table_batch", ["one", "per_batch"])
def test_matches_transformers_bit_for_bit(build, shape, table_batch):
    b = shape[0]
    q, k, cos, sin = _inputs(*shape, table_batch=1 if table_batch == "one" else b)
    want = _transformers_rotary()(q, k, cos, sin)
    got = build.apply_rotary(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_contiguous_inputs_and_the_op_directly(build):
    q, k, cos, sin = (t.contiguous() for t in _inputs(1, 4, 2, 3, 16))
    want = _transformers_rotary()(q, k, cos, sin)
    got = build.ops.rotary_half(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_other_dtypes_fall_back_to_the_reference(build, dtype):
    q, k, cos, sin = _inputs(1, 4, 2, 3, 16, dtype=dtype)
    want = _transformers_rotary()(q, k, cos, sin)
    got = build.apply_rotary(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_unsqueeze_dim_2_falls_back(build):
    q, k, cos, sin = _inputs(1, 4, 2, 3, 16)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, T, H, D), tables unsqueezed at dim 2
    want = _transformers_rotary()(q, k, cos, sin, unsqueeze_dim=2)
    got = build.apply_rotary(q, k, cos, sin, unsqueeze_dim=2)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_layer_is_what_kernelize_installs(build):
    q, k, cos, sin = _inputs(1, 4, 2, 3, 16)
    layer = build.layers.RotaryPosEmb()
    want = _transformers_rotary()(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(layer(q, k, cos, sin), want, strict=True))
    assert build.layers.RotaryPosEmb.has_backward is False


def test_bad_input(build):
    q, k, cos, sin = _inputs(1, 4, 2, 3, 16)
    with pytest.raises(ValueError, match="even"):
        build.ops.rotary_half(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="does not match cos"):
        build.ops.rotary_half(q[:, :, :2], k, cos, sin)
    with pytest.raises(ValueError, match="one shape"):
        build.ops.rotary_half(q, k, cos, sin[:, :2])
    with pytest.raises(TypeError, match="dtype"):
        build.ops.rotary_half(q.double(), k, cos, sin)
    with pytest.raises(ValueError, match="batch"):
        build.ops.rotary_half(q, torch.cat([k, k]), cos, sin)

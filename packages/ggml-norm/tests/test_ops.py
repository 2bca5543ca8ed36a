"""ggml-norm's CPU kernels against the pure-PyTorch reference (reference.py).

Tolerances, in units in the last place (ulps) of the output dtype:
- Both sides compute the same float32 formula, in the same order of products; they differ only in
  the row's scale 1/sqrt(mean(x^2) + eps): ggml sums the squares in double, torch in float32 with
  a different order, and ggml takes 1.0f/sqrtf where torch takes rsqrt. That moves float32 results
  by at most a few ulps (F32_ULPS = 4, ~5e-7 relative; measured max 3 over 10^6 values).
- The gate's silu is ggml's own vectorised expf against torch's (Sleef): a few float32 ulps more
  (F32_GATED_ULPS = 8, ~1e-6 relative; measured max 7).
- bf16/f16 outputs are the float32 result rounded once, so they are equal, or one ulp apart where
  the float32 value sits within ~1e-6 of a rounding tie: LOW_ULPS = 1.
- With a bias the float32 sum norm * w + b can cancel, and its few-ulp error is relative to the
  terms, not the sum: atol = 1e-6 * max|ref| on top (~8 float32 ulps of the largest term).
- Where the formula rounds an intermediate to a coarser dtype (cast_before_weight, the gated
  norm's transformers rounding), that rounding can flip by one ulp of the intermediate's dtype near
  a tie (~1e-4 of the values): that moves the result by up to one ulp of the intermediate's dtype
  (2^-7 relative for bf16, 2^-10 for f16) and the final rounding by up to one more:
  rtol = 2 ulps of that dtype, relative (FLIP_RTOL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

F32_ULPS = 4
F32_GATED_ULPS = 8
LOW_ULPS = 1
ULP_REL = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def flip_rtol(dtype: torch.dtype) -> float:
    """FLIP_RTOL for an intermediate rounded to dtype (none for float32)."""
    return 0.0 if dtype == torch.float32 else 2 * ULP_REL[dtype]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HIDDEN = [1, 7, 1000, 2560]
LEAD = [(1,), (3, 5), (2, 7, 11)]
DT_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def ulps_for(dtype: torch.dtype, gated: bool = False) -> int:
    if dtype == torch.float32:
        return F32_GATED_ULPS if gated else F32_ULPS
    return LOW_ULPS


def make(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def bias_atol(ref: torch.Tensor) -> float:
    return 1e-6 * ref.double().abs().max().item()


def test_runtime_info(gn):
    info = gn.info()
    from tools.testing.kernel_testing import CPU_LEVELS

    assert info["cpu_variant"] in CPU_LEVELS
    assert info["ggml"].startswith("0.25.3")


# ---------------------------------------------------------------------------------------------
# rms_norm

RMS_VARIANTS = ["plain", "weight", "zero_centered", "bias", "zero_centered_bias", "cast_before_weight"]


def rms_kwargs(variant: str, n: int, dtype: torch.dtype) -> dict:
    w = make((n,), dtype, seed=1, scale=1.0)
    b = make((n,), dtype, seed=2, scale=1.0)
    return {
        "plain": {},
        "weight": {"weight": w},
        "zero_centered": {"weight": w, "zero_centered": True},
        "bias": {"weight": w, "bias": b},
        "zero_centered_bias": {"weight": w, "zero_centered": True, "bias": b},
        "cast_before_weight": {"weight": w, "cast_before_weight": True},
    }[variant]


@pytest.mark.parametrize("variant", RMS_VARIANTS)
@pytest.mark.parametrize("lead", LEAD, ids=str)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_rms_norm_matches_reference(gn, assert_ulps, dtype, n, lead, variant):
    x = make((*lead, n), dtype)
    kw = rms_kwargs(variant, n, dtype)
    out = gn.rms_norm(x, eps=1e-6, **kw)
    ref = gn.reference.rms_norm(x, eps=1e-6, **kw)
    assert out.dtype == dtype and out.shape == x.shape
    atol = bias_atol(ref) if "bias" in kw else 0.0
    rtol = flip_rtol(dtype) if variant == "cast_before_weight" else 0.0
    assert_ulps(out, ref, ulps_for(dtype), atol=atol, rtol=rtol)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-5, 0.1, 10.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_rms_norm_eps(gn, assert_ulps, dtype, eps):
    x = make((4, 33), dtype, scale=0.5)
    w = make((33,), dtype, seed=1)
    out = gn.rms_norm(x, w, eps=eps, zero_centered=True)
    assert_ulps(out, gn.reference.rms_norm(x, w, eps=eps, zero_centered=True), ulps_for(dtype))


@pytest.mark.parametrize("x_dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("w_dtype", DTYPES, ids=DT_IDS.get)
def test_rms_norm_mixed_weight_dtype(gn, assert_ulps, x_dtype, w_dtype):
    """The weight may have another dtype than x. Default rounding: output in x's dtype.
    cast_before_weight (Llama's): output in promote_types(x, weight), like `weight * y.to(x.dtype)`."""
    x = make((5, 96), x_dtype)
    w = make((96,), w_dtype, seed=1, scale=1.0)
    out = gn.rms_norm(x, w, zero_centered=True)
    assert out.dtype == x_dtype
    assert_ulps(out, gn.reference.rms_norm(x, w, zero_centered=True), ulps_for(x_dtype))
    out = gn.rms_norm(x, w, cast_before_weight=True)
    ref = gn.reference.rms_norm(x, w, cast_before_weight=True)
    assert out.dtype == torch.promote_types(x_dtype, w_dtype) == ref.dtype
    assert_ulps(out, ref, ulps_for(out.dtype), rtol=flip_rtol(x_dtype))


def test_rms_norm_against_plain_torch(gn):
    """The reference itself: plain formulas, written out once more."""
    x = make((3, 64), torch.float32)
    w = make((64,), torch.float32, seed=1)
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(gn.rms_norm(x), x / rms, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gn.rms_norm(x, w, zero_centered=True), x / rms * (1 + w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gn.rms_norm(x, w, bias=w), x / rms * w + w, rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# rms_norm_gated


@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf_rounding", "f32"])
@pytest.mark.parametrize("lead", LEAD, ids=str)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_rms_norm_gated_matches_reference(gn, assert_ulps, dtype, n, lead, cast_before_weight):
    x = make((*lead, n), dtype)
    z = make((*lead, n), dtype, seed=3)
    w = make((n,), dtype, seed=1, scale=1.0)
    out = gn.rms_norm_gated(x, z, w, eps=1e-6, cast_before_weight=cast_before_weight)
    ref = gn.reference.rms_norm_gated(x, z, w, eps=1e-6, cast_before_weight=cast_before_weight)
    assert out.dtype == dtype and out.shape == x.shape
    rtol = flip_rtol(dtype) if cast_before_weight else 0.0
    assert_ulps(out, ref, ulps_for(dtype, gated=True), rtol=rtol)


@pytest.mark.parametrize("w_dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("z_dtype", DTYPES, ids=DT_IDS.get)
def test_rms_norm_gated_mixed_dtypes(gn, assert_ulps, w_dtype, z_dtype):
    x = make((6, 128), torch.bfloat16)
    z = make((6, 128), z_dtype, seed=3)
    w = make((128,), w_dtype, seed=1)
    out = gn.rms_norm_gated(x, z, w)
    assert out.dtype == torch.bfloat16
    assert_ulps(out, gn.reference.rms_norm_gated(x, z, w), LOW_ULPS, rtol=flip_rtol(torch.bfloat16))


def test_rms_norm_gated_float32_roundings_agree(gn):
    """For float32 x and weight there is nothing to round: both modes are the same computation."""
    x, z, w = make((7, 200), torch.float32), make((7, 200), torch.float32, seed=3), make((200,), torch.float32, seed=1)
    torch.testing.assert_close(gn.rms_norm_gated(x, z, w), gn.rms_norm_gated(x, z, w, cast_before_weight=False), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# l2_norm


@pytest.mark.parametrize("mode", ["clamp", "rsqrt"])
@pytest.mark.parametrize("lead", LEAD, ids=str)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_l2_norm_matches_reference(gn, assert_ulps, dtype, n, lead, mode):
    x = make((*lead, n), dtype)
    out = gn.l2_norm(x, eps=1e-6, mode=mode)
    ref = gn.reference.l2_norm(x, eps=1e-6, mode=mode)
    assert out.dtype == dtype and out.shape == x.shape
    assert_ulps(out, ref, ulps_for(dtype))


@pytest.mark.parametrize("eps", [1e-12, 1e-6, 1e-3])
def test_l2_norm_clamp_is_torch_normalize(gn, assert_ulps, eps):
    """mode="clamp" is F.normalize's formula x / max(||x||, eps) (ggml multiplies by the inverse,
    torch divides: an ulp or two), including vectors shorter than eps."""
    x = make((9, 128), torch.float32)
    x[0] *= 1e-9  # ||x|| < eps for the larger eps
    x[1] = 0.0
    assert_ulps(gn.l2_norm(x, eps=eps), F.normalize(x, dim=-1, eps=eps), F32_ULPS)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("mode", ["clamp", "rsqrt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_l2_norm_nan_and_inf_rows_are_torch_normalize(gn, dtype, mode):
    """A row holding NaN has a NaN norm, so F.normalize (and the reference) make all of it NaN;
    ggml's l2_norm clamps that NaN norm to eps (fmaxf drops NaN) and scaled the row's other values by
    1 / eps ([1, 2, nan, 3] -> [1e6, 2e6, nan, 3e6]): the op matches the reference. A row holding
    inf but no NaN is NaN at the inf and 0 elsewhere in both. Rows many enough for several slices."""
    x = make((3000, 4), torch.float32)
    x[:6] = torch.tensor([[1, 2, NAN, 3], [0, 0, NAN, 0], [1, INF, 2, 0], [NAN, INF, 1, 1], [-INF, INF, 0, 1], [1, 2, 2, 4]])
    x[1234, 3] = x[2999, 0] = NAN
    xt = x.to(dtype)
    out = gn.l2_norm(xt, eps=1e-6, mode=mode)
    ref = gn.reference.l2_norm(xt, eps=1e-6, mode=mode)
    if mode == "clamp":
        torch.testing.assert_close(ref, F.normalize(xt.float(), dim=-1, eps=1e-6).to(dtype), equal_nan=True)
    assert torch.equal(out.isnan(), ref.isnan()), out[:6]
    assert out[[0, 1, 3, 1234, 2999]].isnan().all()
    torch.testing.assert_close(out[~ref.isnan()], ref[~ref.isnan()], rtol=ULP_REL[dtype] * 4, atol=0)
    # a non-contiguous x takes the same path
    torch.testing.assert_close(gn.l2_norm(xt.t().contiguous().t(), 1e-6, mode), out, rtol=0, atol=0, equal_nan=True)


def test_l2_norm_rsqrt_is_transformers_l2norm(gn, assert_ulps):
    """mode="rsqrt" is transformers' (FLA's) l2norm of Qwen3.5's gated delta net."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

    x = make((2, 5, 16, 128), torch.float32)
    x[0, 0, 0] *= 1e-4  # short vector: eps inside the sqrt matters
    assert_ulps(gn.l2_norm(x, eps=1e-6, mode="rsqrt"), l2norm(x, dim=-1, eps=1e-6), F32_ULPS)


def test_l2_norm_modes_differ_for_short_vectors(gn):
    """The documented difference: for ||x||^2 >> eps both agree to ~eps / (2 ||x||^2); around
    ||x|| ~ sqrt(eps) "rsqrt" shrinks the vector while "clamp" still returns a unit vector."""
    x = make((3, 64), torch.float32)
    x = x / x.norm(dim=-1, keepdim=True)
    x[1] *= 1e-3  # ||x|| = sqrt(eps): rsqrt gives 1/sqrt(2)
    x[2] *= 1e-7  # ||x|| < eps: clamp gives ||x|| / eps
    c, r = gn.l2_norm(x, 1e-6, "clamp").norm(dim=-1), gn.l2_norm(x, 1e-6, "rsqrt").norm(dim=-1)
    torch.testing.assert_close(c, torch.tensor([1.0, 1.0, 0.1]), rtol=1e-5, atol=0)
    torch.testing.assert_close(r, torch.tensor([1.0, 2**-0.5, 1e-4]), rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# layouts, threads, empty inputs


def test_non_contiguous_inputs(gn, assert_ulps):
    """Strided rows are read in place; a strided last dim is copied first. Same values either way."""
    base = make((12, 2 * 300), torch.bfloat16)
    x = base[:, ::2]  # strided last dim
    rows = base[::3, :300]  # strided rows, dense last dim
    xt = make((300, 12), torch.bfloat16).t()  # transposed
    w = make((600,), torch.float32, seed=1)[::2]  # strided weight
    for t in (x, rows, xt):
        out = gn.rms_norm(t, w, zero_centered=True)
        assert out.is_contiguous()
        torch.testing.assert_close(out, gn.rms_norm(t.contiguous(), w.contiguous(), zero_centered=True), rtol=0, atol=0)
        torch.testing.assert_close(gn.l2_norm(t), gn.l2_norm(t.contiguous()), rtol=0, atol=0)
        z = make((t.shape[0], 2 * t.shape[1]), torch.float32, seed=4)[:, ::2]  # a strided gate too
        torch.testing.assert_close(gn.rms_norm_gated(t, z, w), gn.rms_norm_gated(t.contiguous(), z.contiguous(), w.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_threads_split_rows_identically(gn, dtype):
    """Prefill-sized inputs are split over torch's threads; every row is computed by the same code
    whatever the split, so the result is bit-identical to a single-threaded run."""
    x = make((513, 2560), dtype)
    z = make((513, 2560), dtype, seed=3)
    w = make((2560,), dtype, seed=1)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [gn.rms_norm(x, w, zero_centered=True), gn.rms_norm_gated(x, z, w), gn.l2_norm(x, mode="rsqrt")]
        torch.set_num_threads(max(2, prev))
        many = [gn.rms_norm(x, w, zero_centered=True), gn.rms_norm_gated(x, z, w), gn.l2_norm(x, mode="rsqrt")]
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16), (4, 0)], ids=str)
def test_empty_inputs(gn, shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    w = torch.ones(shape[-1])
    for out in (gn.rms_norm(x, w, zero_centered=True), gn.rms_norm_gated(x, x, w), gn.l2_norm(x)):
        assert out.shape == x.shape and out.dtype == x.dtype


def test_one_dim_input(gn, assert_ulps):
    x = make((2560,), torch.float32)
    assert_ulps(gn.rms_norm(x), gn.reference.rms_norm(x), F32_ULPS)


# ---------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_fullgraph(gn):
    """The fake implementations let dynamo trace every op without a graph break."""
    torch._dynamo.reset()

    def f(x, z, w, b):
        y = gn.rms_norm(x, w, eps=1e-6, zero_centered=True)
        y = y + gn.rms_norm(x, w, bias=b)
        y = y + gn.rms_norm(x, w, cast_before_weight=True)
        y = y + gn.rms_norm_gated(x, z, w)
        return y + gn.l2_norm(x, mode="rsqrt") + gn.l2_norm(x)

    x, z = make((2, 3, 64), torch.bfloat16), make((2, 3, 64), torch.bfloat16, seed=3)
    w, b = make((64,), torch.bfloat16, seed=1), make((64,), torch.bfloat16, seed=2)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, z, w, b), f(x, z, w, b), rtol=0, atol=0)
    x2, z2 = make((5, 64), torch.bfloat16), make((5, 64), torch.bfloat16, seed=3)
    torch.testing.assert_close(compiled(x2, z2, w, b), f(x2, z2, w, b), rtol=0, atol=0)


def test_torch_compile_inductor(gn):
    torch._dynamo.reset()
    x, w = make((4, 256), torch.float32), make((256,), torch.float32, seed=1)
    compiled = torch.compile(lambda x, w: gn.rms_norm(x, w, zero_centered=True) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x, w), gn.rms_norm(x, w, zero_centered=True) * 2, rtol=0, atol=0)

"""The package's ops (ggml's CPU kernels) against the per-token-loop reference (reference.py) run in
float64 as ground truth, and against transformers' own torch functions.

Tolerances:
- float32 (GDN_TOL = 2e-5 of the output's scale): ggml accumulates in float32 (eps 6e-8). Each
  token's output and each state update is a D-term dot product (D <= 128: ~sqrt(D) * eps relative
  for random signs). With ||k|| = 1 and beta in (0, 1) the delta rule contracts (I - beta k k^T
  has norm <= 1) and exp(g) <= 1 decays, so earlier rounding is damped instead of amplified over T.
  Observed: < 4e-7 up to T = 300; 2e-5 leaves a 50x margin, and is far below any semantic slip
  (a wrong head mapping, scale or state transpose moves outputs by O(1)).
- bfloat16 / float16 inputs: both sides upcast the same values; only the final rounding of the
  output to the input dtype differs, at most half an ulp: 2^-8 (bf16) / 2^-11 (f16) of each value,
  plus the float32 term. States and gates are float32 on both sides: GDN_TOL.
- conv, l2_norm, gates, gated_rms_norm: a handful of float32 operations per output: CONV_TOL = 1e-6
  relative (4-term sums, SiLU; observed ~1e-7).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from tools.testing.kernel_testing import run_fresh

GDN_TOL = 2e-5
CONV_TOL = 1e-6
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_close_scaled(out: torch.Tensor, ref: torch.Tensor, tol: float, rounding: float = 0.0) -> None:
    """|out - ref| <= rounding * |ref| + tol * max|ref|, elementwise."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape
    scale = ref.abs().max().item() or 1.0
    err = (out - ref).abs()
    bound = rounding * ref.abs() + tol * scale
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max error {err.max().item():.3e} (scale {scale:.3e}), {worst:.2f}x the bound"


def make_gdn_inputs(b, t, hk, hv, d, dtype, with_state, l2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, d, generator=gen)
    k = torch.randn(b, t, hk, d, generator=gen)
    if not l2:  # unit-norm keys keep the delta rule stable, as the model's L2 normalisation does
        q, k = q / d**0.5, torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(b, t, hv, d, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen) * 0.5  # decays exp(g) in (0.6, 1]
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, d, d, generator=gen) * 0.3 if with_state else None
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, state


def as64(*ts):
    return [t.double() if t is not None else None for t in ts]


# ---------------------------------------------------------------------------------------------
# gated_delta_net


@pytest.mark.parametrize("t", [1, 7, 64, 300])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_net_vs_reference_f32(gdn, t, d, hk, hv, with_state):
    l2 = (t + d) % 2 == 1 or t == 64  # both settings across the grid
    inputs = make_gdn_inputs(2, t, hk, hv, d, torch.float32, with_state, l2, seed=t * d + hv)
    out, state = gdn.gated_delta_net(*inputs, l2_normalize_qk=l2)
    ref_out, ref_state = gdn.reference.gated_delta_net(*as64(*inputs), l2_normalize_qk=l2)
    assert out.dtype == torch.float32 and state.dtype == torch.float32
    assert_close_scaled(out, ref_out, GDN_TOL)
    assert_close_scaled(state, ref_state, GDN_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 2)])
def test_gated_delta_net_vs_reference_half(gdn, dtype, t, hk, hv):
    inputs = make_gdn_inputs(1, t, hk, hv, 64, dtype, True, True, seed=t)
    out, state = gdn.gated_delta_net(*inputs, l2_normalize_qk=True)
    ref_out, ref_state = gdn.reference.gated_delta_net(*as64(*inputs), l2_normalize_qk=True)
    assert out.dtype == dtype and state.dtype == torch.float32
    assert_close_scaled(out, ref_out, GDN_TOL, ROUNDING[dtype])
    assert_close_scaled(state, ref_state, GDN_TOL)


def test_gated_delta_net_bf16_300_tokens_128(gdn):
    inputs = make_gdn_inputs(1, 300, 2, 4, 128, torch.bfloat16, True, True, seed=3)
    out, state = gdn.gated_delta_net(*inputs, l2_normalize_qk=True)
    ref_out, ref_state = gdn.reference.gated_delta_net(*as64(*inputs), l2_normalize_qk=True)
    assert_close_scaled(out, ref_out, GDN_TOL, ROUNDING[torch.bfloat16])
    assert_close_scaled(state, ref_state, GDN_TOL)


@pytest.mark.parametrize("scale", [None, 0.5, 1.0])
def test_gated_delta_net_scale(gdn, scale):
    inputs = make_gdn_inputs(1, 9, 2, 2, 32, torch.float32, True, True)
    out, state = gdn.gated_delta_net(*inputs, l2_normalize_qk=True, scale=scale)
    ref_out, ref_state = gdn.reference.gated_delta_net(*as64(*inputs), l2_normalize_qk=True, scale=scale)
    assert_close_scaled(out, ref_out, GDN_TOL)
    assert_close_scaled(state, ref_state, GDN_TOL)


def test_gated_delta_net_scale_without_l2_normalisation():
    """Any scale but the default without l2_normalize_qk scaled a strided view of q, which ggml's
    scale refuses (GGML_ASSERT(ggml_is_padded_1d(a)): the process aborted). In a fresh process; the
    issue's call, the in-place op and q as a view into a packed tensor, against the reference."""
    res = run_fresh("ggml-org/ggml-gated-delta-net", """
        import torch
        torch.manual_seed(0)
        q, kk, v = torch.randn(1, 3, 2, 32), torch.randn(1, 3, 2, 32), torch.randn(1, 3, 4, 32)
        g, beta, state = -torch.rand(1, 3, 4), torch.rand(1, 3, 4), torch.randn(1, 4, 32, 32) * 0.1
        packed = torch.randn(1, 3, 8 * 32)
        qp, kp, vp = torch.split(packed, [2 * 32, 2 * 32, 4 * 32], dim=-1)
        qp, kp, vp = qp.reshape(1, 3, 2, 32), kp.reshape(1, 3, 2, 32), vp.reshape(1, 3, 4, 32)

        def err(out, ref):
            return float((out.double() - ref).abs().max() / ref.abs().max())

        res = {}
        for scale in (0.3, 1.0, 2.5):
            for name, args in (("issue", (q, kk, v)), ("packed", (qp, kp, vp))):
                out, new_state = k.gated_delta_net(*args, g, beta, state, scale=scale)
                ref, ref_state = k.reference.gated_delta_net(*(x.double() for x in (*args, g, beta, state)), scale=scale)
                res[f"{name} {scale}"] = max(err(out, ref), err(new_state, ref_state))
            in_place = new_state.clone()  # ggml's layout, as gated_delta_net_ needs
            in_place.copy_(state)
            out = k.gated_delta_net_(qp, kp, vp, g, beta, in_place, scale=scale)
            ref, ref_state = k.reference.gated_delta_net(*(x.double() for x in (qp, kp, vp, g, beta, state)), scale=scale)
            res[f"in place {scale}"] = max(err(out, ref), err(in_place, ref_state))
    """)
    assert len(res) == 9
    assert max(res.values()) < GDN_TOL, res


def test_gated_delta_net_strided_inputs(gdn):
    """q, k, v as views into one packed (B, T, conv_dim) tensor, as the layer passes them."""
    b, t, hk, hv, d = 2, 5, 2, 4, 64
    packed = torch.randn(b, t, (2 * hk + hv) * d)
    q, k, v = torch.split(packed, [hk * d, hk * d, hv * d], dim=-1)
    q, k, v = (x.reshape(b, t, -1, d) for x in (q, k, v))
    g, beta = -torch.rand(b, t, hv), torch.rand(b, t, hv)
    out, state = gdn.gated_delta_net(q, k, v, g, beta, l2_normalize_qk=True)
    ref_out, ref_state = gdn.reference.gated_delta_net(*as64(q.contiguous(), k.contiguous(), v.contiguous(), g, beta), l2_normalize_qk=True)
    assert_close_scaled(out, ref_out, GDN_TOL)
    assert_close_scaled(state, ref_state, GDN_TOL)


def test_gated_delta_net_state_layouts(gdn):
    """The final state comes back in ggml's memory layout (a transposed view); a state in either
    layout gives bit-identical results (one is used as is, the other transposed on the way in)."""
    q, k, v, g, beta, state = make_gdn_inputs(2, 3, 2, 4, 64, torch.float32, True, True)
    out1, s1 = gdn.gated_delta_net(q, k, v, g, beta, state, l2_normalize_qk=True)
    assert s1.shape == (2, 4, 64, 64) and s1.transpose(-1, -2).is_contiguous()
    ggml_layout = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    out2, s2 = gdn.gated_delta_net(q, k, v, g, beta, ggml_layout, l2_normalize_qk=True)
    strided = torch.randn(2, 4, 64, 128)[..., ::2].copy_(state)  # neither layout
    out3, s3 = gdn.gated_delta_net(q, k, v, g, beta, strided, l2_normalize_qk=True)
    for a, b in ((out1, out2), (s1, s2), (out1, out3), (s1, s3)):
        assert torch.equal(a, b)
    # torch.zeros_like keeps the layout: transformers' cache stores the state this way
    assert torch.zeros_like(s1).stride() == s1.stride()


@pytest.mark.parametrize("t", [1, 5])
def test_gated_delta_net_in_place(gdn, t):
    """gated_delta_net_ writes exactly gated_delta_net's final state over its state argument (same
    tensor, same strides) and returns the same output, bit for bit."""
    q, k, v, g, beta, state = make_gdn_inputs(2, t, 2, 4, 64, torch.float32, True, True)
    out, new_state = gdn.gated_delta_net(q, k, v, g, beta, state, l2_normalize_qk=True)
    cache = torch.zeros_like(new_state).copy_(state)  # as transformers' cache holds it: ggml's layout
    ptr, strides = cache.data_ptr(), cache.stride()
    out2 = gdn.gated_delta_net_(q, k, v, g, beta, cache, l2_normalize_qk=True)
    assert torch.equal(out2, out) and torch.equal(cache, new_state)
    assert cache.data_ptr() == ptr and cache.stride() == strides
    # and both are right: the float64 per-token reference
    ref_out, ref_state = gdn.reference.gated_delta_net(*as64(q, k, v, g, beta, state), l2_normalize_qk=True)
    assert_close_scaled(out2, ref_out, GDN_TOL)
    assert_close_scaled(cache, ref_state, GDN_TOL)


def test_gated_delta_net_in_place_needs_ggml_layout(gdn):
    q, k, v, g, beta, state = make_gdn_inputs(1, 1, 2, 2, 32, torch.float32, True, True)
    before = state.clone()
    with pytest.raises(ValueError, match="in ggml's layout"):
        gdn.gated_delta_net_(q, k, v, g, beta, state, l2_normalize_qk=True)
    assert torch.equal(state, before)  # refused before touching it


def test_gated_delta_net_prefill_then_decode_equals_one_pass(gdn):
    """Splitting a sequence and carrying the state gives the one-pass result."""
    q, k, v, g, beta, state = make_gdn_inputs(1, 20, 2, 4, 64, torch.float32, True, True)
    full, full_state = gdn.gated_delta_net(q, k, v, g, beta, state, l2_normalize_qk=True)
    out, s = gdn.gated_delta_net(q[:, :13], k[:, :13], v[:, :13], g[:, :13], beta[:, :13], state, l2_normalize_qk=True)
    outs = [out]
    for i in range(13, 20):
        o, s = gdn.gated_delta_net(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], g[:, i : i + 1], beta[:, i : i + 1], s, l2_normalize_qk=True)
        outs.append(o)
    assert_close_scaled(torch.cat(outs, 1), full, GDN_TOL)
    assert_close_scaled(s, full_state, GDN_TOL)


@pytest.mark.parametrize("t", [1, 37])
def test_gated_delta_net_matches_transformers_functions(gdn, t):
    """Same semantics as transformers' torch paths (GQA by repeat_interleave, q scaled by
    Dk^-0.5 after L2 normalisation, state (B, Hv, Dk, Dv))."""
    hk, hv = 2, 4
    q, k, v, g, beta, state = make_gdn_inputs(2, t, hk, hv, 64, torch.float32, True, True, seed=7)
    out, new_state = gdn.gated_delta_net(q, k, v, g, beta, state, l2_normalize_qk=True)
    qi, ki = q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2)
    for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        ref_out, ref_state = fn(qi, ki, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close_scaled(out, ref_out, 1e-4)  # transformers' own float32 chunked algebra differs by ~1e-6
        assert_close_scaled(new_state, ref_state, 1e-4)


def test_gated_delta_net_threads_agree(gdn):
    inputs = make_gdn_inputs(2, 33, 4, 8, 64, torch.float32, True, True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gdn.gated_delta_net(*inputs, l2_normalize_qk=True)
        torch.set_num_threads(max(2, before))
        many = gdn.gated_delta_net(*inputs, l2_normalize_qk=True)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, many, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same per-head code either way


def test_gated_delta_net_does_not_touch_inputs(gdn):
    inputs = make_gdn_inputs(1, 4, 2, 2, 32, torch.float32, True, True)
    copies = [x.clone() for x in inputs]
    gdn.gated_delta_net(*inputs, l2_normalize_qk=True)
    for a, b in zip(inputs, copies, strict=True):
        assert torch.equal(a, b)


def test_gated_delta_net_empty(gdn):
    q, k, v, g, beta, state = make_gdn_inputs(1, 3, 2, 2, 32, torch.float32, True, True)
    out, s = gdn.gated_delta_net(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], state)
    assert out.shape == (1, 0, 2, 32) and torch.equal(s, state)
    out, s = gdn.gated_delta_net(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0])
    assert torch.equal(s, torch.zeros_like(state))


# ---------------------------------------------------------------------------------------------
# causal_conv1d


@pytest.mark.parametrize("t", [1, 3, 7, 64, 300])
@pytest.mark.parametrize("state_width", [None, 3, 4, 6])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_vs_reference(gdn, t, state_width, activation):
    gen = torch.Generator().manual_seed(t * 10 + (state_width or 0))
    b, c, kernel = 2, 80, 4
    x = torch.randn(b, c, t, generator=gen)
    w = torch.randn(c, 1, kernel, generator=gen)
    state = torch.randn(b, c, state_width, generator=gen) if state_width else None
    y, new_state = gdn.causal_conv1d(x, w, state, activation)
    ref_y, ref_state = gdn.reference.causal_conv1d(*as64(x, w, state), activation)
    assert y.shape == (b, c, t) and y.dtype == torch.float32
    assert new_state.shape == (b, c, state_width or kernel)
    assert_close_scaled(y, ref_y, CONV_TOL)
    torch.testing.assert_close(new_state.double(), ref_state, rtol=0, atol=0)  # a copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_conv1d_half_with_bias_2d_weight(gdn, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 48, 11, generator=gen).to(dtype)
    w = torch.randn(48, 4, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen)
    state = torch.randn(1, 48, 4, generator=gen).to(dtype)
    y, new_state = gdn.causal_conv1d(x, w, state, "silu", bias=bias)
    ref_y, ref_state = gdn.reference.causal_conv1d(*as64(x, w, state), "silu", bias=bias.double())
    assert y.dtype == dtype and new_state.dtype == dtype
    assert_close_scaled(y, ref_y, CONV_TOL, ROUNDING[dtype])
    assert torch.equal(new_state, ref_state.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_many_channels(gdn, dtype):
    """Enough channels and tokens for several blocks per thread (blocks of ~256 KB of input)."""
    gen = torch.Generator().manual_seed(2)
    b, c, t = 2, 2000, 130
    x = torch.randn(b, t, c, generator=gen).to(dtype).transpose(1, 2)  # channels dense, as in the layer
    w = torch.randn(c, 1, 4, generator=gen)
    bias = torch.randn(c, generator=gen)
    state = torch.randn(b, c, 4, generator=gen).to(dtype)
    y, new_state = gdn.causal_conv1d(x, w, state, "silu", bias=bias)
    ref_y, ref_state = gdn.reference.causal_conv1d(*as64(x, w, state), "silu", bias=bias.double())
    assert_close_scaled(y, ref_y, CONV_TOL, ROUNDING[dtype])
    assert torch.equal(new_state, ref_state.to(dtype))



@pytest.mark.parametrize("t,state_width", [(1, 4), (1, 6), (3, 4), (3, 6), (5, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_in_place(gdn, t, state_width, dtype):
    """causal_conv1d_ returns causal_conv1d's y and leaves its new state in the caller's tensor
    (same storage, same strides): rolled and convolved in place for a decode step on a K-wide
    float32 state, computed and copied back otherwise."""
    gen = torch.Generator().manual_seed(t * 7 + state_width)
    c, k = 40, 4
    x = torch.randn(2, t, c, generator=gen).to(dtype).transpose(1, 2)  # the layer's transposed view
    weight, bias = torch.randn(c, 1, k, generator=gen), torch.randn(c, generator=gen)
    state = torch.randn(2, c, state_width, generator=gen)
    y, new_state = gdn.causal_conv1d(x, weight, state, "silu", bias=bias)
    cache = state.clone()
    ptr = cache.data_ptr()
    y2 = gdn.causal_conv1d_(x, weight, cache, "silu", bias=bias)
    assert torch.equal(y2, y) and torch.equal(cache, new_state) and cache.data_ptr() == ptr
    # and both are right: the float64 reference (x's rounding to its dtype is in both inputs)
    ref_y, ref_state = gdn.reference.causal_conv1d(*as64(x, weight, state), "silu", bias=bias.double())
    assert_close_scaled(y2, ref_y, CONV_TOL, ROUNDING[dtype])
    torch.testing.assert_close(cache.double(), ref_state, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", [1, 2, 7, 64])
@pytest.mark.parametrize("t", [1, 5, 20])
def test_causal_conv1d_kernel_sizes_and_partial_blocks(gdn, kernel, t):
    """Any kernel size up to the limit, on a channel count that leaves a partial block of the
    16-channel vector loop (37 = 2 * 16 + 5); decode (t = 1) and token loops; in place on a K-wide
    state equals the out-of-place op."""
    gen = torch.Generator().manual_seed(kernel * 100 + t)
    c = 37
    x = torch.randn(2, t, c, generator=gen).transpose(1, 2)
    w, bias = torch.randn(c, kernel, generator=gen), torch.randn(c, generator=gen)
    state = torch.randn(2, c, kernel, generator=gen)
    y, new_state = gdn.causal_conv1d(x, w, state, "silu", bias=bias)
    ref_y, ref_state = gdn.reference.causal_conv1d(*as64(x, w, state), "silu", bias=bias.double())
    assert_close_scaled(y, ref_y, CONV_TOL * max(1.0, math.sqrt(kernel / 4)))
    torch.testing.assert_close(new_state.double(), ref_state, rtol=0, atol=0)
    cache = state.clone()
    assert torch.equal(gdn.causal_conv1d_(x, w, cache, "silu", bias=bias), y) and torch.equal(cache, new_state)


def test_causal_conv1d_in_place_needs_a_state(gdn):
    x, weight = torch.randn(1, 8, 1), torch.randn(8, 4)
    with pytest.raises(ValueError, match="state must not be None"):
        gdn.ops.causal_conv1d_(x, weight, None, None, "silu")


@pytest.mark.parametrize("t", [1, 2, 9])
def test_causal_conv1d_matches_transformers_functions(gdn, t):
    """causal_conv1d_fn (no state) and causal_conv1d_update (state (B, C, K), updated in place)."""
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(2, 64, t, generator=gen).transpose(1, 2).contiguous().transpose(1, 2)  # as the layer passes it
    w = torch.randn(64, 1, 4, generator=gen)
    y, _ = gdn.causal_conv1d(x, w)
    assert_close_scaled(y, hf.causal_conv1d_fn(x, w.squeeze(1), None, activation="silu"), CONV_TOL)
    state = torch.randn(2, 64, 4, generator=gen)
    hf_state = state.clone()
    ref = hf.causal_conv1d_update(x, hf_state, w.squeeze(1), None, "silu")
    y, new_state = gdn.causal_conv1d(x, w, state)
    assert_close_scaled(y, ref, CONV_TOL)
    assert torch.equal(new_state, hf_state)


def test_causal_conv1d_chunks_equal_one_pass(gdn):
    x = torch.randn(1, 32, 25)
    w = torch.randn(32, 1, 4)
    full, full_state = gdn.causal_conv1d(x, w)
    parts, state = [], None
    for a, b in [(0, 2), (2, 10), (10, 11), (11, 25)]:
        y, state = gdn.causal_conv1d(x[:, :, a:b], w, state)
        parts.append(y)
    assert_close_scaled(torch.cat(parts, -1), full, CONV_TOL)
    assert torch.equal(state, full_state)


# ---------------------------------------------------------------------------------------------
# l2_norm, gates, gated_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm(gdn, dtype):
    x = torch.randn(3, 5, 128).to(dtype)
    x[0, 0] = 0  # eps keeps zero rows at zero
    x[0, 1] *= 1e-4  # |x|^2 comparable to eps: transformers' rsqrt(sum + eps), not x / max(|x|, eps)
    out = gdn.l2_norm(x)
    assert out.dtype == dtype
    assert_close_scaled(out, gdn.reference.l2_norm(x.double()), CONV_TOL, ROUNDING[dtype])
    assert_close_scaled(out, hf.l2norm(x.float()), CONV_TOL, ROUNDING[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates(gdn, dtype):
    h = 16
    A_log = torch.log(torch.empty(h).uniform_(0.01, 16)).to(dtype)
    dt_bias = torch.randn(h).to(dtype)
    a = (torch.randn(2, 7, h) * 10).to(dtype)  # reaches softplus' linear region (> 20)
    b = torch.randn(2, 7, h).to(dtype)
    g, beta = gdn.gates(A_log, a, dt_bias, b)
    assert g.dtype == beta.dtype == torch.float32
    ref_g, ref_beta = gdn.reference.gates(*as64(A_log, a, dt_bias, b))
    assert_close_scaled(g, ref_g, CONV_TOL)
    assert_close_scaled(beta, ref_beta, CONV_TOL)
    hf_g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    assert_close_scaled(g, hf_g, CONV_TOL)


def test_gates_non_contiguous_inputs():
    """A non-contiguous a or b was copied into a temporary freed before the graph read it: garbage
    (-3e26 at 4 rows) or a crash (20000 rows). In a fresh process; bit-identical to the contiguous
    call, and right against the reference."""
    res = run_fresh("ggml-org/ggml-gated-delta-net", """
        import torch
        torch.manual_seed(0)
        A_log, dt_bias = torch.randn(32), torch.randn(32)
        res = {}
        for rows in (4, 20000):
            a, b = torch.randn(32, rows).t(), torch.randn(32, rows).t()
            want = k.gates(A_log, a.contiguous(), dt_bias, b.contiguous())
            ref = k.reference.gates(A_log.double(), a.double(), dt_bias.double(), b.double())
            for name, args in (("a", (a, b.contiguous())), ("b", (a.contiguous(), b)), ("both", (a, b))):
                g, beta = k.gates(A_log, args[0], dt_bias, args[1])
                res[f"{rows} {name} same"] = bool(torch.equal(g, want[0]) and torch.equal(beta, want[1]))
                res[f"{rows} {name} vs ref"] = max(float((g - ref[0]).abs().max() / ref[0].abs().max()),
                                                   float((beta - ref[1]).abs().max()))
    """)
    assert all(v for key, v in res.items() if key.endswith("same")), res
    assert max(v for key, v in res.items() if key.endswith("vs ref")) < CONV_TOL, res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(gdn, dtype):
    x = torch.randn(10, 128).to(dtype)
    z = torch.randn(10, 128).to(dtype)
    w = (1 + 0.1 * torch.randn(128)).to(dtype)
    out = gdn.gated_rms_norm(x, z, w, 1e-6)
    assert out.dtype == dtype
    assert_close_scaled(out, gdn.reference.gated_rms_norm(*as64(x, z, w), 1e-6), CONV_TOL, 2 * ROUNDING[dtype])
    norm = hf.Qwen3_5RMSNormGated(128, eps=1e-6).to(dtype)
    norm.weight.data.copy_(w)
    # transformers rounds to bf16 twice more on the way (normed x, weight * x): 3 roundings at most
    assert_close_scaled(out, norm(x, z), CONV_TOL, 4 * ROUNDING[dtype])


# ---------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_fullgraph(gdn):
    def f(x, w, conv_state, A_log, a, dt_bias, b, rec_state, z, nw):
        y, new_conv = gdn.causal_conv1d(x, w, conv_state)
        y = y.transpose(1, 2)
        q, k, v = torch.split(y, [64, 64, 128], dim=-1)
        q, k, v = q.reshape(1, 3, 1, 64), k.reshape(1, 3, 1, 64), v.reshape(1, 3, 2, 64)
        g, beta = gdn.gates(A_log, a, dt_bias, b)
        o, s = gdn.gated_delta_net(q, k, v, g, beta, rec_state, l2_normalize_qk=True)
        o = gdn.gated_rms_norm(o, z, nw) + gdn.l2_norm(o)
        return o, s, new_conv

    args = (
        torch.randn(1, 256, 3), torch.randn(256, 1, 4), torch.randn(1, 256, 4), torch.randn(2), torch.randn(1, 3, 2),
        torch.randn(2), torch.randn(1, 3, 2), torch.randn(1, 2, 64, 64), torch.randn(1, 3, 2, 64), torch.randn(64),
    )
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(*args), f(*args), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fake_shapes_match(gdn):
    """The fake impls give the real outputs' shapes, dtypes and strides (the conv's output is a
    transposed view)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = make_gdn_inputs(2, 5, 2, 4, 32, torch.bfloat16, True, False)
    x, w, st = torch.randn(2, 48, 5), torch.randn(48, 1, 4), torch.randn(2, 48, 6).bfloat16()
    real = [*gdn.gated_delta_net(*args), *gdn.causal_conv1d(x, w, st), *gdn.causal_conv1d(x, w)]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fa = [mode.from_tensor(t) if t is not None else None for t in args]
        fake = [*gdn.gated_delta_net(*fa), *gdn.causal_conv1d(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(st)),
                *gdn.causal_conv1d(mode.from_tensor(x), mode.from_tensor(w))]
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_info(gdn):
    info = gdn.info()
    from tools.testing.kernel_testing import CPU_LEVELS

    assert info["cpu_variant"] in CPU_LEVELS
    assert info["ggml"].startswith("0.25.3")
    assert gdn.HEAD_DIMS == (32, 64, 128) and math.isclose(gdn.L2_EPS, 1e-6)

"""ggml-gated-delta-net on Metal: each Metal build (tools/testing/builds.py: metal-emu, mps-emu; loaded as users
would) against the CPU build and the reference, every op under both lane schedules of the emulator
(metal_builds.both_schedules: bit-identical results required), with the kernels upstream chose."""

from __future__ import annotations

import pytest
import torch

from tools.testing import metal_checks
from tools.testing.metal_builds import both_schedules

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_emulated_build_loads_and_carries_no_ggml_cpu(metal_emu, gdn):
    metal_checks.assert_emulated_build_has_no_ggml_cpu(metal_emu, gdn)


def assert_float_close(got, want, tol):
    """|got - want| <= tol * max|want| (float32 recurrences summed in another order)."""
    scale = want.double().abs().max().clamp_min(1e-30)
    assert ((got.double() - want.double()).abs() <= tol * scale).all(), ((got - want).abs().max() / scale).item()


def delta_net_inputs(B, T, Hk, Hv, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, Hk, D, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(B, T, Hv, D, generator=g).to(dtype)
    gate = -torch.rand(B, T, Hv, generator=g)
    beta = torch.rand(B, T, Hv, generator=g)
    state = 0.1 * torch.randn(B, Hv, D, D, generator=g)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize(("T", "Hk", "Hv", "D"), [(1, 2, 2, 32), (1, 2, 8, 128), (7, 1, 4, 64), (7, 2, 4, 128)])
def test_gated_delta_net(metal, gdn, T, Hk, Hv, D, l2):
    """Upstream's kernel_gated_delta_net_f32_<D/32> for decode (T = 1) and prefill, GQA ratios 1 to
    8, with a state; against the CPU build and the reference within 1e-5 of the output scale
    (observed ~1e-8: float32 sums of D products in SIMD order)."""
    q, k, v, gate, beta, state = delta_net_inputs(2, T, Hk, Hv, D, seed=T + Hv + D)
    if not l2:
        q, k = q / D**0.5, k / D**0.5  # keep the recurrence bounded
    (out, new_state), kernels = both_schedules(metal, metal.ops.gated_delta_net, q, k, v, gate, beta, state, l2, None)
    assert f"kernel_gated_delta_net_f32_{D // 32}" in kernels, kernels
    out_cpu, state_cpu = gdn.ops.gated_delta_net(q, k, v, gate, beta, state, l2, None)
    assert_float_close(out, out_cpu, 1e-5)
    assert_float_close(new_state, state_cpu, 1e-5)
    out_ref, state_ref = metal.reference.gated_delta_net(q, k, v, gate, beta, state, l2_normalize_qk=l2)
    assert_float_close(out, out_ref, 1e-5)
    assert_float_close(new_state, state_ref, 1e-5)


def host_path_calls(module):
    """gated_delta_net calls that take each host fast path of the CPU build: a decode step (memcpy of
    float32 output rows and of the states) on a transformers-layout state (tiled transposition into
    host scratch), a prefill without a state (memset), an in-place decode on a state in ggml's layout."""
    q, k, v, gate, beta, state = delta_net_inputs(2, 1, 2, 4, 32, seed=5)
    out, new_state = module.gated_delta_net(q, k, v, gate, beta, state.contiguous(), l2_normalize_qk=True)
    q7, k7, v7, gate7, beta7, _ = delta_net_inputs(1, 7, 1, 2, 64, seed=6)
    out7, state7 = module.gated_delta_net(q7, k7, v7, gate7, beta7, l2_normalize_qk=True)
    cached = new_state.clone()
    out_in_place = module.gated_delta_net_(q, k, v, gate, beta, cached, l2_normalize_qk=True)
    return [out, new_state, out7, state7, out_in_place, cached]


def test_no_host_access_to_tensor_memory(metal, gdn):
    """On a Mac a Metal build's tensors are MPS tensors in private Metal buffers: their data pointers
    are no host addresses, and a host read or write (or a host scratch buffer bound into a graph)
    fails or corrupts memory. The Linux builds' stand-ins are CPU tensors, where such a step goes
    unnoticed. So the ops' own code reaches tensor memory through one door (gdn_ops::host_floats,
    and the host scratch), which counts each access (ops._host_tensor_accesses) and raises on a
    build whose tensors may be device memory. The calls take every host fast path of the CPU build:
    they must count there (or the count proves nothing) and count 0 on each Metal build, whose
    results are the CPU build's within 1e-5 of the scale (float32 sums in another order)."""
    before = gdn.ops._host_tensor_accesses()
    want = host_path_calls(gdn)
    assert gdn.ops._host_tensor_accesses() > before
    before = metal.ops._host_tensor_accesses()
    got = host_path_calls(metal)
    assert metal.ops._host_tensor_accesses() == before
    for g, w in zip(got, want, strict=True):
        assert g.stride() == w.stride()
        assert_float_close(g, w, 1e-5)


def test_gated_delta_net_in_place_without_state_and_bf16(metal, gdn):
    q, k, v, gate, beta, _ = delta_net_inputs(1, 3, 2, 4, 64, dtype=torch.bfloat16, seed=1)
    out, state = metal.gated_delta_net(q, k, v, gate, beta, l2_normalize_qk=True, scale=0.2)
    out_cpu, state_cpu = gdn.gated_delta_net(q, k, v, gate, beta, l2_normalize_qk=True, scale=0.2)
    assert out.dtype == torch.bfloat16
    assert_float_close(out.float(), out_cpu.float(), 2.0**-7)
    assert_float_close(state, state_cpu, 1e-5)
    q1, k1, v1, g1, b1, _ = delta_net_inputs(1, 1, 2, 4, 64, dtype=torch.bfloat16, seed=2)
    cached, cached_cpu = state.clone(), state_cpu.clone()
    (y,), _ = both_schedules(metal, lambda: [metal.gated_delta_net_(q1, k1, v1, g1, b1, cached.clone(), l2_normalize_qk=True)])
    metal.gated_delta_net_(q1, k1, v1, g1, b1, cached, l2_normalize_qk=True)
    gdn.gated_delta_net_(q1, k1, v1, g1, b1, cached_cpu, l2_normalize_qk=True)
    assert_float_close(y.float(), gdn.gated_delta_net_(q1, k1, v1, g1, b1, state_cpu.clone(), l2_normalize_qk=True).float(), 2.0**-7)
    assert_float_close(cached, cached_cpu, 1e-5)


def test_gated_delta_net_head_sizes_refused_alike(metal, gdn):
    q, k, v, gate, beta, state = delta_net_inputs(1, 1, 1, 1, 16)
    for module in (metal, gdn):
        with pytest.raises(ValueError, match="head dim 16 is not supported"):
            module.ops.gated_delta_net(q, k, v, gate, beta, state, True, None)


def test_float_arguments_beyond_float32_refused_alike(metal, gdn):
    """A finite double beyond float32's range is inf once ggml holds it (gated_delta_net's scale=1e300
    gave an all-NaN output): every float argument of the package is a ValueError, on both builds."""
    q, k, v, gate, beta, state = delta_net_inputs(1, 1, 1, 1, 64)
    x = torch.randn(2, 16)
    calls = [lambda m: m.ops.gated_delta_net(q, k, v, gate, beta, state, True, 1e300),
             lambda m: m.l2_norm(x, 1e300), lambda m: m.gated_rms_norm(x, x, torch.ones(16), eps=1e300)]
    for call in calls:
        for module in (metal, gdn):
            with pytest.raises(ValueError, match=r"within float32's range \(magnitude at most 3.40282e\+38"):
                call(module)


@pytest.mark.parametrize("taps", [4, 2])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d(metal, gdn, taps, with_state, dtype):
    """kernel_ssm_conv_* (+ bias, SiLU) for a prefill (T = 6) and a decode step (T = 1, in place),
    against the CPU build: float32 sums of `taps` products, 1e-6 of the scale."""
    g = torch.Generator().manual_seed(taps)
    x = torch.randn(2, 48, 6, generator=g).to(dtype)
    w, b = torch.randn(48, 1, taps, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    state = torch.randn(2, 48, taps, generator=g) if with_state else None
    (y, new_state), kernels = both_schedules(metal, metal.causal_conv1d, x, w, state, bias=b)
    assert any(k.startswith("kernel_ssm_conv") for k in kernels), kernels
    y_cpu, state_cpu = gdn.causal_conv1d(x, w, state, bias=b)
    assert_float_close(y.float(), y_cpu.float(), 1e-6 if dtype == torch.float32 else 2.0**-7)
    assert torch.equal(new_state, state_cpu)
    x1 = torch.randn(2, 48, 1, generator=g).to(dtype)
    cache, cache_cpu = state_cpu.clone(), state_cpu.clone()
    y1 = metal.causal_conv1d_(x1, w, cache, bias=b)
    y1_cpu = gdn.causal_conv1d_(x1, w, cache_cpu, bias=b)
    assert_float_close(y1.float(), y1_cpu.float(), 1e-6 if dtype == torch.float32 else 2.0**-7)
    assert torch.equal(cache, cache_cpu)


def test_gates_l2_norm_and_gated_rms_norm(metal, gdn):
    g = torch.Generator().manual_seed(9)
    A, dt = torch.randn(8, generator=g), torch.randn(8, generator=g)
    a, b = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    (gate, beta), kernels = both_schedules(metal, metal.gates, A, a, dt, b)
    for got, want in zip((gate, beta), gdn.gates(A, a, dt, b), strict=True):
        assert_float_close(got, want, 1e-6)
    x, z, w = torch.randn(4, 3, 128, generator=g), torch.randn(4, 3, 128, generator=g), torch.randn(128, generator=g)
    y, kernels = both_schedules(metal, metal.gated_rms_norm, x, z, w)
    assert "kernel_swiglu_f32" in kernels, kernels
    assert_float_close(y, gdn.gated_rms_norm(x, z, w), 1e-6)
    y, _ = both_schedules(metal, metal.l2_norm, x)
    assert_float_close(y, gdn.l2_norm(x), 1e-6)

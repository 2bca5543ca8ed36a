"""ggml-norm on Metal: each Metal build (tools/testing/builds.py: metal-emu, mps-emu; loaded as users
would) against the CPU build and the reference, every op under both lane schedules of the emulator
(metal_builds.both_schedules: bit-identical results required), with the kernels upstream chose."""

from __future__ import annotations

import pytest
import torch

from tools.testing import metal_checks
from tools.testing.metal_builds import both_schedules

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_emulated_build_loads_and_carries_no_ggml_cpu(metal_emu, gn):
    metal_checks.assert_emulated_build_has_no_ggml_cpu(metal_emu, gn)


NORM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def norm_tolerance(dtype: torch.dtype) -> float:
    """Metal sums the squares in float32 (SIMD-group sums), the CPU build in double: 1e-6 relative
    on float32 outputs; a half / bfloat output may then round the other way (one unit: 2^-10 / 2^-7)."""
    return {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]


def assert_norm_close(a, b, dtype):
    tol = norm_tolerance(dtype)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert ((a.double() - b.double()).abs() <= tol * (b.double().abs() + 1)).all()


@pytest.mark.parametrize("n", [64, 70])
@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("variant", ["plain", "weight", "zero-centered", "bias", "llama-rounding"])
def test_rms_norm(metal, gn, variant, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 5, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    kwargs = {
        "plain": {},
        "weight": {"weight": w},
        "zero-centered": {"weight": w, "zero_centered": True},
        "bias": {"weight": w, "bias": b},
        "llama-rounding": {"weight": w.float(), "cast_before_weight": True},
    }[variant]
    y, kernels = both_schedules(metal, metal.rms_norm, x, eps=1e-6, **kwargs)
    assert any(k.startswith("kernel_rms_norm") for k in kernels), kernels
    assert any(k.endswith("_f32_4") for k in kernels) == (n % 4 == 0), kernels
    assert_norm_close(y, gn.rms_norm(x, eps=1e-6, **kwargs), dtype)
    ref = metal.reference.rms_norm(x, eps=1e-6, **kwargs)
    assert_norm_close(y, ref, dtype)


def test_rms_norm_strided_input(metal, gn):
    x = torch.randn(6, 128)[:, 16:112]  # (6, 96) with row stride 128
    assert not x.is_contiguous()
    w = torch.randn(96)
    y, _ = both_schedules(metal, metal.rms_norm, x, w, eps=1e-5)
    assert_norm_close(y, gn.rms_norm(x, w, eps=1e-5), torch.float32)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("rounding", [False, True])
def test_rms_norm_gated(metal, gn, dtype, rounding):
    g = torch.Generator().manual_seed(3)
    x, z = (torch.randn(7, 128, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(128, generator=g).to(dtype)
    y, kernels = both_schedules(metal, metal.rms_norm_gated, x, z, w, eps=1e-6, cast_before_weight=rounding)
    assert any(k.startswith("kernel_rms_norm") for k in kernels) and any("swiglu" in k for k in kernels), kernels
    assert_norm_close(y, gn.rms_norm_gated(x, z, w, eps=1e-6, cast_before_weight=rounding), dtype)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("mode", ["clamp", "rsqrt"])
def test_l2_norm(metal, gn, mode, dtype):
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[0, 0] = 0  # the clamp
    y, kernels = both_schedules(metal, metal.l2_norm, x, eps=1e-6, mode=mode)
    want = "kernel_l2_norm" if mode == "clamp" else "kernel_rms_norm"
    assert any(k.startswith(want) for k in kernels), kernels
    assert_norm_close(y, gn.l2_norm(x, eps=1e-6, mode=mode), dtype)


def test_norm_layers(metal, gn):
    """The kernelize layers, forward called on a module holding transformers' attribute names."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(64))
    module.variance_epsilon = 1e-6
    module.eps = 1e-6
    x, gate = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    for name, args in [("RMSNorm", (x,)), ("RMSNormZeroCentered", (x,)), ("RMSNormGated", (x, gate))]:
        y, _ = both_schedules(metal, getattr(metal.layers, name).forward, module, *args)
        assert_norm_close(y, getattr(gn.layers, name).forward(module, *args), torch.float32)


def test_float_arguments_beyond_float32_refused_alike(metal, gn):
    """A finite double beyond float32's range is inf once ggml holds it: every float argument of the
    package is a ValueError, on both builds."""
    x = torch.randn(2, 16)
    calls = [lambda m: m.rms_norm(x, eps=1e300), lambda m: m.rms_norm_gated(x, x, torch.ones(16), eps=1e300),
             lambda m: m.l2_norm(x, eps=-1e39)]
    for call in calls:
        for module in (metal, gn):
            with pytest.raises(ValueError, match=r"within float32's range \(magnitude at most 3.40282e\+38"):
                call(module)

"""Bad input gets a clear Python exception naming the problem, never a crash. Each case calls the op
directly (torch.ops) as well where the Python wrapper adds nothing, since the checks live in the
kernel. Every test runs on each build kind of the package (conftest.py: cpu, metal-emu, mps-emu):
the checks are shared, the words the same."""

from __future__ import annotations

import math

import pytest
import torch

from tools.testing.kernel_testing import assert_fake_refuses_as_cpu

N = 64


@pytest.fixture
def x():
    return torch.randn(3, N)


def test_non_float_input(build, x):
    for bad in (x.double(), x.long(), x.to(torch.int8), x > 0):
        with pytest.raises(TypeError, match="x must have dtype Float, BFloat16, Half"):
            build.rms_norm(bad)
        with pytest.raises(TypeError, match="x must have dtype"):
            build.ops.l2_norm(bad, 1e-6, "clamp")
        with pytest.raises(TypeError, match="x must have dtype"):
            build.rms_norm_gated(bad, bad, torch.ones(N))


def test_weight_and_bias_dtype(build, x):
    with pytest.raises(TypeError, match="weight must have dtype"):
        build.rms_norm(x, torch.ones(N, dtype=torch.float64))
    with pytest.raises(TypeError, match="bias must have dtype"):
        build.rms_norm(x, torch.ones(N), bias=torch.ones(N, dtype=torch.int32))
    with pytest.raises(TypeError, match="z must have dtype"):
        build.rms_norm_gated(x, x.double(), torch.ones(N))


def test_zero_dim_input(build):
    with pytest.raises(ValueError, match="x must have at least one dim"):
        build.rms_norm(torch.tensor(1.0))
    with pytest.raises(ValueError, match="x must have at least one dim"):
        build.l2_norm(torch.tensor(1.0))


def test_weight_of_wrong_length(build, x):
    with pytest.raises(ValueError, match=r"weight must be 1-D with 64 values \(x's last dim\), got shape \[63\]"):
        build.rms_norm(x, torch.ones(N - 1))
    with pytest.raises(ValueError, match=r"weight must be 1-D with 64 values .* got shape \[1, 64\]"):
        build.rms_norm(x, torch.ones(1, N), zero_centered=True)
    with pytest.raises(ValueError, match="bias must be 1-D with 64 values"):
        build.rms_norm(x, torch.ones(N), bias=torch.ones(N + 1))
    with pytest.raises(ValueError, match="weight must be 1-D with 64 values"):
        build.rms_norm_gated(x, x, torch.ones(2 * N))


def test_gate_shape_mismatch(build, x):
    with pytest.raises(ValueError, match=r"z \(the gate\) must have x's shape \[3, 64\], got \[3, 32\]"):
        build.rms_norm_gated(x, torch.randn(3, N // 2), torch.ones(N))
    with pytest.raises(ValueError, match=r"z \(the gate\) must have x's shape"):
        build.rms_norm_gated(x, torch.randn(1, 3, N), torch.ones(N))


@pytest.mark.parametrize("eps", [-1e-6, -1.0, math.nan, math.inf, 1e300])  # 1e300: finite, but inf as ggml's float32
def test_bad_eps(build, x, eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        build.rms_norm(x, eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        build.rms_norm_gated(x, x, torch.ones(N), eps=eps)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        build.l2_norm(x, eps=eps)


def test_bad_l2_mode(build, x):
    for call in (lambda: build.l2_norm(x, mode="max"), lambda: build.ops.l2_norm(x, 1e-6, "max")):
        with pytest.raises(ValueError, match=r"mode must be \"clamp\" .* or \"rsqrt\" .*, got \"max\""):
            call()


def test_flag_combinations(build, x):
    w = torch.ones(N)
    with pytest.raises(ValueError, match="zero_centered needs a weight"):
        build.rms_norm(x, zero_centered=True)
    with pytest.raises(ValueError, match="cast_before_weight needs a weight"):
        build.rms_norm(x, cast_before_weight=True)
    with pytest.raises(ValueError, match="takes no bias and cannot be zero_centered"):
        build.rms_norm(x, w, bias=w, cast_before_weight=True)
    with pytest.raises(ValueError, match="takes no bias and cannot be zero_centered"):
        build.rms_norm(x, w, zero_centered=True, cast_before_weight=True)


def test_device_mismatch(build, x):
    """Tensors on two devices are refused by name. (The meta device stands in for an accelerator:
    mixed devices dispatch to the shape-only implementation, which checks them.)"""
    meta = torch.ones(N, device="meta")
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        build.rms_norm(x, meta)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        build.rms_norm(x, torch.ones(N), bias=meta)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        build.rms_norm_gated(x, x.to("meta"), torch.ones(N))


def test_fake_impls_check_like_the_kernel(build):
    """On the meta device (what torch.compile traces with) the same mistakes raise the same kind of
    error, before any kernel runs."""
    x = torch.empty(3, N, device="meta")
    with pytest.raises(ValueError, match="weight must be 1-D with 64 values"):
        build.rms_norm(x, torch.empty(N - 1, device="meta"))
    with pytest.raises(ValueError, match="z \\(the gate\\) must have x's shape"):
        build.rms_norm_gated(x, torch.empty(3, 1, device="meta"), torch.empty(N, device="meta"))
    with pytest.raises(TypeError, match="x must have dtype"):
        build.l2_norm(torch.empty(3, N, device="meta", dtype=torch.float64))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        build.l2_norm(x, eps=-1.0)
    out = build.rms_norm(torch.empty(2, 3, N, device="meta", dtype=torch.bfloat16), torch.empty(N, device="meta"), cast_before_weight=True)
    assert out.shape == (2, 3, N) and out.dtype == torch.float32 and out.device.type == "meta"


def test_errors_leave_the_op_usable(build, x):
    with pytest.raises(ValueError):
        build.rms_norm(x, torch.ones(N + 1))
    torch.testing.assert_close(build.rms_norm(x), build.reference.rms_norm(x), rtol=1e-6, atol=1e-6)


# Each case is an op of torch.ops (as a compiled graph calls it) and its arguments: the kernel refuses
# them on the CPU, and the fake implementation (what torch.compile traces with) refuses the same
# arguments as meta tensors with the same exception type and message.
def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


FAKE_CASES = {
    "rms_norm x 0-D": ("rms_norm", lambda: (_t(), None, None, 1e-6, False, False)),
    "rms_norm x int": ("rms_norm", lambda: (_t(3, N, dtype=torch.int32), None, None, 1e-6, False, False)),
    "rms_norm eps negative": ("rms_norm", lambda: (_t(3, N), None, None, -1.0, False, False)),
    "rms_norm eps nan": ("rms_norm", lambda: (_t(3, N), None, None, math.nan, False, False)),
    "rms_norm weight size": ("rms_norm", lambda: (_t(3, N), _t(N + 1), None, 1e-6, False, False)),
    "rms_norm weight 2-D": ("rms_norm", lambda: (_t(3, N), _t(1, N), None, 1e-6, False, False)),
    "rms_norm bias dtype": ("rms_norm", lambda: (_t(3, N), None, _t(N, dtype=torch.float64), 1e-6, False, False)),
    "rms_norm zero_centered no weight": ("rms_norm", lambda: (_t(3, N), None, None, 1e-6, True, False)),
    "rms_norm cast_before_weight no weight": ("rms_norm", lambda: (_t(3, N), None, None, 1e-6, False, True)),
    "rms_norm cast_before_weight bias": ("rms_norm", lambda: (_t(3, N), _t(N), _t(N), 1e-6, False, True)),
    "rms_norm_gated z shape": ("rms_norm_gated", lambda: (_t(3, N), _t(3, 1), _t(N), 1e-6, True)),
    "rms_norm_gated z dtype": ("rms_norm_gated", lambda: (_t(3, N), _t(3, N, dtype=torch.int64), _t(N), 1e-6, True)),
    "rms_norm_gated weight size": ("rms_norm_gated", lambda: (_t(3, N), _t(3, N), _t(N - 1), 1e-6, True)),
    "rms_norm_gated eps": ("rms_norm_gated", lambda: (_t(3, N), _t(3, N), _t(N), math.inf, True)),
    "l2_norm mode": ("l2_norm", lambda: (_t(3, N), 1e-6, "max")),
    "l2_norm x 0-D": ("l2_norm", lambda: (_t(), 1e-6, "clamp")),
    "l2_norm x float64": ("l2_norm", lambda: (_t(3, N, dtype=torch.float64), 1e-6, "rsqrt")),
    "l2_norm eps negative": ("l2_norm", lambda: (_t(3, N), -1e-6, "clamp")),
    "rms_norm eps 1e300": ("rms_norm", lambda: (_t(3, N), None, None, 1e300, False, False)),
    "l2_norm eps 1e300": ("l2_norm", lambda: (_t(3, N), 1e300, "rsqrt")),
}


@pytest.mark.parametrize("case", sorted(FAKE_CASES))
def test_fake_refuses_what_the_kernel_refuses(build, case):
    op, args = FAKE_CASES[case]
    assert_fake_refuses_as_cpu(getattr(build.ops, op), *args())

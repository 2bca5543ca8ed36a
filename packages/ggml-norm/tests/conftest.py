import pytest
import torch

from tools.testing import builds
from tools.testing.kernel_testing import load_kernel


@pytest.fixture(scope="session")
def gn():
    """The ggml-norm build, loaded through kernels.get_kernel as transformers loads it."""
    return load_kernel("ggml-org/ggml-norm")


# Each build kind of the package (tools/testing/builds.py), the kind as the test id (`-k mps-emu`):
# `build` every kind (cpu, metal-emu, mps-emu) for tests whose API and tolerances hold on each,
# `metal` each Metal kind, `metal_emu` the emulated build alone (its instrumentation).
build = builds.each_build("build", "ggml-norm")
metal = builds.each_build("metal", "ggml-norm", builds.METAL_KINDS)
metal_emu = builds.each_build("metal_emu", "ggml-norm", ("metal-emu",))


_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (common) dtype lie between a and b, elementwise:
    the bit patterns mapped to a monotone integer scale (+0 and -0 both 0)."""
    assert a.dtype == b.dtype and a.dtype in _INT, (a.dtype, b.dtype)
    it = _INT[a.dtype]
    sign = torch.iinfo(it).min

    def ordered(t):
        bits = t.contiguous().view(it).long()
        return torch.where(bits < 0, -(bits - sign), bits)  # negatives: minus their magnitude bits

    return (ordered(a) - ordered(b)).abs()


def _assert_ulps(out: torch.Tensor, ref: torch.Tensor, max_ulps: int, atol: float = 0.0, rtol: float = 0.0) -> None:
    """Every element of out within max_ulps of ref, or else within atol + rtol * |ref| (for sums
    that may cancel, and for one flipped rounding of an intermediate in a coarser dtype)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert not out.isnan().any() or torch.equal(out.isnan(), ref.isnan())
    d = ulp_distance(out, ref)
    bad = (d > max_ulps) & ((out.double() - ref.double()).abs() > atol + rtol * ref.double().abs())
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(bad.sum())} of {out.numel()} elements off by more than {max_ulps} ulps "
            f"(max {int(d.max())}); first at {i}: {out[tuple(i)].item()} vs {ref[tuple(i)].item()}"
        )


@pytest.fixture(scope="session")
def assert_ulps():
    return _assert_ulps

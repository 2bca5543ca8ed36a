"""Loading the build the ways users do, each in a fresh process, then calling every op and layer;
and every CPU level's runtime loads and gives the same results on this machine."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import CPU_LEVELS, run_fresh

REPO_ID = "ggml-org/ggml-norm"

CALL_EVERY_OP = """
import torch
torch.manual_seed(0)
x = torch.randn(2, 3, 256)
z = torch.randn(2, 3, 256)
w = torch.randn(256)
res = {
    "rms_norm": k.rms_norm(x, w, 1e-6, True).tolist(),
    "rms_norm_bf16": k.rms_norm(x.bfloat16(), w.bfloat16(), bias=w).float().tolist(),
    "rms_norm_gated": k.rms_norm_gated(x, z, w).tolist(),
    "l2_norm": k.l2_norm(x).tolist(),
    "l2_norm_rsqrt": k.l2_norm(x.half(), mode="rsqrt").float().tolist(),
    "layers": sorted(k.layers.__all__),
    "info": k.info(),
}
"""


def check(res: dict) -> None:
    for op in ("rms_norm", "rms_norm_bf16", "rms_norm_gated", "l2_norm", "l2_norm_rsqrt"):
        assert torch.tensor(res[op]).shape == (2, 3, 256), op
    assert res["layers"] == ["RMSNorm", "RMSNormGated", "RMSNormZeroCentered"]
    assert res["info"]["ggml"].startswith("0.25.3")


def test_get_kernel_with_local_kernels():
    check(run_fresh(REPO_ID, CALL_EVERY_OP))


def test_get_local_kernel(default_level):
    check(default_level)


@pytest.fixture(scope="module")
def default_level():
    return run_fresh(REPO_ID, CALL_EVERY_OP, via="get_local_kernel")


@pytest.mark.parametrize("level", CPU_LEVELS)
def test_every_cpu_level_loads_and_agrees(default_level, level):
    """GGML_KERNELS_CPU_VARIANT forces a level. ggml's norm loops are scalar C (the same code at
    every level) but the scale, silu and conversions are vectorised per level: float32 results agree
    to a few ulps (1e-6 relative), the rounded bf16/f16 ones to one ulp."""
    res = run_fresh(REPO_ID, CALL_EVERY_OP, via="get_local_kernel", level=level)
    assert res["info"]["cpu_variant"] == level
    check(res)
    here = default_level
    for op, rtol, atol in [("rms_norm", 1e-6, 1e-6), ("rms_norm_gated", 2e-6, 1e-6), ("l2_norm", 1e-6, 1e-7),
                           ("rms_norm_bf16", 2.0**-7, 1e-2), ("l2_norm_rsqrt", 2.0**-10, 1e-4)]:
        torch.testing.assert_close(torch.tensor(res[op]), torch.tensor(here[op]), rtol=rtol, atol=atol, msg=op)

"""Loading the build the ways users do, each in a fresh process, then calling every op; and the
portability promise: every CPU level's runtime loads and agrees on this machine."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import CPU_LEVELS, run_fresh

MATMUL_RTOL = 2e-3  # see test_ops.py: SIMD levels differ only in activation-rounding near-ties
REPO_ID = "ggml-org/ggml-quantization"

CALL_EVERY_OP = """
import torch
torch.manual_seed(0)
x = torch.randn(3, 256)
b = k.quantize(torch.randn(16, 256), "Q4_K")
e = torch.stack([b, b])
res = {
    "mul_mat_vec": list(k.mul_mat_vec(b, x, 12, 16).shape),
    "y": k.mul_mat_vec(b, x, 12, 16).tolist(),
    "mul_mat": list(k.mul_mat(b, torch.randn(20, 256), "Q4_K", 16).shape),
    "mul_mat_id": list(k.mul_mat_id(e, x, torch.zeros(3, 2, dtype=torch.int32), 12, 16).shape),
    "dequantize": list(k.dequantize(b, 12, 16, 256, torch.bfloat16).shape),
    "get_rows": list(k.get_rows(b, torch.tensor([1, 2]), 12, 256, torch.float16).shape),
    "quantize": list(b.shape),
    "gemv_types": len(k.GEMV_TYPES),
    "max_gemv_rows": k.MAX_GEMV_ROWS,
    "info": k.info(),
}
q = k.quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(1)), "Q4_0")
res["y_q4_0"] = k.mul_mat_vec(q, x, 2, 16).tolist()  # 3 rows: llamafile's sgemm, vec_dot on x64
"""


def check(res: dict) -> None:
    assert res["mul_mat_vec"] == [3, 16]
    assert res["mul_mat"] == [20, 16]
    assert res["mul_mat_id"] == [3, 2, 16]
    assert res["dequantize"] == [16, 256]
    assert res["get_rows"] == [2, 256]
    assert res["quantize"] == [16, 144]
    assert res["max_gemv_rows"] == 8 and res["gemv_types"] == 28


def test_get_kernel_with_local_kernels():
    check(run_fresh(REPO_ID, CALL_EVERY_OP))


def test_get_local_kernel():
    check(run_fresh(REPO_ID, CALL_EVERY_OP, via="get_local_kernel"))


@pytest.mark.parametrize("level", CPU_LEVELS)
def test_every_cpu_level_loads_and_agrees(gq, level):
    """GGML_KERNELS_CPU_VARIANT forces a level: each one runs here (this CPU has AVX-512) and gives
    the same mat-vec as the default within the activation-quantization tolerance."""
    res = run_fresh(REPO_ID, CALL_EVERY_OP, via="get_local_kernel", level=level)
    assert res["info"]["cpu_variant"] == level
    check(res)
    torch.manual_seed(0)
    x = torch.randn(3, 256)
    b = gq.quantize(torch.randn(16, 256), "Q4_K")
    q4_0 = gq.quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(1)), "Q4_0")
    for y, q, t in ((res["y"], b, 12), (res["y_q4_0"], q4_0, 2)):
        here, there = gq.mul_mat_vec(q, x, t, 16), torch.tensor(y)
        assert (here - there).abs().max().item() <= MATMUL_RTOL * here.abs().max().item()

"""Loading the build the ways users do, each in a fresh process, then calling every op; and the
portability promise: every CPU level's runtime loads and agrees on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_testing import REPO, backend_kwargs, local_kernels_env

MATMUL_RTOL = 2e-3  # see test_ops.py: SIMD levels differ only in activation-rounding near-ties

PKG = REPO / "packages" / "ggml-quantization"

CALL_EVERY_OP = """
import json, torch
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
print("RESULT" + json.dumps(res))
"""


def run_fresh(prelude: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env_extra or {}))
    code = textwrap.dedent(prelude) + CALL_EVERY_OP
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def check(res: dict) -> None:
    assert res["mul_mat_vec"] == [3, 16]
    assert res["mul_mat"] == [20, 16]
    assert res["mul_mat_id"] == [3, 2, 16]
    assert res["dequantize"] == [16, 256]
    assert res["get_rows"] == [2, 256]
    assert res["quantize"] == [16, 144]
    assert res["max_gemv_rows"] == 8 and res["gemv_types"] == 28


def test_get_kernel_with_local_kernels():
    res = run_fresh(
        f"""
        import kernels
        k = kernels.get_kernel("ggml-org/ggml-quantization", version=1, **{backend_kwargs()!r})
        """,
        {"LOCAL_KERNELS": local_kernels_env()},
    )
    check(res)


def test_get_local_kernel():
    res = run_fresh(
        f"""
        from pathlib import Path
        import kernels
        k = kernels.get_local_kernel(Path({str(PKG)!r}), **{backend_kwargs()!r})
        """
    )
    check(res)


@pytest.mark.parametrize("level", ["x64", "haswell", "skylakex", "zen4"])
def test_every_cpu_level_loads_and_agrees(gq, level):
    """GGML_KERNELS_CPU_VARIANT forces a level: each one runs here (this CPU has AVX-512) and gives
    the same mat-vec as the default within the activation-quantization tolerance."""
    if level != "x64":
        flags = open("/proc/cpuinfo").read()
        needed = {"haswell": "avx2", "skylakex": "avx512bw", "zen4": "avx512_bf16"}[level]
        if needed not in flags:
            pytest.skip(f"this CPU has no {needed}")
    res = run_fresh(
        f"""
        from pathlib import Path
        import kernels
        k = kernels.get_local_kernel(Path({str(PKG)!r}), **{backend_kwargs()!r})
        """,
        {"GGML_KERNELS_CPU_VARIANT": level},
    )
    assert res["info"]["cpu_variant"] == level
    check(res)
    torch.manual_seed(0)
    x = torch.randn(3, 256)
    b = gq.quantize(torch.randn(16, 256), "Q4_K")
    here = gq.mul_mat_vec(b, x, 12, 16)
    there = torch.tensor(res["y"])
    assert (here - there).abs().max().item() <= MATMUL_RTOL * here.abs().max().item()


def test_unknown_forced_level_is_a_clear_error():
    env = dict(os.environ, GGML_KERNELS_CPU_VARIANT="pentium", HF_HUB_OFFLINE="1")
    code = f"""
import torch, kernels
from pathlib import Path
k = kernels.get_local_kernel(Path({str(PKG)!r}), **{backend_kwargs()!r})
k.mul_mat_vec(k.quantize(torch.randn(4, 32), "Q8_0"), torch.randn(1, 32), "Q8_0", 4)
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1  # a Python exception, not a crash
    assert "no usable ggml CPU runtime for GGML_KERNELS_CPU_VARIANT=pentium" in proc.stderr

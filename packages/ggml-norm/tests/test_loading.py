"""Loading the build the ways users do, each in a fresh process, then calling every op and layer;
and every CPU level's runtime loads and gives the same results on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_testing import REPO, backend_kwargs, local_kernels_env

PKG = REPO / "packages" / "ggml-norm"

CALL_EVERY_OP = """
import json, torch
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
    for op in ("rms_norm", "rms_norm_bf16", "rms_norm_gated", "l2_norm", "l2_norm_rsqrt"):
        assert torch.tensor(res[op]).shape == (2, 3, 256), op
    assert res["layers"] == ["RMSNorm", "RMSNormGated", "RMSNormZeroCentered"]
    assert res["info"]["ggml"].startswith("0.25.3")


def test_get_kernel_with_local_kernels():
    res = run_fresh(
        f"""
        import kernels
        k = kernels.get_kernel("ggml-org/ggml-norm", version=1, **{backend_kwargs()!r})
        """,
        {"LOCAL_KERNELS": local_kernels_env()},
    )
    check(res)


def test_get_local_kernel(default_level):
    check(default_level)


LOCAL_PRELUDE = f"""
from pathlib import Path
import kernels
k = kernels.get_local_kernel(Path({str(PKG)!r}), **{backend_kwargs()!r})
"""


@pytest.fixture(scope="module")
def default_level():
    return run_fresh(LOCAL_PRELUDE)


@pytest.mark.parametrize("level", ["x64", "haswell", "skylakex", "zen4"])
def test_every_cpu_level_loads_and_agrees(default_level, level):
    """GGML_KERNELS_CPU_VARIANT forces a level. ggml's norm loops are scalar C (the same code at
    every level) but the scale, silu and conversions are vectorised per level: float32 results agree
    to a few ulps (1e-6 relative), the rounded bf16/f16 ones to one ulp."""
    if level != "x64":
        flags = open("/proc/cpuinfo").read()
        needed = {"haswell": "avx2", "skylakex": "avx512bw", "zen4": "avx512_bf16"}[level]
        if needed not in flags:
            pytest.skip(f"this CPU has no {needed}")
    res = run_fresh(LOCAL_PRELUDE, {"GGML_KERNELS_CPU_VARIANT": level})
    assert res["info"]["cpu_variant"] == level
    check(res)
    here = default_level
    for op, rtol, atol in [("rms_norm", 1e-6, 1e-6), ("rms_norm_gated", 2e-6, 1e-6), ("l2_norm", 1e-6, 1e-7),
                           ("rms_norm_bf16", 2.0**-7, 1e-2), ("l2_norm_rsqrt", 2.0**-10, 1e-4)]:
        torch.testing.assert_close(torch.tensor(res[op]), torch.tensor(here[op]), rtol=rtol, atol=atol, msg=op)


def test_unknown_forced_level_is_a_clear_error():
    env = dict(os.environ, GGML_KERNELS_CPU_VARIANT="pentium", HF_HUB_OFFLINE="1")
    code = f"""
import torch, kernels
from pathlib import Path
k = kernels.get_local_kernel(Path({str(PKG)!r}), **{backend_kwargs()!r})
k.rms_norm(torch.randn(1, 32))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1  # a Python exception, not a crash
    assert "no usable ggml CPU runtime for GGML_KERNELS_CPU_VARIANT=pentium" in proc.stderr

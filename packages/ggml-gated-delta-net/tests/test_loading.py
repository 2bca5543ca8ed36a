"""Loading the build the ways users do, each in a fresh process, then calling every op and the
layer; and every CPU level's runtime loads and agrees with the default on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_testing import REPO, backend_kwargs, local_kernels_env

PKG = REPO / "packages" / "ggml-gated-delta-net"

CALL_EVERY_OP = """
import json, torch
torch.manual_seed(0)
q, kk, v = torch.randn(1, 5, 2, 64), torch.randn(1, 5, 2, 64), torch.randn(1, 5, 4, 64)
g, beta = k.gates(torch.randn(4), torch.randn(1, 5, 4), torch.randn(4), torch.randn(1, 5, 4))
o, s = k.gated_delta_net(q, kk, v, g, beta, l2_normalize_qk=True)
y, cs = k.causal_conv1d(torch.randn(1, 96, 5), torch.randn(96, 1, 4))
res = {
    "gdn": [list(o.shape), list(s.shape)],
    "o": o.flatten()[:64].tolist(),
    "conv": [list(y.shape), list(cs.shape)],
    "l2": list(k.l2_norm(q).shape),
    "norm": list(k.gated_rms_norm(o, o, torch.ones(64)).shape),
    "layer": k.layers.Qwen3_5GatedDeltaNet.__name__,
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
    assert res["gdn"] == [[1, 5, 4, 64], [1, 4, 64, 64]]
    assert res["conv"] == [[1, 96, 5], [1, 96, 4]]
    assert res["l2"] == [1, 5, 2, 64] and res["norm"] == [1, 5, 4, 64]
    assert res["layer"] == "Qwen3_5GatedDeltaNet"


def test_get_kernel_with_local_kernels():
    res = run_fresh(
        f"""
        import kernels
        k = kernels.get_kernel("ggml-org/ggml-gated-delta-net", version=1, **{backend_kwargs()!r})
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
def test_every_cpu_level_loads_and_agrees(gdn, level):
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
    q, kk, v = torch.randn(1, 5, 2, 64), torch.randn(1, 5, 2, 64), torch.randn(1, 5, 4, 64)
    g, beta = gdn.gates(torch.randn(4), torch.randn(1, 5, 4), torch.randn(4), torch.randn(1, 5, 4))
    here = gdn.gated_delta_net(q, kk, v, g, beta, l2_normalize_qk=True)[0].flatten()[:64]
    there = torch.tensor(res["o"])
    # SIMD levels differ only in float32 summation order inside the dot products
    assert (here - there).abs().max().item() <= 1e-5 * here.abs().max().item()

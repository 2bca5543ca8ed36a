"""Loading the build the ways users do, each in a fresh process, then calling every op and the
layer; and every CPU level's runtime loads and agrees with the default on this machine."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import CPU_LEVELS, run_fresh

REPO_ID = "ggml-org/ggml-gated-delta-net"

CALL_EVERY_OP = """
import torch
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
"""


def check(res: dict) -> None:
    assert res["gdn"] == [[1, 5, 4, 64], [1, 4, 64, 64]]
    assert res["conv"] == [[1, 96, 5], [1, 96, 4]]
    assert res["l2"] == [1, 5, 2, 64] and res["norm"] == [1, 5, 4, 64]
    assert res["layer"] == "Qwen3_5GatedDeltaNet"


def test_get_kernel_with_local_kernels():
    check(run_fresh(REPO_ID, CALL_EVERY_OP))


def test_get_local_kernel():
    check(run_fresh(REPO_ID, CALL_EVERY_OP, via="get_local_kernel"))


@pytest.mark.parametrize("level", CPU_LEVELS)
def test_every_cpu_level_loads_and_agrees(gdn, level):
    res = run_fresh(REPO_ID, CALL_EVERY_OP, via="get_local_kernel", level=level)
    assert res["info"]["cpu_variant"] == level
    check(res)
    torch.manual_seed(0)
    q, kk, v = torch.randn(1, 5, 2, 64), torch.randn(1, 5, 2, 64), torch.randn(1, 5, 4, 64)
    g, beta = gdn.gates(torch.randn(4), torch.randn(1, 5, 4), torch.randn(4), torch.randn(1, 5, 4))
    here = gdn.gated_delta_net(q, kk, v, g, beta, l2_normalize_qk=True)[0].flatten()[:64]
    there = torch.tensor(res["o"])
    # SIMD levels differ only in float32 summation order inside the dot products
    assert (here - there).abs().max().item() <= 1e-5 * here.abs().max().item()

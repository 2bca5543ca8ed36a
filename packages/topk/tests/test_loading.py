"""Loading the build the ways users do, each in a fresh process, then calling every function; and the
baseline x86-64 code path (GGML_KERNELS_CPU_VARIANT=x64 also turns off our AVX2 exp) giving the same
bits as the default one."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import run_fresh

REPO_ID = "transformers-community/topk"

CALL_EVERY_FUNCTION = """
import torch
torch.manual_seed(0)
x = torch.randn(37, 256) * 3
w, i = k.softmax_top_k(x, 8)
w1, i1 = k.top_k(x.bfloat16(), 2, softmax=False)
wg, ig = k.top_k_ggml(x, 4, True, True)
res = {
    "w": w.tolist(), "i": i.tolist(),
    "top_k": [list(w1.shape), str(w1.dtype), str(i1.dtype)],
    "ggml": list(wg.shape),
    "layer": k.layers.SoftmaxTopKRouter.__name__,
    "info": k.info(),
}
"""


def check(res: dict) -> None:
    assert len(res["w"]) == 37 and len(res["i"][0]) == 8
    assert res["top_k"] == [[37, 2], "torch.bfloat16", "torch.int64"]
    assert res["ggml"] == [37, 4]
    assert res["layer"] == "SoftmaxTopKRouter"
    torch.manual_seed(0)
    x = torch.randn(37, 256) * 3
    v, i = torch.topk(torch.softmax(x, -1), 8)
    assert torch.equal(torch.tensor(res["i"]), i)
    torch.testing.assert_close(torch.tensor(res["w"]), v / v.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


def test_get_kernel_with_local_kernels():
    check(run_fresh(REPO_ID, CALL_EVERY_FUNCTION))


def test_get_local_kernel():
    check(run_fresh(REPO_ID, CALL_EVERY_FUNCTION, via="get_local_kernel"))


@pytest.mark.parametrize("level", ["x64", "haswell"])
def test_cpu_levels_agree_bit_for_bit(tk, level):
    """The exp runs as baseline SSE2 code or as AVX2 code with the same arithmetic and summation
    order: the same weights to the bit."""
    res = run_fresh(REPO_ID, CALL_EVERY_FUNCTION, via="get_local_kernel", level=level)
    assert res["info"]["cpu_variant"] == level
    check(res)
    torch.manual_seed(0)
    w, i = tk.softmax_top_k(torch.randn(37, 256) * 3, 8)
    assert torch.equal(torch.tensor(res["w"]), w) and torch.equal(torch.tensor(res["i"]), i)

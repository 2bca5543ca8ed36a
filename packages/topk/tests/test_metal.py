"""topk on Metal: each Metal build (tools/testing/builds.py: metal-emu, mps-emu; loaded as users
would) against the CPU build and the reference, every op under both lane schedules of the emulator
(metal_builds.both_schedules: bit-identical results required), with the kernels upstream chose."""

from __future__ import annotations

import pytest
import torch

from tools.testing import metal_checks
from tools.testing.metal_builds import both_schedules

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_emulated_build_loads_and_carries_no_ggml_cpu(metal_emu, tk):
    metal_checks.assert_emulated_build_has_no_ggml_cpu(metal_emu, tk)


@pytest.mark.parametrize(("experts", "k", "fused"), [(8, 2, True), (64, 8, True), (1024, 4, True), (2048, 4, False)])
@pytest.mark.parametrize(("softmax", "normalize"), [(True, False), (True, True), (False, False)])
def test_top_k_routing(metal, tk, experts, k, fused, softmax, normalize):
    """llama.cpp's routing graph; upstream fuses it into kernel_topk_moe_f32 (softmax, <= 1024
    experts). Against the CPU build's ggml routing and torch in float64 (the same chosen experts:
    random float32 logits have no ties): weights within 2^-21 relative (float32 exp and sums in
    another order; observed < 2e-7)."""
    g = torch.Generator().manual_seed(experts + k)
    x = 3 * torch.randn(5, experts, generator=g)
    (w, i), kernels = both_schedules(metal, metal.ops.top_k, x, k, softmax, normalize, None, None)
    assert ("kernel_topk_moe_f32" in kernels) == (fused and softmax), kernels
    w_cpu, i_cpu = tk.ops.top_k_ggml(x, k, softmax, normalize)
    assert torch.equal(i, i_cpu) and i.dtype == torch.int64
    p = torch.softmax(x.double(), -1) if softmax else x.double()
    want_w, want_i = torch.topk(p, k)
    if normalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(i, want_i)
    for got in (w, w_cpu):
        assert ((got.double() - want_w).abs() <= 2.0**-21 * want_w.abs()).all()


def test_top_k_ties_and_dtypes(metal):
    """Tied logits: the weights are the k largest (which tied expert comes first is the kernel's);
    weights in the asked dtype, int32 indices on request; the Python API's n-D rows."""
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 2.0]]).repeat(2, 3, 1)
    w, i = metal.softmax_top_k(x, 4, dtype=torch.float16, index_dtype=torch.int32)
    assert w.shape == (2, 3, 4) and w.dtype == torch.float16 and i.dtype == torch.int32
    chosen = torch.gather(x, -1, i.long())
    assert torch.equal(chosen.sort(-1, descending=True).values, torch.topk(x, 4).values)
    top = torch.topk(torch.softmax(x, -1), 4).values
    torch.testing.assert_close(w, (top / top.sum(-1, keepdim=True)).half(), rtol=2.0**-10, atol=0)


def test_top_k_bad_rows_raise_as_the_cpu_build(metal, tk):
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    for module in (metal, tk):
        with pytest.raises(ValueError, match="logits contain NaN"):
            module.ops.top_k(x, 2, True, False, None, None)
    x = torch.full((2, 8), float("-inf"))
    with pytest.raises(ValueError, match="is -inf: softmax is undefined"):
        metal.ops.top_k(x, 2, True, False, None, None)

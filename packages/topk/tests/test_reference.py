"""The pure-PyTorch reference itself: it is transformers' router arithmetic (bit for bit where no
infinity is involved) plus the defined behaviour at the edges."""

from __future__ import annotations

import pytest
import torch


def eager_router(logits, k, norm):
    p = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    if norm:
        v /= v.sum(dim=-1, keepdim=True)
    return v.to(logits.dtype), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
def test_reference_is_transformers_router_arithmetic(tk, dtype, norm):
    x = (torch.randn(50, 128, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    rw, ri = tk.reference.softmax_top_k(x, 8, norm)
    ew, ei = eager_router(x, 8, norm)
    assert torch.equal(ri, ei) and torch.equal(rw, ew)


def test_reference_router_forward(tk):
    h, w = torch.randn(5, 32), torch.randn(16, 32)
    logits, rw, ri = tk.reference.router_forward(h, w, 4)
    assert torch.equal(logits, h @ w.T)
    ew, ei = eager_router(logits, 4, True)
    assert torch.equal(ri, ei) and torch.equal(rw, ew)


def test_reference_softmax_limit(tk):
    x = torch.tensor([[1.0, float("inf"), float("inf"), 0.0], [1.0, 2.0, 3.0, float("-inf")]])
    p = tk.reference.softmax(x)
    torch.testing.assert_close(p[0], torch.tensor([0.0, 0.5, 0.5, 0.0]))
    torch.testing.assert_close(p[1], torch.softmax(x[1], -1))


def test_reference_top_k_ggml_orders_ties_by_index(tk):
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    w, i = tk.reference.top_k_ggml(x, 3, softmax=False)
    assert i.tolist() == [[1, 2, 4]]

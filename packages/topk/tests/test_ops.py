"""topk's CPU op against the pure-PyTorch reference and against torch.softmax / torch.topk.

Tolerances:
- indices: exact, ties included. The kernel chooses among tied experts with the same standard
  library algorithm and comparisons torch.topk uses on the CPU (test_ties_* below).
- weights: float32 softmax agrees with torch's to a few ulp (both exponentiate in float32 with
  their own exp and scale by the reciprocal of a float32 sum, in different summation orders):
  rtol 1e-5. In bf16 / f16 the weights are those float32 values rounded once, so they equal the
  reference's bit for bit except where the float32 values straddle a rounding boundary: one ulp of
  the output dtype.
"""

from __future__ import annotations

import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS = [1, 3, 512]
EXPERTS = [8, 64, 128, 256, 512]
KS = [1, 2, 8, 16]
DT_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10, "atol": 1e-6}


def logits_for(tokens, experts, dtype, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed * 7919 + tokens * 31 + experts)
    return (torch.randn(tokens, experts, generator=g) * scale).to(dtype)


def eager_router(logits, k, norm):
    """transformers' Qwen MoE router after its linear, verbatim in behaviour."""
    p = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    if norm:
        v /= v.sum(dim=-1, keepdim=True)
    return v.to(logits.dtype), i


def cases():
    for e in EXPERTS:
        for k in KS:
            if k <= e:
                yield e, k


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("experts,k", list(cases()))
@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "no_renorm"])
def test_softmax_top_k(tk, dtype, tokens, experts, k, norm):
    x = logits_for(tokens, experts, dtype)
    w, i = tk.softmax_top_k(x, k, norm)
    rw, ri = tk.reference.softmax_top_k(x, k, norm)
    ew, ei = eager_router(x, k, norm)
    assert w.shape == i.shape == (tokens, k)
    assert w.dtype == dtype and i.dtype == torch.int64
    assert torch.equal(i, ri) and torch.equal(i, ei)
    torch.testing.assert_close(w, rw, **tol(dtype))
    torch.testing.assert_close(w, ew, **tol(dtype))
    if norm:
        torch.testing.assert_close(w.float().sum(-1), torch.ones(tokens), rtol=0, atol=k * 2e-3 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("experts,k", list(cases()))
@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "raw"])
def test_top_k(tk, dtype, tokens, experts, k, softmax):
    x = logits_for(tokens, experts, dtype, seed=1)
    w, i = tk.top_k(x, k, softmax)
    rw, ri = tk.reference.top_k(x, k, softmax)
    assert w.dtype == dtype and i.dtype == torch.int64
    assert torch.equal(i, ri)
    if softmax:
        tv, ti = torch.topk(torch.softmax(x, -1, dtype=torch.float), k)
        assert torch.equal(i, ti)
        torch.testing.assert_close(w, rw, **tol(dtype))
        torch.testing.assert_close(w, tv.to(dtype), **tol(dtype))
    else:  # the logits' own values: exact
        tv, ti = torch.topk(x, k)
        assert torch.equal(i, ti) and torch.equal(w, tv) and torch.equal(w, rw)


# ---- ties ---------------------------------------------------------------------------------------
# torch.topk on the CPU does not put tied values lowest index first: it runs std::partial_sort
# (k * 64 <= E) or std::nth_element + std::sort (otherwise), and ties come out wherever those leave
# them (all-equal rows of 8 give [4, 7, 6, 5, 2, 1, 0, 3] for k = 8). The kernel runs the same
# algorithms with the same comparisons whenever the k + 1 largest values are not all distinct.


def test_torch_topk_tie_order_is_not_by_index():
    """The fact the kernel reproduces (if torch ever changes it, the tie tests below say so)."""
    _, i = torch.topk(torch.zeros(1, 8), 8)
    assert i.tolist() != list(range(8))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("experts,k", list(cases()))
@pytest.mark.parametrize("levels", [1, 2, 4, 50])
def test_ties_match_torch(tk, dtype, experts, k, levels):
    g = torch.Generator().manual_seed(experts * 100 + k * 10 + levels)
    x = torch.randint(0, levels, (64, experts), generator=g).to(dtype)
    # raw values
    w, i = tk.top_k(x, k, softmax=False)
    tw, ti = torch.topk(x, k)
    assert torch.equal(i, ti) and torch.equal(w, tw)
    # after softmax (equal logits -> equal probabilities), renormalised or not
    for norm in (True, False):
        w, i = tk.softmax_top_k(x, k, norm)
        ew, ei = eager_router(x, k, norm)
        assert torch.equal(i, ei)
        torch.testing.assert_close(w, ew, **tol(dtype))


def test_all_zero_router(tk):
    """A router whose weight is still zero (transformers initialises it so): every expert ties."""
    for e, k in cases():
        x = torch.zeros(3, e)
        w, i = tk.softmax_top_k(x, k)
        ew, ei = eager_router(x, k, True)
        assert torch.equal(i, ei)
        torch.testing.assert_close(w, torch.full_like(w, 1.0 / k))


# ---- shapes, dtypes, layouts ---------------------------------------------------------------------


def test_leading_dims_and_1d(tk):
    x = logits_for(6, 64, torch.float32).view(2, 3, 64)
    w, i = tk.softmax_top_k(x, 8)
    assert w.shape == i.shape == (2, 3, 8)
    rw, ri = tk.softmax_top_k(x.reshape(6, 64), 8)
    assert torch.equal(w.reshape(6, 8), rw) and torch.equal(i.reshape(6, 8), ri)
    w1, i1 = tk.top_k(x[0, 0], 4, softmax=False)
    assert w1.shape == (4,) and torch.equal(i1, torch.topk(x[0, 0], 4).indices)


def test_zero_tokens(tk):
    w, i = tk.softmax_top_k(torch.empty(0, 64), 8)
    assert w.shape == i.shape == (0, 8)


def test_k_equals_experts(tk):
    x = logits_for(5, 16, torch.float32)
    w, i = tk.softmax_top_k(x, 16, False)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    assert torch.equal(i, torch.topk(x, 16).indices)


def test_large_k_beyond_fast_path(tk):
    """k > 16 takes torch's algorithm for every row; still exact."""
    x = logits_for(40, 512, torch.bfloat16)
    for k in (17, 64, 512):
        w, i = tk.softmax_top_k(x, k)
        ew, ei = eager_router(x, k, True)
        assert torch.equal(i, ei)
        torch.testing.assert_close(w, ew, **tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_out_dtype_and_int32_indices(tk, dtype):
    x = logits_for(9, 128, dtype)
    w, i = tk.softmax_top_k(x, 8, dtype=torch.float32, index_dtype=torch.int32)
    assert w.dtype == torch.float32 and i.dtype == torch.int32
    rw, ri = tk.reference.softmax_top_k(x, 8, dtype=torch.float32)
    assert torch.equal(i.long(), ri)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-7)
    # float32 weights rounded to the logits' dtype are the default weights, bit for bit
    w2, _ = tk.softmax_top_k(x, 8)
    assert torch.equal(w.to(dtype), w2)


def test_strided_rows(tk):
    big = logits_for(10, 256, torch.float32)
    x = big[::2, :128]  # strided rows, dense last dim: read in place
    assert torch.equal(tk.softmax_top_k(x, 8)[1], tk.softmax_top_k(x.contiguous(), 8)[1])
    xt = logits_for(64, 10, torch.float32).t()  # dense first dim: copied
    assert torch.equal(tk.softmax_top_k(xt, 8)[1], eager_router(xt, 8, True)[1])


def test_threads_agree(tk):
    """Token rows split over torch's threads give the same bits as one thread."""
    x = logits_for(2048, 128, torch.float32)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tk.softmax_top_k(x, 8)
        torch.set_num_threads(max(2, old))
        many = tk.softmax_top_k(x, 8)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_batch_independent(tk):
    """A token's routing does not depend on the other tokens in the batch (decode == prefill)."""
    x = logits_for(300, 256, torch.float32)
    w, i = tk.softmax_top_k(x, 8)
    for t in (0, 17, 299):
        w1, i1 = tk.softmax_top_k(x[t : t + 1], 8)
        assert torch.equal(w1[0], w[t]) and torch.equal(i1[0], i[t])


def test_large_logits(tk):
    """Logits far apart: weights that underflow are 0, never NaN; the top ones are exact."""
    x = torch.tensor([[0.0, -200.0, 100.0, 99.0, -50.0, 98.0, 1.0, 3.0],
                      [0.0, -200.0, 100.0, 99.0, -1e30, 1e30, 1e30 - 1e24, 3.0]])
    w, i = tk.softmax_top_k(x, 4, False)
    ew, ei = eager_router(x, 4, False)
    assert torch.equal(i, ei)  # row 2: one expert takes all, the rest tie at 0 (torch's order)
    torch.testing.assert_close(w, ew)
    assert w[1].tolist() == [1.0, 0.0, 0.0, 0.0]


# ---- infinities ----------------------------------------------------------------------------------


def test_pos_inf_is_softmax_limit(tk):
    x = torch.tensor([[0.0, float("inf"), 1.0, float("inf"), -float("inf"), 5.0]])
    w, i = tk.top_k(x, 3)
    rw, ri = tk.reference.top_k(x, 3)
    assert torch.equal(i, ri)
    assert sorted(i[0, :2].tolist()) == [1, 3]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5, 0.0]]))
    torch.testing.assert_close(w, rw)
    w, i = tk.softmax_top_k(x, 3)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5, 0.0]]))
    w, i = tk.top_k(x, 3, softmax=False)  # raw: torch.topk itself
    tw, ti = torch.topk(x, 3)
    assert torch.equal(w, tw) and torch.equal(i, ti)


def test_neg_inf_masks_experts(tk):
    x = torch.full((2, 16), -float("inf"))
    x[0, 3], x[0, 9], x[1, 0] = 1.0, 2.0, 0.0
    w, i = tk.softmax_top_k(x, 2, False)
    assert i[0].tolist() == [9, 3]
    torch.testing.assert_close(w[0], torch.softmax(torch.tensor([2.0, 1.0]), -1))
    assert i[1, 0].item() == 0 and w[1].tolist() == [1.0, 0.0]
    assert 0 <= i[1, 1].item() < 16
    rw, ri = tk.reference.softmax_top_k(x, 2, False)
    assert torch.equal(i, ri) and torch.equal(w, rw)


# ---- the ggml graph variant ----------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("experts,k", list(cases()))
@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "no_renorm"])
def test_top_k_ggml(tk, tokens, experts, k, norm):
    """ggml's soft_max_ext / top_k / get_rows / sum_rows / div: float32 logits without ties agree
    with the reference (ggml's exp is its own: weights to 1e-5)."""
    x = logits_for(tokens, experts, torch.float32, seed=2)
    w, i = tk.top_k_ggml(x, k, True, norm)
    rw, ri = tk.reference.top_k_ggml(x, k, True, norm)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-7)
    w, i = tk.top_k_ggml(x, k, False)
    tw, ti = torch.topk(x, k)
    assert torch.equal(i, ti) and torch.equal(w, tw)


# ---- torch.compile -------------------------------------------------------------------------------


def test_torch_compile_fullgraph(tk):
    def route(x):
        w, i = tk.softmax_top_k(x, 8)
        return w * 2, i

    compiled = torch.compile(route, fullgraph=True, backend="eager")
    for t in (1, 5, 64):
        x = logits_for(t, 128, torch.bfloat16)
        w, i = compiled(x)
        ew, ei = route(x)
        assert torch.equal(w, ew) and torch.equal(i, ei)


def test_opcheck(tk):
    """torch.library's own consistency checks of schema, fake impl and the CPU kernel."""
    x = logits_for(4, 64, torch.float32)
    torch.library.opcheck(tk.ops.top_k.default, (x, 8, True, True, None, None))
    torch.library.opcheck(tk.ops.top_k.default, (x.bfloat16(), 2, False, False, torch.float32, torch.int32))
    torch.library.opcheck(tk.ops.top_k_ggml.default, (x, 8, True, True))

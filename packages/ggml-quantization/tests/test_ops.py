"""ggml-quantization's CPU kernels against the pure-PyTorch reference and gguf-py.

Tolerances:
- dequantize / get_rows: exact. Both sides decode the same bits with the same float operations
  (ggml's to_float vs a reference that is bit-exact with gguf-py).
- mul_mat*: the kernel quantizes activations to the weight type's vec_dot_type (Q8_0/Q8_1/Q8_K) as
  llama.cpp does, which moves results by ~0.5-1 % of their scale. Against the reference's emulation
  of that step the remaining differences are float32 summation order (~1e-6 relative) plus a rare
  1-unit flip of an activation value where ggml's SIMD quantizer (x * (127/amax)) and the scalar one
  (x / (amax/127)) round a near-tie differently: one flip moves a result by d_x * |w| ~ |y| / 127 / K.
  MATMUL_RTOL = 2e-3 of the output scale covers a few flips; without emulation errors are ~1e-2.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tools.testing.kernel_testing import run_fresh

MATMUL_RTOL = 2e-3
ROWS = 37  # odd on purpose


def cols_for(gq, t: int) -> int:
    block = gq.TYPE_INFO[gq.GGMLType(t)].block_size
    return 512 if block == 256 else 3 * block if block > 1 else 97


def make_weights(gq, t: int, rows: int = ROWS, cols: int | None = None, seed: int = 0):
    cols = cols or cols_for(gq, t)
    g = torch.Generator().manual_seed(seed + t)
    w = torch.randn(rows, cols, generator=g)
    imatrix = torch.rand(cols, generator=g) + 0.5 if t in gq.IMATRIX_TYPES else None
    return gq.quantize(w, t, imatrix), cols


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() or 1.0
    return (out.double() - ref.double()).abs().max().item() / scale


# Storage type ids, listed here so parametrisation needs no build at collection time (the first test
# checks the package agrees).
TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29, 30, 34, 35, 39, 40, 41, 42]
_EXTRA_NAMES = {40: "NVFP4", 41: "Q1_0", 42: "Q2_0"}  # newer than gguf-py 0.19.0's enum
TYPE_IDS = {t: _EXTRA_NAMES.get(t) or gguf.GGMLQuantizationType(t).name for t in TYPES}


def test_storage_types_match_package(gq):
    assert sorted(gq.STORAGE_TYPES) == TYPES
    assert gq.GEMV_TYPES == gq.STORAGE_TYPES
    assert gq.MAX_GEMV_ROWS == 8


def test_runtime_info(gq):
    info = gq.info()
    from tools.testing.kernel_testing import CPU_LEVELS

    assert info["cpu_variant"] in CPU_LEVELS
    assert info["ggml"].startswith("0.25.3")


# ---------------------------------------------------------------------------------------------
# dequantize / get_rows


@pytest.mark.parametrize("t", TYPES, ids=lambda t: TYPE_IDS[t])
def test_dequantize_matches_reference_exactly(gq, t):
    blocks, cols = make_weights(gq, t)
    out = gq.dequantize(blocks, t, ROWS, cols, torch.float32)
    ref = gq.reference.dequantize(blocks, t, ROWS, cols, torch.float32)
    assert out.shape == (ROWS, cols) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("t", [t for t in TYPES if t not in (41, 42)], ids=lambda t: TYPE_IDS[t])
def test_dequantize_matches_gguf_py_bit_for_bit(gq, t):
    blocks, cols = make_weights(gq, t, rows=5)
    out = gq.dequantize(blocks, t, 5, cols, torch.float32)
    ref = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(t))
    np.testing.assert_array_equal(out.numpy(), ref.astype(np.float32).reshape(5, cols))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [0, 1, 8, 12, 14, 20, 30], ids=lambda t: TYPE_IDS[t])
def test_dequantize_dtypes(gq, t, dtype):
    blocks, cols = make_weights(gq, t)
    out = gq.dequantize(blocks, t, ROWS, cols, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, gq.reference.dequantize(blocks, t, ROWS, cols, torch.float32).to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: TYPE_IDS[t])
def test_get_rows(gq, t):
    blocks, cols = make_weights(gq, t)
    idx = torch.tensor([5, 0, 36, 5, 17], dtype=torch.int32)
    out = gq.get_rows(blocks, idx, t, cols, torch.float32)
    full = gq.reference.dequantize(blocks, t, ROWS, cols, torch.float32)
    torch.testing.assert_close(out, full[idx.long()], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gq.get_rows(blocks, idx.long(), t, cols, torch.bfloat16), full[idx.long()].bfloat16(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# mat-vec / mat-mat / MoE


@pytest.mark.parametrize("t", TYPES, ids=lambda t: TYPE_IDS[t])
def test_mul_mat_vec_all_rows_1_to_8(gq, t):
    blocks, cols = make_weights(gq, t)
    g = torch.Generator().manual_seed(1)
    for m in range(1, 9):
        x = torch.randn(m, cols, generator=g)
        out = gq.mul_mat_vec(blocks, x, t, ROWS)
        assert out.shape == (m, ROWS) and out.dtype == torch.float32
        ref = gq.reference.mul_mat_emulated(blocks, x, t, ROWS)
        assert rel_err(out, ref) < MATMUL_RTOL, (m, rel_err(out, ref))


@pytest.mark.parametrize("m", [9, 17, 64, 133])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: TYPE_IDS[t])
def test_mul_mat_larger_m(gq, t, m):
    """ggml's own path (`exact=True`; the dense one for block-32 types: test_dense_prefill.py)."""
    blocks, cols = make_weights(gq, t)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    out = gq.mul_mat(blocks, x, t, ROWS, exact=True)
    ref = gq.reference.mul_mat_emulated(blocks, x, t, ROWS)
    assert rel_err(out, ref) < MATMUL_RTOL


# NaN in an activation row (README, Semantics): with a quantized weight ggml first converts the row to
# 8 bits (Q8_0 / Q8_1 / Q8_K), whose block maximum skips NaN on most code paths, so the row's outputs
# are finite numbers without meaning, or NaN, by type, CPU level and the NaN's place (Q8_K, the K- and
# IQ-quants' activation type: finite on every level); float weights give NaN. Other rows are not
# touched, and llama.cpp's own ggml computes the same, values included.
@pytest.mark.parametrize("m", [1, 9])
@pytest.mark.parametrize("t", [0, 1, 30, 2, 3, 8, 12, 14, 16, 20], ids=lambda t: TYPE_IDS[t])
def test_nan_activations_as_ggml(gq, t, m):
    from tools.testing import ggml_ctypes

    blocks, cols = make_weights(gq, t, rows=16)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(5))
    x[0, 5] = float("nan")
    out = gq.mul_mat(blocks, x, t, 16)
    assert torch.equal(out.isnan(), gq.mul_mat_group([blocks], x, [t], [16])[0].isnan())
    if m > 1:
        torch.testing.assert_close(out[1:], gq.mul_mat(blocks, x[1:], t, 16), rtol=1e-6, atol=1e-5)
    vec_dot = gq.type_info(t).vec_dot_type
    if vec_dot in (gq.GGMLType.F32, gq.GGMLType.F16, gq.GGMLType.BF16):
        assert out[0].isnan().all()
    elif vec_dot == gq.GGMLType.Q8_K:
        assert out[0].isfinite().all()
    # llama.cpp's ggml (built for this CPU) takes the same SIMD paths unless the baseline level is forced
    if ggml_ctypes.available() and gq.info()["cpu_variant"] != "x64":
        ref = torch.from_numpy(ggml_ctypes.MulMat(blocks.numpy(), t, cols, m)(x.numpy()))
        assert torch.equal(out.isnan(), ref.isnan())
        torch.testing.assert_close(out[~out.isnan()], ref[~ref.isnan()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [2, 8, 12, 14, 1, 30], ids=lambda t: TYPE_IDS[t])
def test_mul_mat_half_inputs(gq, t, dtype):
    blocks, cols = make_weights(gq, t)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(t)).to(dtype)  # unseeded: 1 run in ~5 over the bound
    for fn in (gq.mul_mat_vec, gq.mul_mat):
        out = fn(blocks, x, t, ROWS)
        assert out.dtype == torch.float32
        ref = gq.reference.mul_mat_emulated(blocks, x.float(), t, ROWS)
        assert rel_err(out, ref) < MATMUL_RTOL


def test_mul_mat_leading_dims(gq):
    blocks, cols = make_weights(gq, 12)
    x = torch.randn(2, 3, cols)
    out = gq.mul_mat(blocks, x, "Q4_K", ROWS)
    assert out.shape == (2, 3, ROWS)
    torch.testing.assert_close(out.view(6, ROWS), gq.mul_mat(blocks, x.view(6, cols), 12, ROWS), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (1, 4, 2), ()], ids=str)
def test_ops_keep_leading_dims(gq, shape):
    """The ops themselves take x (..., K) and return (..., N) with x's leading dims (a decode step's
    (1, 1, K) needs no reshape on either side), equal to the same rows as a 2-D (M, K) matrix."""
    blocks, cols = make_weights(gq, 3, rows=40)
    x = torch.randn(*shape, cols, generator=torch.Generator().manual_seed(len(shape)))
    flat = x.reshape(-1, cols)
    for op in (gq.ops.mul_mat_vec, gq.ops.mul_mat):
        out = op(blocks, x, 3, 40)
        assert out.shape == (*shape, 40)
        torch.testing.assert_close(out.reshape(-1, 40), op(blocks, flat, 3, 40), rtol=0, atol=0)
        assert rel_err(out.reshape(-1, 40), gq.reference.mul_mat_emulated(blocks, flat, 3, 40)) < MATMUL_RTOL
    outs = gq.ops.mul_mat_group([blocks, blocks[:7]], x, [3, 3], [40, 7])
    assert [o.shape for o in outs] == [(*shape, 40), (*shape, 7)]
    torch.testing.assert_close(outs[1].reshape(-1, 7), gq.ops.mul_mat(blocks[:7], flat, 3, 7), rtol=0, atol=0)


def test_mul_mat_real_shape(gq):
    """A Qwen3.5-0.8B-sized projection (1024 -> 3584) in Q4_K, decode and prefill."""
    w = torch.randn(3584, 1024) * 0.02
    blocks = gq.quantize(w, "Q4_K")
    for m in (1, 8, 64):
        x = torch.randn(m, 1024)
        out = gq.mul_mat(blocks, x, "Q4_K", 3584)
        assert rel_err(out, gq.reference.mul_mat_emulated(blocks, x, 12, 3584)) < MATMUL_RTOL


@pytest.mark.parametrize("t", TYPES, ids=lambda t: TYPE_IDS[t])
def test_mul_mat_id(gq, t):
    experts = 5
    parts = [make_weights(gq, t, seed=e) for e in range(experts)]
    blocks = torch.stack([p[0] for p in parts])
    cols = parts[0][1]
    g = torch.Generator().manual_seed(2)
    tokens, top_k = 7, 3
    x = torch.randn(tokens, cols, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int()
    out = gq.mul_mat_id(blocks, x, ids, t, ROWS)
    assert out.shape == (tokens, top_k, ROWS) and out.dtype == torch.float32
    ref = gq.reference.mul_mat_id_emulated(blocks, x, ids, t, ROWS)
    assert rel_err(out, ref) < MATMUL_RTOL
    # transformers' second call: one row per (token, expert) pair, ids (T*top_k, 1), int64 accepted
    x2 = torch.randn(tokens * top_k, cols, generator=g)
    ids2 = ids.reshape(-1, 1).long()
    out2 = gq.mul_mat_id(blocks, x2, ids2, t, ROWS)
    assert out2.shape == (tokens * top_k, 1, ROWS)
    assert rel_err(out2, gq.reference.mul_mat_id_emulated(blocks, x2, ids2, t, ROWS)) < MATMUL_RTOL


def test_mul_mat_id_many_tokens(gq):
    """Enough tokens that ggml takes its grouped (per-expert) path."""
    experts, cols, rows = 8, 256, 64
    blocks = gq.quantize(torch.randn(experts * rows, cols), "Q4_K").view(experts, rows, -1)
    x = torch.randn(300, cols)
    ids = torch.randint(0, experts, (300, 2), dtype=torch.int32)
    out = gq.mul_mat_id(blocks, x, ids, "Q4_K", rows)
    assert rel_err(out, gq.reference.mul_mat_id_emulated(blocks, x, ids, 12, rows)) < MATMUL_RTOL


# From 65 (token, expert) pairs up to 4 per expert on average (a prompt of up to 32 tokens on a top-8
# layer of 64 experts) mul_mat_id groups the pairs by expert and reads each expert's rows once for
# all its tokens (quantization_cpu.cpp, grouped_dot_mul_mat_id): each output is the vec_dot of its
# row alone, as a one-row product gives it, whichever thread and piece computes it; unused experts
# are skipped. Both of transformers' calls: the tokens' top-k, then one row per pair.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("t", [12, 14, 2, 8], ids=lambda t: TYPE_IDS[t])
def test_mul_mat_id_grouped_by_expert_equals_one_row_products(gq, t, threads):
    experts, rows = 40, 72
    blocks = torch.stack([make_weights(gq, t, rows=rows, cols=512, seed=e)[0] for e in range(experts)])
    g = torch.Generator().manual_seed(t)
    x = torch.randn(24, 512, generator=g)
    used = torch.randperm(experts, generator=g)[:30]  # 10 experts get no token
    # 96 pairs; the first expert takes 10 tokens, where ggml's op would run the K-quants' tiled kernel
    ids = torch.stack([torch.cat([used[:1], used[1:][torch.randperm(29, generator=g)[:3]]]) if i < 10
                       else used[torch.randperm(30, generator=g)[:4]] for i in range(24)]).int()
    flat_x = torch.cat([x.repeat_interleave(4, 0), x[:34]])  # one row per pair: 130 pairs
    flat_ids = torch.cat([ids.reshape(-1, 1), ids[:34, :1]])

    def one_row_products(xs, es):
        return torch.stack([gq.mul_mat_vec(blocks[e], r[None], t, rows)[0] for r, e in zip(xs, es, strict=True)])

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = gq.mul_mat_id(blocks, x, ids, t, rows)
        flat = gq.mul_mat_id(blocks, flat_x, flat_ids, t, rows)
        alone = one_row_products(x.repeat_interleave(4, 0), ids.reshape(-1)).view(24, 4, rows)
        flat_alone = one_row_products(flat_x, flat_ids.reshape(-1)).view(-1, 1, rows)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, alone, rtol=0, atol=0)
    torch.testing.assert_close(flat, flat_alone, rtol=0, atol=0)
    assert rel_err(out, gq.reference.mul_mat_id_emulated(blocks, x, ids, t, rows)) < MATMUL_RTOL


# weights of a layer's sibling projections: same columns, different types and row counts (a Q4_K_M
# file's q/k in Q4_K, v in Q6_K; row counts not multiples of anything)
GROUP_TYPES = [(12, 300), (12, 64), (14, 100), (8, 33), (3, 7), (30, 129), (0, 40)]


@pytest.mark.parametrize("m", [1, 2, 8, 9, 128, 129])
def test_mul_mat_group_equals_one_mul_mat_per_weight(gq, m):
    """Bit-identical to mul_mat per weight: the same ggml dot product per output, with one activation
    row (quantized once per dot-product type, every weight's rows in one parallel region), with 2-128
    (every quantized weight's rows in one parallel region, one ggml graph per thread; the float
    weights one product each) and with more (one product per weight); from 32-128 rows by type the
    block-32 weights take mul_mat's dense path (where this CPU has one), in the group as alone."""
    cols = 512
    weights = [make_weights(gq, t, rows=n, cols=cols, seed=n)[0] for t, n in GROUP_TYPES]
    types, rows = [t for t, _ in GROUP_TYPES], [n for _, n in GROUP_TYPES]
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    outs = gq.mul_mat_group(weights, x, types, rows)
    assert len(outs) == len(weights)
    for w, t, n, out in zip(weights, types, rows, outs, strict=True):
        assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
        torch.testing.assert_close(out, gq.mul_mat(w, x, t, n), rtol=0, atol=0)
        if not gq.dense_prefill.applies(w, x, t):  # ggml's 8-bit activations, as the emulation rounds them
            assert rel_err(out, gq.reference.mul_mat_emulated(w, x, t, n)) < MATMUL_RTOL
    exact = gq.mul_mat_group(weights, x, types, rows, exact=True)
    for w, t, n, out in zip(weights, types, rows, exact, strict=True):
        torch.testing.assert_close(out, gq.mul_mat(w, x, t, n, exact=True), rtol=0, atol=0)
    refs = gq.reference.mul_mat_group(weights, x, types, rows)
    for out, ref in zip(outs, refs, strict=True):
        assert rel_err(out, ref) < 2e-2  # the reference multiplies unquantized activations


def test_mul_mat_group_decode_shapes_and_threads(gq):
    """(1, 1, K) activations as a decode step passes them; one and two threads agree; a single weight
    and a weight of one row work; names and half-precision activations are accepted."""
    cols = 576
    weights = [make_weights(gq, 3, rows=n, cols=cols, seed=n)[0] for n in (576, 192, 192, 1)]
    rows = [576, 192, 192, 1]
    x = torch.randn(1, 1, cols)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gq.mul_mat_group(weights, x, ["Q4_1"] * 4, rows)
        torch.set_num_threads(2)
        two = gq.mul_mat_group(weights, x, [3] * 4, rows)
    finally:
        torch.set_num_threads(before)
    for w, n, a, b in zip(weights, rows, one, two, strict=True):
        assert a.shape == (1, 1, n)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, gq.mul_mat_vec(w, x, 3, n), rtol=0, atol=0)
    (single,) = gq.mul_mat_group(weights[:1], x.bfloat16(), [3], rows[:1])
    torch.testing.assert_close(single, gq.mul_mat_vec(weights[0], x.bfloat16(), 3, 576), rtol=0, atol=0)


@pytest.mark.parametrize("m", [2, 4, 8, 16, 31])
def test_mul_mat_group_few_rows_split_over_threads(gq, m):
    """2-128 activation rows (a prompt; Q4_1 up to 31, from 32 on mul_mat's dense path takes it):
    up to 4 the dot products of 1 row (these 360-byte rows), from 5 each weight's rows divided
    equally between the threads (at multiples of 16 rows), each thread one graph of its slices of
    every weight; mul_mat splits a single weight the same way. One and two threads give the same values, grouped or not, also for
    weights that fall wholly to one thread (the 1-row and 16-row ones); the one-thread product of a
    whole weight is ggml's mul_mat graph unsplit (tests/test_ggml_oracle.py holds it to ggml's op)."""
    cols = 576
    rows = [576, 192, 16, 192, 1, 16]
    weights = [make_weights(gq, 3, rows=n, cols=cols, seed=i)[0] for i, n in enumerate(rows)]
    x = torch.randn(1, m, cols, generator=torch.Generator().manual_seed(m))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gq.mul_mat_group(weights, x, ["Q4_1"] * len(rows), rows)
        single_one = [gq.mul_mat(w, x, 3, n) for w, n in zip(weights, rows, strict=True)]
        torch.set_num_threads(2)
        two = gq.mul_mat_group(weights, x, ["Q4_1"] * len(rows), rows)
        single_two = [gq.mul_mat(w, x, 3, n) for w, n in zip(weights, rows, strict=True)]
    finally:
        torch.set_num_threads(before)
    for w, n, a, b, c, d in zip(weights, rows, one, two, single_one, single_two, strict=True):
        assert a.shape == (1, m, n)
        for other in (b, c, d):
            torch.testing.assert_close(other, a, rtol=0, atol=0)
        assert rel_err(a, gq.reference.mul_mat_emulated(w, x.view(m, cols), 3, n).view(1, m, n)) < MATMUL_RTOL


# One activation row runs ggml's vec_dot per weight row without a graph, the weights' rows laid end to
# end and cut into one run of about equal bytes per thread, and one thread below 64 KiB of weights each
# (quantization_cpu.cpp, kDirectDotRows). These row counts (2048 columns: 1152-byte Q4_K rows) land
# on both sides of the second thread's 128 KiB and put the cut at even and odd rows. Every output
# must be computed once, whatever the split: the first row of a 2-row product (the same dot products
# over two rows, held to ggml's graph by test_few_rows_dot_products_equal_ggml_graph) is bit-identical.
@pytest.mark.parametrize("rows", [1, 63, 65, 200, 512, 513, 1000])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("t", [12, 14, 3], ids=lambda t: TYPE_IDS[t])
def test_one_row_split_computes_every_row_once(gq, t, rows, threads):
    blocks, cols = make_weights(gq, t, rows=rows, cols=2048, seed=rows)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(rows))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        one = gq.mul_mat_vec(blocks, x[:1], t, rows)
        two = gq.mul_mat_vec(blocks, x, t, rows)
        (grouped,) = gq.mul_mat_group([blocks], x[:1], [t], [rows])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one[0], two[0], rtol=0, atol=0)
    torch.testing.assert_close(grouped, one, rtol=0, atol=0)
    assert rel_err(one, gq.reference.mul_mat_emulated(blocks, x[:1], t, rows)) < MATMUL_RTOL


# From 2 to 8 activation rows the types ggml-cpu runs on its vec_dot (not llamafile's sgemm) take
# the same dot products without a graph, in 64 KiB pieces of rows per activation row
# (quantization_cpu.cpp, takes_dot_rows: up to 4 rows on rows of under 1 KiB; from 8 rows ggml
# hands the K-quants to its tiled kernel, whose sums differ). Each output is the one ggml's vec_dot
# gives for that row alone, and where the graph takes over (5-7 rows of short rows) its rows are the
# same bits. 2048 columns make rows of 1152-1680 bytes, 256 columns rows of 144-210; 513 rows put
# the threads' cut at an odd row.
@pytest.mark.parametrize("shape_m", [((513, 2048), m) for m in (2, 4, 7, 8)] + [((200, 256), m) for m in (2, 4, 7)],
                         ids=lambda s: f"{s[0][0]}x{s[0][1]}-m{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("t", [12, 14, 3], ids=lambda t: TYPE_IDS[t])
def test_few_rows_dot_products_equal_ggml_graph(gq, t, shape_m, threads):
    (rows, cols), m = shape_m
    blocks, cols = make_weights(gq, t, rows=rows, cols=cols, seed=rows + m)
    x = torch.randn(8, cols, generator=torch.Generator().manual_seed(m))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        few = gq.mul_mat_vec(blocks, x[:m], t, rows)
        (grouped,) = gq.mul_mat_group([blocks], x[:m], [t], [rows])
        alone = torch.cat([gq.mul_mat_vec(blocks, x[j : j + 1], t, rows) for j in range(m)])
        seven = gq.mul_mat_vec(blocks, x[:7], t, rows)  # the graph on short rows
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(few, alone, rtol=0, atol=0)
    torch.testing.assert_close(few[:7], seven[:m], rtol=0, atol=0)
    torch.testing.assert_close(grouped, few, rtol=0, atol=0)
    assert rel_err(few, gq.reference.mul_mat_emulated(blocks, x[:m], t, rows)) < MATMUL_RTOL


# From 2 to 8 activation rows the types ggml-cpu hands to llamafile's sgemm (Q4_0, Q5_0, Q8_0, IQ4_NL)
# run that sgemm on pieces of whole 4-row tiles inside the dot products' runs (quantization_cpu.cpp,
# sgemm_rows_range): the same bits as ggml's own op, on 1 and 2 threads. 513 rows leave the last
# piece a single row, 2048 columns make rows the Intel prefetch takes, 9216 columns ones it does not (Q4_0
# 5184 bytes), 256 columns short rows. A Q4_K sibling in the same group's runs keeps its own bits.
@pytest.mark.parametrize("shape", [(513, 2048), (64, 9216), (200, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("t", [2, 6, 8, 20], ids=lambda t: TYPE_IDS[t])
def test_few_rows_sgemm_pieces_equal_ggml_op(gq, t, shape, threads):
    from tools.testing import ggml_ctypes

    if not ggml_ctypes.available() or gq.info()["cpu_variant"] == "x64":
        pytest.skip("llama.cpp's ggml for this CPU is the reference (the baseline level has no sgemm)")
    rows, cols = shape
    blocks, cols = make_weights(gq, t, rows=rows, cols=cols, seed=rows + t)
    q4_k, _ = make_weights(gq, 12, rows=37, cols=cols, seed=t)  # a vec_dot sibling in the same runs
    x = torch.randn(8, cols, generator=torch.Generator().manual_seed(t))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for m in (2, 3, 5, 8):
            few = gq.mul_mat_vec(blocks, x[:m], t, rows)
            grouped, sibling = gq.mul_mat_group([blocks, q4_k], x[:m], [t, 12], [rows, 37])
            ggml = torch.from_numpy(ggml_ctypes.MulMat(blocks.numpy(), t, cols, m, threads)(x[:m].numpy()))
            torch.testing.assert_close(few, ggml.view(m, rows), rtol=0, atol=0)
            torch.testing.assert_close(grouped, few, rtol=0, atol=0)
            torch.testing.assert_close(sibling, gq.mul_mat_vec(q4_k, x[:m], 12, 37), rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)


# At 8 rows the IQ types keep ggml's graph (its tiled kernel decodes each block once for all 8 rows,
# their dot products once per row): the same outputs as ggml's own op, within the reference's
# tolerance, and the dot products' at 7 rows stay the vec_dot's of each row alone.
@pytest.mark.parametrize("t", [23, 21], ids=lambda t: TYPE_IDS[t])
def test_eight_rows_of_iq_types_keep_ggml_graph(gq, t):
    blocks, cols = make_weights(gq, t, rows=64, cols=2048, seed=t)
    x = torch.randn(8, cols, generator=torch.Generator().manual_seed(t))
    eight = gq.mul_mat_vec(blocks, x, t, 64)
    seven = gq.mul_mat_vec(blocks, x[:7], t, 64)
    alone = torch.cat([gq.mul_mat_vec(blocks, x[j : j + 1], t, 64) for j in range(7)])
    torch.testing.assert_close(seven, alone, rtol=0, atol=0)
    assert not torch.equal(eight[:7], seven)  # other sums: the tiled kernel's, not the dot products'
    assert rel_err(eight, gq.reference.mul_mat_emulated(blocks, x, t, 64)) < MATMUL_RTOL


# A group's weights laid end to end: the cut between the two threads' runs falls inside the first
# weight, exactly at the join, or inside the second, and between weights of different row sizes.
@pytest.mark.parametrize("members", [((12, 300), (12, 100)), ((12, 200), (12, 200)), ((12, 100), (12, 300)),
                                     ((12, 100), (14, 300)), ((14, 64), (3, 64), (12, 400))],
                         ids=lambda m: "+".join(f"{TYPE_IDS[t]}x{n}" for t, n in m))
def test_one_row_group_split_computes_every_row_once(gq, members):
    weights = [make_weights(gq, t, rows=n, cols=2048, seed=i)[0] for i, (t, n) in enumerate(members)]
    types, rows = [t for t, _ in members], [n for _, n in members]
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(len(members)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        grouped = gq.mul_mat_group(weights, x, types, rows)
        torch.set_num_threads(1)
        alone = [gq.mul_mat_vec(w, x, t, n) for w, t, n in zip(weights, types, rows, strict=True)]
    finally:
        torch.set_num_threads(before)
    for w, t, n, g, a in zip(weights, types, rows, grouped, alone, strict=True):
        torch.testing.assert_close(g, a, rtol=0, atol=0)
        assert rel_err(g, gq.reference.mul_mat_emulated(w, x, t, n)) < MATMUL_RTOL


def test_thread_count_does_not_change_results(gq):
    blocks, cols = make_weights(gq, 12, rows=256)
    x = torch.randn(4, cols)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gq.mul_mat(blocks, x, 12, 256)
        torch.set_num_threads(2)
        two = gq.mul_mat(blocks, x, 12, 256)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_empty_inputs(gq):
    blocks, cols = make_weights(gq, 8)
    assert gq.mul_mat_vec(blocks, torch.empty(0, cols), 8, ROWS).shape == (0, ROWS)
    assert gq.get_rows(blocks, torch.empty(0, dtype=torch.int32), 8, cols, torch.float32).shape == (0, cols)
    assert gq.dequantize(blocks[:0], 8, 0, cols, torch.float32).shape == (0, cols)
    assert gq.quantize(torch.empty(0, cols), 8).shape == (0, blocks.shape[1])
    assert [o.shape for o in gq.mul_mat_group([blocks, blocks], torch.empty(0, cols), [8, 8], [ROWS, ROWS])] == [
        (0, ROWS), (0, ROWS)]
    e = torch.stack([blocks, blocks])
    assert gq.mul_mat_id(e, torch.empty(0, cols), torch.empty(0, 2, dtype=torch.int32), 8, ROWS).shape == (0, 2, ROWS)


# ---------------------------------------------------------------------------------------------
# quantize

GGUF_PY_QUANTIZERS = [2, 3, 6, 7, 8, 30, 34, 35, 39]


@pytest.mark.parametrize("t", GGUF_PY_QUANTIZERS, ids=lambda t: TYPE_IDS[t])
def test_quantize_bytes_equal_gguf_py(gq, t):
    x = torch.randn(9, 3 * 256)
    ours = gq.quantize(x, t)
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType(t))
    np.testing.assert_array_equal(ours.numpy(), theirs)


# Relative RMS round-trip error on N(0, 1) data with ggml's quantizers (deterministic, the same on
# every CPU level): measured on the pinned ggml, bound = 1.25x the measurement. It follows the bits
# per weight, 8.5 (Q8_0) down to 1.1 (Q1_0); the ternary types (TQ*, Q2_0) only suit ternary models.
ROUND_TRIP_BOUND = {
    0: 0, 1: 0.001, 2: 0.108, 3: 0.098, 6: 0.054, 7: 0.048, 8: 0.007, 10: 0.371, 11: 0.188, 12: 0.09, 13: 0.046, 14: 0.023, 16: 0.429, 17: 0.374, 18: 0.267, 19: 0.606, 20: 0.096, 21: 0.208, 22: 0.332, 23: 0.096, 29: 0.725, 30: 0.003, 34: 1.006, 35: 1.006, 39: 0.145, 40: 0.12, 41: 0.752, 42: 0.895,
}


@pytest.mark.parametrize("t", TYPES, ids=lambda t: TYPE_IDS[t])
def test_quantize_round_trip_error(gq, t):
    cols = 1024
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(3))
    im = torch.ones(cols) if t in gq.IMATRIX_TYPES else None
    q = gq.quantize(x, t, im)
    assert q.dtype == torch.uint8 and q.shape == (64, gq.row_bytes(t, cols))
    back = gq.dequantize(q, t, 64, cols, torch.float32)
    err = ((back - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
    assert err <= ROUND_TRIP_BOUND[t], err


def test_quantize_imatrix_required(gq):
    with pytest.raises(ValueError, match="importance matrix"):
        gq.quantize(torch.randn(2, 256), "IQ2_XXS")
    with pytest.raises(ValueError, match="imatrix must be 1-D with 256"):
        gq.quantize(torch.randn(2, 256), "IQ2_XXS", torch.ones(128))


def test_quantize_rejects_nan(gq):
    x = torch.randn(2, 256)
    x[1, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gq.quantize(x, "Q4_K")


# ggml's grid-search quantizers abort the process on finite inputs or importances beyond float32's
# reach in their search; quantize refuses those above 2^32 first (the limit and the fuzzing behind it:
# quantization_cpu.cpp, README). Run in a fresh process: a regression would end it, not this one.
GRID_SEARCH_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]


def test_quantize_probe_inputs_are_refused_not_aborted():
    res = run_fresh("ggml-org/ggml-quantization", """
        import os, torch
        os.environ["GGML_NO_BACKTRACE"] = "1"  # an abort ends the process at once
        spike = torch.zeros(1, 256)
        spike[0, 5] = 1e30
        calls = [lambda: k.quantize(torch.full((1, 256), 3.4028234e38), "IQ1_S", torch.ones(256)),
                 lambda: k.quantize(spike, "IQ3_XXS"),
                 lambda: k.quantize(torch.randn(1, 256), "IQ2_XXS", torch.full((256,), 1e30))]
        res = []
        for call in calls:
            try:
                call()
                res.append("accepted")
            except ValueError as e:
                res.append(str(e))
    """)
    assert "IQ1_S quantization takes |x| <= 2^32" in res[0] and "x holds 3.40282e+38" in res[0], res
    assert "IQ3_XXS quantization takes |x| <= 2^32" in res[1] and "x holds 1e+30" in res[1], res
    assert "IQ2_XXS quantization takes imatrix values <= 2^32" in res[2], res


def test_quantize_grid_search_types_fuzzed():
    """300 rows per type, constant, gaussian, spiky and all-magnitude, with importances of the same
    kinds, half of them near the 2^32 limit and the rest anywhere in float32's range: each is refused
    exactly when it holds a value above the limit, and quantized otherwise (never an abort)."""
    res = run_fresh("ggml-org/ggml-quantization", f"""
        import os, torch
        os.environ["GGML_NO_BACKTRACE"] = "1"  # an abort ends the process at once
        limit, fmax = 2.0**32, torch.finfo(torch.float32).max
        g = torch.Generator().manual_seed(0)

        def scale(lo=-20, hi=129):  # 2^e, half the time within 2^4 of the limit
            near = torch.rand((), generator=g) < 0.5
            return 2.0 ** float(torch.randint(28, 37, (), generator=g) if near else torch.randint(lo, hi, (), generator=g))

        def row(kind, top):
            n = torch.randn(256, generator=g, dtype=torch.float64)
            spikes, full = torch.rand(256, generator=g) < 0.03, n.new_full((256,), top)
            return [full, n * top / 4, torch.where(spikes, full, n), torch.where(spikes, full, 0.0),
                    full * 2.0 ** (-60 * torch.rand(256, generator=g, dtype=torch.float64))][kind]

        res = {{}}
        for name in {GRID_SEARCH_TYPES!r}:
            wrong = []
            for case in range(300):
                x = row(case % 5, scale()) * torch.where(torch.rand(256, generator=g) < 0.5, -1.0, 1.0)
                x = x.clamp(-fmax, fmax).float().view(1, 256)
                im = row((case // 5) % 5, scale(-60)).abs() if case % 7 else torch.ones(256, dtype=torch.float64)
                im = im.clamp(max=fmax).float()
                outside = x.abs().max().item() > limit or im.max().item() > limit
                try:
                    k.quantize(x, name, im)
                    refused = False
                except ValueError:
                    refused = True
                if refused != outside:
                    wrong.append(case)
            res[name] = wrong
    """)
    assert res == {name: [] for name in GRID_SEARCH_TYPES}, res


# ---------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_fullgraph(gq):
    blocks, cols = make_weights(gq, 12)
    experts = torch.stack([blocks, blocks])

    def f(x, ids):
        y = gq.mul_mat_vec(blocks, x, 12, ROWS) + gq.mul_mat(blocks, x, 12, ROWS)
        y = y + sum(gq.mul_mat_group([blocks, blocks], x, [12, 12], [ROWS, ROWS]))
        z = gq.mul_mat_id(experts, x, ids, 12, ROWS).sum(1)
        e = gq.get_rows(blocks, ids[:, 0], 12, cols, torch.float32)
        return y + z, e + gq.dequantize(blocks, 12, ROWS, cols, torch.float32)[:1]

    x = torch.randn(3, cols)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for a, b in zip(compiled(x, ids), f(x, ids), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    def g(x):  # leading dims: the traced (fake) shapes must be the kernels' for these views to trace
        return gq.mul_mat_vec(blocks, x, 12, ROWS).view(2, ROWS), gq.mul_mat_group([blocks], x, [12], [ROWS])[0].view(2, ROWS)

    x3 = torch.randn(1, 2, cols)
    for a, b in zip(torch.compile(g, fullgraph=True, backend="eager")(x3), g(x3), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

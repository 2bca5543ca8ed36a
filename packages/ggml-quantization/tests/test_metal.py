"""ggml-quantization on Metal: each Metal build (tools/testing/builds.py: metal-emu, mps-emu; loaded
as users would) against the CPU build and the references. Every op runs through upstream's Metal host
code (its kernel choice, grid, function constants and threadgroup memory) and its kernels on the
emulated device, under both lane schedules (metal_builds.both_schedules: bit-identical results
required); `metal_dispatches()` shows which kernels upstream chose.

Tolerances, per output element, against `bound` = |x| @ |W|.T (float64; ref = x @ W.T):
- mat-vec (kernel_mul_mv*, 1-8 rows): float32 products summed in float32: at most K * 2^-24 of
  the bound (K = 256: 1.5e-5; observed < 2e-7). TQ2_0's mat-vec is the exception (see TQ2_0_MAT_VEC).
- mat-mat (kernel_mul_mm*, > 8 rows): both tiles are rounded to half in threadgroup memory
  (bfloat for BF16 weights), so each product is off by at most 2^-10 (2^-7) of its magnitude.
- the CPU build quantizes each activation row to 8 bits (Q8_0 / Q8_K, step max|x| / 127) for its
  dot products: it is off the reference by at most sum|w| * max|x| / 254; Metal and CPU agree
  within that plus Metal's own bound.

Weights are tested at three scales (WEIGHT_STDS): unit (randn), a trained model's (std 0.02) and a
small one (0.002). The last two show a rounding of upstream's dequantizers of Q4_0, Q4_1 and Q4_K
(dequantize.h), which the kernels that dequantize a tile first use (dequantize, get_rows,
mat-vec-ext, mat-mat; the one-row mat-vec kernels scale in float32 and are exact): they take the
block scale of the high nibbles as `d / 16.h`, a half-precision division. Dividing a half by 16 is exact while the quotient is a normal
half (d >= 2^-10); below that it is rounded to a multiple of 2^-24 (half's subnormal step), by
delta = |fp16(d / 16) - d / 16| <= 2^-25. The element is that scale times 16 q (q the 4-bit value,
<= 15) times the sub-block scale s (Q4_K: 6 bits, <= 63; Q4_0 / Q4_1: none, 1), so it is off the
CPU build's by at most delta * 16 * 15 * s: half_scale_error, per block (reached: the largest
differences equal it). At unit scale every d is far above 2^-10 and the dequantizers equal the CPU
build's bit for bit. At std 0.02 Q4_K's d (a sub-block's scale / 63) is ~1e-4: 45 % of its elements
(the high nibbles) differ, by up to ~1 % of their sub-block's largest weight; Q4_0 and Q4_1
(d = max|w| / 8) reach it in blocks whose weights are all below 8 * 2^-10 ~ 0.0078: a quarter of
their elements at std 0.002. A product that dequantizes tiles carries that error times |x|:
|x| @ half_scale_error.T on top of its own bound.
"""

from __future__ import annotations

import pytest
import torch

from tools.testing import metal_checks
from tools.testing.builds import slow_on
from tools.testing.metal_builds import both_schedules

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

K, N = 256, 64
# unit-scale weights, a trained model's (its linear layers' weights have std ~0.02) and small ones
WEIGHT_STDS = [1.0, 0.02, 0.002]
# the fast tier on mps-emu (each call run twice, on the twin and on metal-emu): unit-scale weights and
# a few storage types of each family; the slow tier runs every case on every kind
TWIN_WEIGHT_STDS = [1.0, *(pytest.param(std, marks=slow_on("mps-emu")) for std in WEIGHT_STDS[1:])]
TWIN_FAST_TYPES = {"F16", "Q4_K", "Q8_0", "IQ2_XXS", "MXFP4"}
# The types whose Metal dequantizer divides the block scale in half precision (see the top): packed
# block bytes, and the largest sub-block scale that multiplies d.
HALF_SCALE_BLOCKS = {"Q4_0": (18, 1), "Q4_1": (20, 1), "Q4_K": (144, 63)}
# upstream's supports_op refuses these storage types for every op here (no Metal kernels)
METAL_UNSUPPORTED = {"TQ1_0", "NVFP4"}
# TQ2_0's mat-vec (kernel_mul_mv_tq2_0_f32) sums 2-bit fields as float floors of the packed byte
# against hoisted coefficients (y1 - 4 y0, ...): terms up to 255 |y| that cancel, so its rounding
# error is ~2^8 times the direct sum's (observed 1.8e-5 of the bound; others < 2e-7).
TQ2_0_MAT_VEC = 1e-4
# ggml-metal-ops.cpp's mat-vec-ext rule: float32 activations, K % 128 == 0, and 2-8 rows for these
# types, 4-8 rows for the K-quants listed after them; more rows take the tiled mat-mat.
EXT_FROM_2 = {"F32", "F16", "BF16", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "IQ4_NL"}
EXT_FROM_4 = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}



def storage_types(gq):
    return [t for t, info in gq.types.TYPE_INFO.items() if info.storage]


def quantized(gq, type_name: str, rows: int = N, cols: int = K, seed: int = 0, std: float = 1.0):
    """Random weights (std `std`) quantized by the CPU build, and their float64 dequantization."""
    t = int(gq.types.GGMLType[type_name])
    w = std * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    blocks = gq.quantize(w, t, imatrix=torch.ones(cols))
    return t, blocks, gq.dequantize(blocks, t, rows, cols, torch.float32).double()


def half_scale_error(blocks: torch.Tensor, type_name: str, cols: int) -> torch.Tensor:
    """(rows, cols) float64: how far each element Metal's dequantizer gives may be from the CPU
    build's, delta * 16 * 15 * s of its block (module docstring); zeros for the other types."""
    rows = blocks.shape[0]
    if type_name not in HALF_SCALE_BLOCKS:
        return torch.zeros(rows, cols, dtype=torch.float64)
    block_bytes, largest_scale = HALF_SCALE_BLOCKS[type_name]
    d = blocks.reshape(rows, -1, block_bytes)[..., :2].contiguous().view(torch.float16).float()  # (rows, blocks, 1)
    delta = ((d / 16).half().double() - d.double() / 16).abs()  # (float32 d / 16 is exact)
    per_block = delta * 16 * 15 * largest_scale
    return per_block.expand(rows, per_block.shape[1], cols // per_block.shape[1]).reshape(rows, cols)


def dequantizes_tiles(kernel: str) -> bool:
    """Whether a product kernel dequantizes weight tiles (dequantize.h) before multiplying."""
    return kernel.startswith(("kernel_mul_mv_ext_", "kernel_mul_mm"))


def kernel_type(type_name: str) -> str:
    """ggml's spelling in kernel names: q4_0, q4_K, iq2_xxs, bf16."""
    return type_name.lower().replace("_k", "_K")


def expected_family(type_name: str, rows: int, cols: int) -> str:
    if rows == 1:
        return "kernel_mul_mv_"
    ext = cols % 128 == 0 and rows <= 8 and (type_name in EXT_FROM_2 or (type_name in EXT_FROM_4 and rows >= 4))
    if ext:
        return "kernel_mul_mv_ext_"
    return "kernel_mul_mm_" if rows > 8 else "kernel_mul_mv_"


def metal_tolerance(type_name: str, rows: int, cols: int) -> float:
    if rows > 8:
        return 2.0**-7 if type_name == "BF16" else 2.0**-10
    return TQ2_0_MAT_VEC if type_name == "TQ2_0" else cols * 2.0**-24


def check_product(y, y_cpu, x, dense, tol, weight_error=None):
    """weight_error (N, K): how far the weights Metal's kernel dequantized may be from `dense`
    (half_scale_error); the product of those weights is then within `tol` of its own bound."""
    x = x.double().reshape(-1, dense.shape[1])
    ref = x @ dense.T
    bound = x.abs() @ dense.abs().T
    weights_off = 0.0 if weight_error is None else x.abs() @ weight_error.T
    allowed = tol * (bound + weights_off) + weights_off + 1e-30
    err = (y.double().reshape(ref.shape) - ref).abs()
    assert (err <= allowed).all(), f"max error {(err / allowed).max().item():.2f} of the allowed"
    cpu_bound = dense.abs().sum(1)[None, :] * x.abs().amax(1, keepdim=True) / 254
    assert ((y.double().reshape(ref.shape) - y_cpu.double().reshape(ref.shape)).abs() <= allowed + cpu_bound).all()


# ---- loading and the dispatch log ----------------------------------------------------------


def test_emulated_build_loads_and_carries_no_ggml_cpu(metal_emu, gq):
    metal_checks.assert_emulated_build_has_no_ggml_cpu(metal_emu, gq)


def test_instrumentation_only_in_emulated_builds(metal_emu, gq):
    metal_checks.assert_instrumentation_only_in_emulated_build(metal_emu, gq)


def test_dispatches_count_threadgroups_and_reset(metal, gq):
    t, blocks, _ = quantized(gq, "Q4_0")
    metal.reset_metal_dispatches()
    metal.mul_mat_vec(blocks, torch.randn(1, K), t, N)
    first = metal.metal_dispatches()
    assert list(first) == ["kernel_mul_mv_q4_0_f32"] and first["kernel_mul_mv_q4_0_f32"] > 0
    metal.mul_mat_vec(blocks, torch.randn(1, K), t, N)
    assert metal.metal_dispatches()["kernel_mul_mv_q4_0_f32"] == 2 * first["kernel_mul_mv_q4_0_f32"]
    records = metal._metal_emu.metal_dispatch_records()
    assert [r["kernel"] for r in records] == ["kernel_mul_mv_q4_0_f32"] * 2
    metal.reset_metal_dispatches()
    assert metal.metal_dispatches() == {}


# ---- ggml-quantization ---------------------------------------------------------------------


@pytest.mark.parametrize("std", TWIN_WEIGHT_STDS)
@pytest.mark.parametrize("rows", [1, 3, 5, 12])
def test_mul_mat_every_type_and_kernel_variant(metal, gq, rows, std):
    """Every storage type at 1 (mat-vec), 3 and 5 (mat-vec-ext where upstream has it) and 12 rows
    (tiled mat-mat): upstream's choice, values against the reference and the CPU build."""
    assert {t.name for t in storage_types(gq)} == set(ALL_STORAGE_TYPES) | METAL_UNSUPPORTED
    refused = set()
    for type_id in storage_types(gq):
        name = type_id.name
        t, blocks, dense = quantized(gq, name, seed=rows, std=std)
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(100 + rows))
        if name in METAL_UNSUPPORTED:
            with pytest.raises(NotImplementedError, match=rf"ggml-metal has no kernel for MUL_MAT\({name}, F32\)"):
                metal.mul_mat(blocks, x, t, N)
            refused.add(name)
            continue
        y, kernels = both_schedules(metal, metal.mul_mat, blocks, x, t, N)
        assert len(kernels) == 1, kernels
        kernel = next(iter(kernels))
        assert kernel.startswith(expected_family(name, rows, K) + kernel_type(name) + "_f32"), (name, kernel)
        weight_error = half_scale_error(blocks, name, K) if dequantizes_tiles(kernel) else None
        check_product(y, gq.mul_mat(blocks, x, t, N), x, dense, metal_tolerance(name, rows, K), weight_error)
    assert refused == METAL_UNSUPPORTED


@pytest.mark.parametrize("rows", [1, 3, 12])
@pytest.mark.parametrize(("type_name", "cols"), [("F32", 70), ("F16", 70), ("BF16", 70), ("Q4_0", 96), ("Q4_K", 512)])
def test_mul_mat_row_lengths(metal, gq, type_name, cols, rows):
    """ne00 % 4 != 0 (upstream's non-vectorised float kernels), K % 128 != 0 (no mat-vec-ext), and
    two K-quant blocks per row; a trained model's weight scale."""
    t, blocks, dense = quantized(gq, type_name, cols=cols, seed=cols, std=0.02)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    y, kernels = both_schedules(metal, metal.mul_mat_vec, blocks, x, t, N)
    kernel = next(iter(kernels))
    assert kernel.startswith(expected_family(type_name, rows, cols)), kernel
    if rows == 1 and type_name in ("F32", "F16", "BF16"):
        assert not kernel.endswith("_4")  # the float4 variant needs ne00 % 4 == 0
    weight_error = half_scale_error(blocks, type_name, cols) if dequantizes_tiles(kernel) else None
    check_product(y, gq.mul_mat_vec(blocks, x, t, N), x, dense, metal_tolerance(type_name, rows, cols), weight_error)


def test_mul_mat_keeps_leading_dims_and_takes_strided_half_activations(metal, gq):
    t, blocks, dense = quantized(gq, "Q8_0")
    big = torch.randn(2, 3, 2 * K, dtype=torch.float16)
    x = big[..., ::2]  # (2, 3, K), not contiguous
    y, _ = both_schedules(metal, metal.mul_mat, blocks, x, t, N)
    assert y.shape == (2, 3, N) and y.dtype == torch.float32
    check_product(y, gq.mul_mat(blocks, x, t, N), x.float(), dense, metal_tolerance("Q8_0", 6, K))


@pytest.mark.parametrize("rows", [1, 12])
def test_mul_mat_group_is_one_graph_of_separate_products(metal, gq, rows):
    weights = [quantized(gq, name, rows=n, seed=i) for i, (name, n) in enumerate([("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 16)])]
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(7))
    blocks, types, outs = [w[1] for w in weights], [w[0] for w in weights], [64, 32, 16]
    ys, kernels = both_schedules(metal, metal.mul_mat_group, blocks, x, types, outs)
    assert len(kernels) == 3
    for y, (t, b, dense), n in zip(ys, weights, outs, strict=True):
        assert torch.equal(y, metal.mul_mat(b, x, t, n))  # one graph computes what separate ones do
        name = {12: "Q4_K", 14: "Q6_K", 8: "Q8_0"}[t]
        check_product(y, gq.mul_mat(b, x, t, n), x, dense, metal_tolerance(name, rows, K))


ALL_STORAGE_TYPES = ["F32", "F16", "BF16", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q2_K", "Q3_K",
                     "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
                     "IQ4_XS", "TQ2_0"]


@pytest.mark.parametrize("std", TWIN_WEIGHT_STDS)
@pytest.mark.parametrize(("tokens", "family"), [(3, "kernel_mul_mv_id_"), (40, "kernel_mul_mm_id_")])
@pytest.mark.parametrize(
    "type_name", [t if t in TWIN_FAST_TYPES else pytest.param(t, marks=slow_on("mps-emu")) for t in ALL_STORAGE_TYPES])
def test_mul_mat_id_vec_and_mapped_tiles(metal, gq, type_name, tokens, family, std):
    """Every storage type Metal supports through the MoE mat-vec (few tokens) and the mapped tiles."""
    experts, n_ids, rows = 4, 2, 32
    parts = [quantized(gq, type_name, rows=rows, seed=e, std=std) for e in range(experts)]
    t = parts[0][0]
    blocks = torch.stack([p[1] for p in parts])  # (E, N, row_bytes)
    dense = torch.stack([p[2] for p in parts])
    # (E, N, K): the mapped tiles dequantize them (dequantize.h); the mat-vec kernels scale in float32
    weight_error = torch.stack([half_scale_error(p[1], type_name, K) for p in parts]) * ("mm" in family)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, K, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:n_ids] for _ in range(tokens)])
    y, kernels = both_schedules(metal, metal.mul_mat_id, blocks, x, ids, t, rows)
    assert any(k.startswith(family + kernel_type(type_name)) for k in kernels), kernels
    y_cpu = gq.mul_mat_id(blocks, x, ids, t, rows)
    tol = metal_tolerance(type_name, 12 if "mm" in family else 1, K)
    for j in range(n_ids):  # each slot is a product with that token's expert
        w = dense[ids[:, j]]  # (T, N, K)
        ref = torch.einsum("tnk,tk->tn", w, x.double())
        bound = torch.einsum("tnk,tk->tn", w.abs(), x.double().abs())
        weights_off = torch.einsum("tnk,tk->tn", weight_error[ids[:, j]], x.double().abs())
        allowed = tol * (bound + weights_off) + weights_off
        assert ((y[:, j].double() - ref).abs() <= allowed).all()
        cpu_bound = w.abs().sum(2) * x.double().abs().amax(1, keepdim=True) / 254
        assert ((y[:, j] - y_cpu[:, j]).double().abs() <= allowed + cpu_bound).all()


@pytest.mark.parametrize(("n_ids", "maps"), [(3, {1, 2}), (7, {1, 6}), (8, {8})])
def test_mul_mat_id_splits_expert_counts_upstream_has_no_map_kernel_for(metal, gq, n_ids, maps):
    """Upstream's mapped tiled path has kernel_mul_mm_id_map0_ne20_<n> for n in 1, 2, 4, 5, 6, 8, 10,
    16, 22 only (tests/test_metal_host.py): other counts of experts per token are split into those."""
    experts, rows, tokens = 8, 32, 40
    parts = [quantized(gq, "Q8_0", rows=rows, seed=e) for e in range(experts)]
    t, blocks, dense = parts[0][0], torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts])
    g = torch.Generator().manual_seed(n_ids)
    x = torch.randn(tokens, K, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:n_ids] for _ in range(tokens)])
    y, kernels = both_schedules(metal, metal.mul_mat_id, blocks, x, ids, t, rows)
    assert {int(k.rsplit("_", 1)[1]) for k in kernels if "map0" in k} == maps, kernels
    w = dense[ids]  # (T, n_ids, N, K)
    ref = torch.einsum("tjnk,tk->tjn", w, x.double())
    bound = torch.einsum("tjnk,tk->tjn", w.abs(), x.double().abs())
    assert ((y.double() - ref).abs() <= 2.0**-10 * bound).all()


@pytest.mark.parametrize("std", TWIN_WEIGHT_STDS)
def test_dequantize_and_get_rows_every_type_match_the_cpu_build(metal, gq, std):
    """Metal's get_rows kernels dequantize each type's blocks exactly as ggml's CPU code does, but
    for the half-precision block scale of Q4_0, Q4_1 and Q4_K (module docstring): within
    half_scale_error of the CPU build, equal wherever that is 0 (every block at unit scale). A
    bfloat16 result rounds values that far apart at most one bfloat16 unit (2^-7 relative) apart."""
    idx = torch.tensor([5, 0, 63, 5])
    for type_id in storage_types(gq):
        name = type_id.name
        t, blocks, dense = quantized(gq, name, std=std)
        if name in METAL_UNSUPPORTED:
            with pytest.raises(NotImplementedError, match="GET_ROWS"):
                metal.dequantize(blocks, t, N, K, torch.float32)
            continue
        full, kernels = both_schedules(metal, metal.dequantize, blocks, t, N, K, torch.float32)
        assert list(kernels) == [f"kernel_get_rows_{kernel_type(name)}"], kernels
        bound = half_scale_error(blocks, name, K)
        assert ((full.double() - dense).abs() <= bound).all(), name
        assert torch.equal(full.double()[bound == 0], dense[bound == 0]), name
        if name in HALF_SCALE_BLOCKS:  # the scales whose blocks have d < 2^-10 (module docstring)
            assert bool((bound > 0).any()) == (std <= (0.02 if name == "Q4_K" else 0.002)), (name, std)
        rows, _ = both_schedules(metal, metal.get_rows, blocks, idx, t, K, torch.bfloat16)
        rows_cpu = gq.get_rows(blocks, idx, t, K, torch.bfloat16).double()
        allowed = ((1 + 2.0**-7) * bound[idx] + 2.0**-7 * rows_cpu.abs()) * (bound[idx] > 0)
        assert ((rows.double() - rows_cpu).abs() <= allowed).all(), name


def test_cpu_only_operations_raise(metal, gq):
    t, blocks, _ = quantized(gq, "Q4_0")
    with pytest.raises(NotImplementedError, match="quantize runs on the CPU build only"):
        metal.quantize(torch.randn(8, K), t)
    with pytest.raises(NotImplementedError, match="repacked layout"):
        metal.ops.repack(blocks, t)
    with pytest.raises(NotImplementedError, match="use the CPU build"):
        metal.ops.unrepack(blocks, t)
    assert metal.ops.repacked_types() == []
    with pytest.raises(ValueError, match="repacked layout; the Metal build takes weights in the plain GGUF layout"):
        metal.ops.mul_mat(blocks, torch.randn(1, K), t + 1024, N)


@pytest.mark.parametrize(
    "call",
    [
        lambda m, b, t: m.ops.mul_mat(b, torch.randn(1, K, dtype=torch.float64), t, N),
        lambda m, b, t: m.ops.mul_mat(b, torch.randn(1, K + 32), t, N),
        lambda m, b, t: m.ops.mul_mat(b[:, :10], torch.randn(1, K), t, N),
        lambda m, b, t: m.ops.mul_mat_id(b[None], torch.randn(2, K), torch.tensor([[0], [1]]), t, N),
        lambda m, b, t: m.ops.get_rows(b, torch.tensor([N]), t, K, torch.float32),
        lambda m, b, t: m.ops.dequantize(b, 99, N, K, torch.float32),
    ],
    ids=["dtype", "features", "row-bytes", "expert-index", "row-index", "type-id"],
)
def test_bad_input_raises_as_the_cpu_build_does(metal, gq, call):
    t, blocks, _ = quantized(gq, "Q4_0")

    def refusal(module):
        with pytest.raises((TypeError, ValueError, IndexError)) as info:
            call(module, blocks, t)
        return info.type, str(info.value).splitlines()[0]

    assert refusal(metal) == refusal(gq)

"""ggml-quantization, ggml-norm, topk and ggml-gated-delta-net on Metal: the emulated builds (packages/<name>/build-metal-emu/,
loaded as users would with kernels.get_local_kernel) against the CPU builds and the references.

Every op runs through upstream's Metal host code (its kernel choice, grid, function constants and
threadgroup memory) and its kernels on the emulated device; each call is made under both lane
schedules (SIMD lanes resumed forward and in reverse between rendezvous points) and the results
must be bit-identical. `metal_dispatches()` shows which kernels upstream chose.

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

import ctypes
from pathlib import Path

import pytest
import torch

from tools.testing.metal_builds import both_schedules, build_fixture

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

K, N = 256, 64
# unit-scale weights, a trained model's (its linear layers' weights have std ~0.02) and small ones
WEIGHT_STDS = [1.0, 0.02, 0.002]
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


# m*: a package's emulated-Metal build, c*: its CPU build (q: ggml-quantization, t: topk,
# g: ggml-gated-delta-net, n: ggml-norm)
mq = build_fixture("mq", "ggml-quantization", "build-metal-emu")
cq = build_fixture("cq", "ggml-quantization", "build")
mt = build_fixture("mt", "topk", "build-metal-emu")
ct = build_fixture("ct", "topk", "build")
mg = build_fixture("mg", "ggml-gated-delta-net", "build-metal-emu")
cg = build_fixture("cg", "ggml-gated-delta-net", "build")
mn = build_fixture("mn", "ggml-norm", "build-metal-emu")
cn = build_fixture("cn", "ggml-norm", "build")


def storage_types(cq):
    return [t for t, info in cq.types.TYPE_INFO.items() if info.storage]


def quantized(cq, type_name: str, rows: int = N, cols: int = K, seed: int = 0, std: float = 1.0):
    """Random weights (std `std`) quantized by the CPU build, and their float64 dequantization."""
    t = int(cq.types.GGMLType[type_name])
    w = std * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    blocks = cq.quantize(w, t, imatrix=torch.ones(cols))
    return t, blocks, cq.dequantize(blocks, t, rows, cols, torch.float32).double()


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


def test_emulated_builds_load_and_carry_no_ggml_cpu(mq, mn, cq):
    for module in (mq, mn):
        info = module.info()
        assert info["backend"] == "metal-emu" and info["cpu_variant"] == ""
        assert Path(info["runtime"]).name == "libggml-kernels-metal-emu.so"
        assert "build-metal-emu" in info["runtime"]
        lib = ctypes.CDLL(info["runtime"], mode=ctypes.RTLD_LOCAL)
        # the runtime holds ggml-base and upstream's Metal backend only: nothing could fall back
        assert hasattr(lib, "ggml_backend_metal_init")
        assert not hasattr(lib, "ggml_graph_compute") and not hasattr(lib, "ggml_backend_cpu_reg")
    assert cq.info()["backend"] == "cpu"


def test_instrumentation_only_in_emulated_builds(mq, cq):
    """The emulator's dispatch log and lane schedules are the emulated build's: the CPU build (what
    the Hub gets) has none of them, in its API, its modules or its extension."""
    instrumentation = {"metal_dispatches", "reset_metal_dispatches"}
    assert instrumentation <= set(mq.__all__) and all(hasattr(mq, n) for n in instrumentation)
    assert hasattr(mq, "_metal_emu") and hasattr(mq._metal_emu, "set_lane_schedule")
    assert not instrumentation & set(cq.__all__) and not any(hasattr(cq, n) for n in instrumentation)
    assert not hasattr(cq, "_metal_emu")
    extension = getattr(cq._ops, cq._ops.ops.name)
    assert [n for n in dir(extension) if n.startswith("metal_")] == []
    # the instrumentation's ops (common/metal/metal_emu_ops.cpp, compiled into emulated builds only)
    emulator_ops = ["metal_threadgroups_json", "metal_dispatches_json", "metal_reset_dispatches", "metal_set_lane_schedule"]
    assert all(hasattr(mq._ops.ops, n) for n in emulator_ops)
    assert not any(hasattr(cq._ops.ops, n) for n in emulator_ops)


def test_dispatches_count_threadgroups_and_reset(mq, cq):
    t, blocks, _ = quantized(cq, "Q4_0")
    mq.reset_metal_dispatches()
    mq.mul_mat_vec(blocks, torch.randn(1, K), t, N)
    first = mq.metal_dispatches()
    assert list(first) == ["kernel_mul_mv_q4_0_f32"] and first["kernel_mul_mv_q4_0_f32"] > 0
    mq.mul_mat_vec(blocks, torch.randn(1, K), t, N)
    assert mq.metal_dispatches()["kernel_mul_mv_q4_0_f32"] == 2 * first["kernel_mul_mv_q4_0_f32"]
    records = mq._metal_emu.metal_dispatch_records()
    assert [r["kernel"] for r in records] == ["kernel_mul_mv_q4_0_f32"] * 2
    mq.reset_metal_dispatches()
    assert mq.metal_dispatches() == {}


# ---- ggml-quantization ---------------------------------------------------------------------


@pytest.mark.parametrize("std", WEIGHT_STDS)
@pytest.mark.parametrize("rows", [1, 3, 5, 12])
def test_mul_mat_every_type_and_kernel_variant(mq, cq, rows, std):
    """Every storage type at 1 (mat-vec), 3 and 5 (mat-vec-ext where upstream has it) and 12 rows
    (tiled mat-mat): upstream's choice, values against the reference and the CPU build."""
    assert {t.name for t in storage_types(cq)} == set(ALL_STORAGE_TYPES) | METAL_UNSUPPORTED
    refused = set()
    for type_id in storage_types(cq):
        name = type_id.name
        t, blocks, dense = quantized(cq, name, seed=rows, std=std)
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(100 + rows))
        if name in METAL_UNSUPPORTED:
            with pytest.raises(NotImplementedError, match=rf"ggml-metal has no kernel for MUL_MAT\({name}, F32\)"):
                mq.mul_mat(blocks, x, t, N)
            refused.add(name)
            continue
        y, kernels = both_schedules(mq, mq.mul_mat, blocks, x, t, N)
        assert len(kernels) == 1, kernels
        kernel = next(iter(kernels))
        assert kernel.startswith(expected_family(name, rows, K) + kernel_type(name) + "_f32"), (name, kernel)
        weight_error = half_scale_error(blocks, name, K) if dequantizes_tiles(kernel) else None
        check_product(y, cq.mul_mat(blocks, x, t, N), x, dense, metal_tolerance(name, rows, K), weight_error)
    assert refused == METAL_UNSUPPORTED


@pytest.mark.parametrize("rows", [1, 3, 12])
@pytest.mark.parametrize(("type_name", "cols"), [("F32", 70), ("F16", 70), ("BF16", 70), ("Q4_0", 96), ("Q4_K", 512)])
def test_mul_mat_row_lengths(mq, cq, type_name, cols, rows):
    """ne00 % 4 != 0 (upstream's non-vectorised float kernels), K % 128 != 0 (no mat-vec-ext), and
    two K-quant blocks per row; a trained model's weight scale."""
    t, blocks, dense = quantized(cq, type_name, cols=cols, seed=cols, std=0.02)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    y, kernels = both_schedules(mq, mq.mul_mat_vec, blocks, x, t, N)
    kernel = next(iter(kernels))
    assert kernel.startswith(expected_family(type_name, rows, cols)), kernel
    if rows == 1 and type_name in ("F32", "F16", "BF16"):
        assert not kernel.endswith("_4")  # the float4 variant needs ne00 % 4 == 0
    weight_error = half_scale_error(blocks, type_name, cols) if dequantizes_tiles(kernel) else None
    check_product(y, cq.mul_mat_vec(blocks, x, t, N), x, dense, metal_tolerance(type_name, rows, cols), weight_error)


def test_mul_mat_keeps_leading_dims_and_takes_strided_half_activations(mq, cq):
    t, blocks, dense = quantized(cq, "Q8_0")
    big = torch.randn(2, 3, 2 * K, dtype=torch.float16)
    x = big[..., ::2]  # (2, 3, K), not contiguous
    y, _ = both_schedules(mq, mq.mul_mat, blocks, x, t, N)
    assert y.shape == (2, 3, N) and y.dtype == torch.float32
    check_product(y, cq.mul_mat(blocks, x, t, N), x.float(), dense, metal_tolerance("Q8_0", 6, K))


@pytest.mark.parametrize("rows", [1, 12])
def test_mul_mat_group_is_one_graph_of_separate_products(mq, cq, rows):
    weights = [quantized(cq, name, rows=n, seed=i) for i, (name, n) in enumerate([("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 16)])]
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(7))
    blocks, types, outs = [w[1] for w in weights], [w[0] for w in weights], [64, 32, 16]
    ys, kernels = both_schedules(mq, mq.mul_mat_group, blocks, x, types, outs)
    assert len(kernels) == 3
    for y, (t, b, dense), n in zip(ys, weights, outs, strict=True):
        assert torch.equal(y, mq.mul_mat(b, x, t, n))  # one graph computes what separate ones do
        name = {12: "Q4_K", 14: "Q6_K", 8: "Q8_0"}[t]
        check_product(y, cq.mul_mat(b, x, t, n), x, dense, metal_tolerance(name, rows, K))


ALL_STORAGE_TYPES = ["F32", "F16", "BF16", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q2_K", "Q3_K",
                     "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
                     "IQ4_XS", "TQ2_0"]


@pytest.mark.parametrize("std", WEIGHT_STDS)
@pytest.mark.parametrize(("tokens", "family"), [(3, "kernel_mul_mv_id_"), (40, "kernel_mul_mm_id_")])
@pytest.mark.parametrize("type_name", ALL_STORAGE_TYPES)
def test_mul_mat_id_vec_and_mapped_tiles(mq, cq, type_name, tokens, family, std):
    """Every storage type Metal supports through the MoE mat-vec (few tokens) and the mapped tiles."""
    experts, n_ids, rows = 4, 2, 32
    parts = [quantized(cq, type_name, rows=rows, seed=e, std=std) for e in range(experts)]
    t = parts[0][0]
    blocks = torch.stack([p[1] for p in parts])  # (E, N, row_bytes)
    dense = torch.stack([p[2] for p in parts])
    # (E, N, K): the mapped tiles dequantize them (dequantize.h); the mat-vec kernels scale in float32
    weight_error = torch.stack([half_scale_error(p[1], type_name, K) for p in parts]) * ("mm" in family)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, K, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:n_ids] for _ in range(tokens)])
    y, kernels = both_schedules(mq, mq.mul_mat_id, blocks, x, ids, t, rows)
    assert any(k.startswith(family + kernel_type(type_name)) for k in kernels), kernels
    y_cpu = cq.mul_mat_id(blocks, x, ids, t, rows)
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
def test_mul_mat_id_splits_expert_counts_upstream_has_no_map_kernel_for(mq, cq, n_ids, maps):
    """Upstream's mapped tiled path has kernel_mul_mm_id_map0_ne20_<n> for n in 1, 2, 4, 5, 6, 8, 10,
    16, 22 only (tests/test_metal_host.py): other counts of experts per token are split into those."""
    experts, rows, tokens = 8, 32, 40
    parts = [quantized(cq, "Q8_0", rows=rows, seed=e) for e in range(experts)]
    t, blocks, dense = parts[0][0], torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts])
    g = torch.Generator().manual_seed(n_ids)
    x = torch.randn(tokens, K, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:n_ids] for _ in range(tokens)])
    y, kernels = both_schedules(mq, mq.mul_mat_id, blocks, x, ids, t, rows)
    assert {int(k.rsplit("_", 1)[1]) for k in kernels if "map0" in k} == maps, kernels
    w = dense[ids]  # (T, n_ids, N, K)
    ref = torch.einsum("tjnk,tk->tjn", w, x.double())
    bound = torch.einsum("tjnk,tk->tjn", w.abs(), x.double().abs())
    assert ((y.double() - ref).abs() <= 2.0**-10 * bound).all()


@pytest.mark.parametrize("std", WEIGHT_STDS)
def test_dequantize_and_get_rows_every_type_match_the_cpu_build(mq, cq, std):
    """Metal's get_rows kernels dequantize each type's blocks exactly as ggml's CPU code does, but
    for the half-precision block scale of Q4_0, Q4_1 and Q4_K (module docstring): within
    half_scale_error of the CPU build, equal wherever that is 0 (every block at unit scale). A
    bfloat16 result rounds values that far apart at most one bfloat16 unit (2^-7 relative) apart."""
    idx = torch.tensor([5, 0, 63, 5])
    for type_id in storage_types(cq):
        name = type_id.name
        t, blocks, dense = quantized(cq, name, std=std)
        if name in METAL_UNSUPPORTED:
            with pytest.raises(NotImplementedError, match="GET_ROWS"):
                mq.dequantize(blocks, t, N, K, torch.float32)
            continue
        full, kernels = both_schedules(mq, mq.dequantize, blocks, t, N, K, torch.float32)
        assert list(kernels) == [f"kernel_get_rows_{kernel_type(name)}"], kernels
        bound = half_scale_error(blocks, name, K)
        assert ((full.double() - dense).abs() <= bound).all(), name
        assert torch.equal(full.double()[bound == 0], dense[bound == 0]), name
        if name in HALF_SCALE_BLOCKS:  # the scales whose blocks have d < 2^-10 (module docstring)
            assert bool((bound > 0).any()) == (std <= (0.02 if name == "Q4_K" else 0.002)), (name, std)
        rows, _ = both_schedules(mq, mq.get_rows, blocks, idx, t, K, torch.bfloat16)
        rows_cpu = cq.get_rows(blocks, idx, t, K, torch.bfloat16).double()
        allowed = ((1 + 2.0**-7) * bound[idx] + 2.0**-7 * rows_cpu.abs()) * (bound[idx] > 0)
        assert ((rows.double() - rows_cpu).abs() <= allowed).all(), name


def test_cpu_only_operations_raise(mq, cq):
    t, blocks, _ = quantized(cq, "Q4_0")
    with pytest.raises(NotImplementedError, match="quantize runs on the CPU build only"):
        mq.quantize(torch.randn(8, K), t)
    with pytest.raises(NotImplementedError, match="repacked layout"):
        mq.ops.repack(blocks, t)
    with pytest.raises(NotImplementedError, match="use the CPU build"):
        mq.ops.unrepack(blocks, t)
    assert mq.ops.repacked_types() == []
    with pytest.raises(ValueError, match="repacked layout; the Metal build takes weights in the plain GGUF layout"):
        mq.ops.mul_mat(blocks, torch.randn(1, K), t + 1024, N)


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
def test_bad_input_raises_as_the_cpu_build_does(mq, cq, call):
    t, blocks, _ = quantized(cq, "Q4_0")

    def refusal(module):
        with pytest.raises((TypeError, ValueError, IndexError)) as info:
            call(module, blocks, t)
        return info.type, str(info.value).splitlines()[0]

    assert refusal(mq) == refusal(cq)


# ---- ggml-norm -----------------------------------------------------------------------------

NORM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def norm_tolerance(dtype: torch.dtype) -> float:
    """Metal sums the squares in float32 (SIMD-group sums), the CPU build in double: 1e-6 relative
    on float32 outputs; a half / bfloat output may then round the other way (one unit: 2^-10 / 2^-7)."""
    return {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]


def assert_norm_close(a, b, dtype):
    tol = norm_tolerance(dtype)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert ((a.double() - b.double()).abs() <= tol * (b.double().abs() + 1)).all()


@pytest.mark.parametrize("n", [64, 70])
@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("variant", ["plain", "weight", "zero-centered", "bias", "llama-rounding"])
def test_rms_norm(mn, cn, variant, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 5, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    kwargs = {
        "plain": {},
        "weight": {"weight": w},
        "zero-centered": {"weight": w, "zero_centered": True},
        "bias": {"weight": w, "bias": b},
        "llama-rounding": {"weight": w.float(), "cast_before_weight": True},
    }[variant]
    y, kernels = both_schedules(mn, mn.rms_norm, x, eps=1e-6, **kwargs)
    assert any(k.startswith("kernel_rms_norm") for k in kernels), kernels
    assert any(k.endswith("_f32_4") for k in kernels) == (n % 4 == 0), kernels
    assert_norm_close(y, cn.rms_norm(x, eps=1e-6, **kwargs), dtype)
    ref = mn.reference.rms_norm(x, eps=1e-6, **kwargs)
    assert_norm_close(y, ref, dtype)


def test_rms_norm_strided_input(mn, cn):
    x = torch.randn(6, 128)[:, 16:112]  # (6, 96) with row stride 128
    assert not x.is_contiguous()
    w = torch.randn(96)
    y, _ = both_schedules(mn, mn.rms_norm, x, w, eps=1e-5)
    assert_norm_close(y, cn.rms_norm(x, w, eps=1e-5), torch.float32)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("rounding", [False, True])
def test_rms_norm_gated(mn, cn, dtype, rounding):
    g = torch.Generator().manual_seed(3)
    x, z = (torch.randn(7, 128, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(128, generator=g).to(dtype)
    y, kernels = both_schedules(mn, mn.rms_norm_gated, x, z, w, eps=1e-6, cast_before_weight=rounding)
    assert any(k.startswith("kernel_rms_norm") for k in kernels) and any("swiglu" in k for k in kernels), kernels
    assert_norm_close(y, cn.rms_norm_gated(x, z, w, eps=1e-6, cast_before_weight=rounding), dtype)


@pytest.mark.parametrize("dtype", NORM_DTYPES)
@pytest.mark.parametrize("mode", ["clamp", "rsqrt"])
def test_l2_norm(mn, cn, mode, dtype):
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[0, 0] = 0  # the clamp
    y, kernels = both_schedules(mn, mn.l2_norm, x, eps=1e-6, mode=mode)
    want = "kernel_l2_norm" if mode == "clamp" else "kernel_rms_norm"
    assert any(k.startswith(want) for k in kernels), kernels
    assert_norm_close(y, cn.l2_norm(x, eps=1e-6, mode=mode), dtype)


def test_norm_layers(mn, cn):
    """The kernelize layers, forward called on a module holding transformers' attribute names."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(64))
    module.variance_epsilon = 1e-6
    module.eps = 1e-6
    x, gate = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    for name, args in [("RMSNorm", (x,)), ("RMSNormZeroCentered", (x,)), ("RMSNormGated", (x, gate))]:
        y, _ = both_schedules(mn, getattr(mn.layers, name).forward, module, *args)
        assert_norm_close(y, getattr(cn.layers, name).forward(module, *args), torch.float32)


# ---- topk -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("experts", "k", "fused"), [(8, 2, True), (64, 8, True), (1024, 4, True), (2048, 4, False)])
@pytest.mark.parametrize(("softmax", "normalize"), [(True, False), (True, True), (False, False)])
def test_top_k_routing(mt, ct, experts, k, fused, softmax, normalize):
    """llama.cpp's routing graph; upstream fuses it into kernel_topk_moe_f32 (softmax, <= 1024
    experts). Against the CPU build's ggml routing and torch in float64 (the same chosen experts:
    random float32 logits have no ties): weights within 2^-21 relative (float32 exp and sums in
    another order; observed < 2e-7)."""
    g = torch.Generator().manual_seed(experts + k)
    x = 3 * torch.randn(5, experts, generator=g)
    (w, i), kernels = both_schedules(mt, mt.ops.top_k, x, k, softmax, normalize, None, None)
    assert ("kernel_topk_moe_f32" in kernels) == (fused and softmax), kernels
    w_cpu, i_cpu = ct.ops.top_k_ggml(x, k, softmax, normalize)
    assert torch.equal(i, i_cpu) and i.dtype == torch.int64
    p = torch.softmax(x.double(), -1) if softmax else x.double()
    want_w, want_i = torch.topk(p, k)
    if normalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(i, want_i)
    for got in (w, w_cpu):
        assert ((got.double() - want_w).abs() <= 2.0**-21 * want_w.abs()).all()


def test_top_k_ties_and_dtypes(mt):
    """Tied logits: the weights are the k largest (which tied expert comes first is the kernel's);
    weights in the asked dtype, int32 indices on request; the Python API's n-D rows."""
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 2.0]]).repeat(2, 3, 1)
    w, i = mt.softmax_top_k(x, 4, dtype=torch.float16, index_dtype=torch.int32)
    assert w.shape == (2, 3, 4) and w.dtype == torch.float16 and i.dtype == torch.int32
    chosen = torch.gather(x, -1, i.long())
    assert torch.equal(chosen.sort(-1, descending=True).values, torch.topk(x, 4).values)
    top = torch.topk(torch.softmax(x, -1), 4).values
    torch.testing.assert_close(w, (top / top.sum(-1, keepdim=True)).half(), rtol=2.0**-10, atol=0)


def test_top_k_bad_rows_raise_as_the_cpu_build(mt, ct):
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    for module in (mt, ct):
        with pytest.raises(ValueError, match="logits contain NaN"):
            module.ops.top_k(x, 2, True, False, None, None)
    x = torch.full((2, 8), float("-inf"))
    with pytest.raises(ValueError, match="is -inf: softmax is undefined"):
        mt.ops.top_k(x, 2, True, False, None, None)


# ---- ggml-gated-delta-net ----------------------------------------------------------------------


def assert_float_close(got, want, tol):
    """|got - want| <= tol * max|want| (float32 recurrences summed in another order)."""
    scale = want.double().abs().max().clamp_min(1e-30)
    assert ((got.double() - want.double()).abs() <= tol * scale).all(), ((got - want).abs().max() / scale).item()


def delta_net_inputs(B, T, Hk, Hv, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, Hk, D, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(B, T, Hv, D, generator=g).to(dtype)
    gate = -torch.rand(B, T, Hv, generator=g)
    beta = torch.rand(B, T, Hv, generator=g)
    state = 0.1 * torch.randn(B, Hv, D, D, generator=g)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize(("T", "Hk", "Hv", "D"), [(1, 2, 2, 32), (1, 2, 8, 128), (7, 1, 4, 64), (7, 2, 4, 128)])
def test_gated_delta_net(mg, cg, T, Hk, Hv, D, l2):
    """Upstream's kernel_gated_delta_net_f32_<D/32> for decode (T = 1) and prefill, GQA ratios 1 to
    8, with a state; against the CPU build and the reference within 1e-5 of the output scale
    (observed ~1e-8: float32 sums of D products in SIMD order)."""
    q, k, v, gate, beta, state = delta_net_inputs(2, T, Hk, Hv, D, seed=T + Hv + D)
    if not l2:
        q, k = q / D**0.5, k / D**0.5  # keep the recurrence bounded
    (out, new_state), kernels = both_schedules(mg, mg.ops.gated_delta_net, q, k, v, gate, beta, state, l2, None)
    assert f"kernel_gated_delta_net_f32_{D // 32}" in kernels, kernels
    out_cpu, state_cpu = cg.ops.gated_delta_net(q, k, v, gate, beta, state, l2, None)
    assert_float_close(out, out_cpu, 1e-5)
    assert_float_close(new_state, state_cpu, 1e-5)
    out_ref, state_ref = mg.reference.gated_delta_net(q, k, v, gate, beta, state, l2_normalize_qk=l2)
    assert_float_close(out, out_ref, 1e-5)
    assert_float_close(new_state, state_ref, 1e-5)


def test_gated_delta_net_in_place_without_state_and_bf16(mg, cg):
    q, k, v, gate, beta, _ = delta_net_inputs(1, 3, 2, 4, 64, dtype=torch.bfloat16, seed=1)
    out, state = mg.gated_delta_net(q, k, v, gate, beta, l2_normalize_qk=True, scale=0.2)
    out_cpu, state_cpu = cg.gated_delta_net(q, k, v, gate, beta, l2_normalize_qk=True, scale=0.2)
    assert out.dtype == torch.bfloat16
    assert_float_close(out.float(), out_cpu.float(), 2.0**-7)
    assert_float_close(state, state_cpu, 1e-5)
    q1, k1, v1, g1, b1, _ = delta_net_inputs(1, 1, 2, 4, 64, dtype=torch.bfloat16, seed=2)
    cached, cached_cpu = state.clone(), state_cpu.clone()
    (y,), _ = both_schedules(mg, lambda: [mg.gated_delta_net_(q1, k1, v1, g1, b1, cached.clone(), l2_normalize_qk=True)])
    mg.gated_delta_net_(q1, k1, v1, g1, b1, cached, l2_normalize_qk=True)
    cg.gated_delta_net_(q1, k1, v1, g1, b1, cached_cpu, l2_normalize_qk=True)
    assert_float_close(y.float(), cg.gated_delta_net_(q1, k1, v1, g1, b1, state_cpu.clone(), l2_normalize_qk=True).float(), 2.0**-7)
    assert_float_close(cached, cached_cpu, 1e-5)


def test_gated_delta_net_head_sizes_refused_alike(mg, cg):
    q, k, v, gate, beta, state = delta_net_inputs(1, 1, 1, 1, 16)
    for module in (mg, cg):
        with pytest.raises(ValueError, match="head dim 16 is not supported"):
            module.ops.gated_delta_net(q, k, v, gate, beta, state, True, None)


def test_float_arguments_beyond_float32_refused_alike(mg, cg, mn, cn):
    """A finite double beyond float32's range is inf once ggml holds it (gated_delta_net's scale=1e300
    gave an all-NaN output): every float argument of the packages is a ValueError, on both builds."""
    q, k, v, gate, beta, state = delta_net_inputs(1, 1, 1, 1, 64)
    x = torch.randn(2, 16)
    calls = {
        (mg, cg): [lambda m: m.ops.gated_delta_net(q, k, v, gate, beta, state, True, 1e300),
                   lambda m: m.l2_norm(x, 1e300), lambda m: m.gated_rms_norm(x, x, torch.ones(16), eps=1e300)],
        (mn, cn): [lambda m: m.rms_norm(x, eps=1e300), lambda m: m.rms_norm_gated(x, x, torch.ones(16), eps=1e300),
                   lambda m: m.l2_norm(x, eps=-1e39)],
    }
    for modules, package_calls in calls.items():
        for call in package_calls:
            for module in modules:
                with pytest.raises(ValueError, match=r"within float32's range \(magnitude at most 3.40282e\+38"):
                    call(module)


@pytest.mark.parametrize("taps", [4, 2])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d(mg, cg, taps, with_state, dtype):
    """kernel_ssm_conv_* (+ bias, SiLU) for a prefill (T = 6) and a decode step (T = 1, in place),
    against the CPU build: float32 sums of `taps` products, 1e-6 of the scale."""
    g = torch.Generator().manual_seed(taps)
    x = torch.randn(2, 48, 6, generator=g).to(dtype)
    w, b = torch.randn(48, 1, taps, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    state = torch.randn(2, 48, taps, generator=g) if with_state else None
    (y, new_state), kernels = both_schedules(mg, mg.causal_conv1d, x, w, state, bias=b)
    assert any(k.startswith("kernel_ssm_conv") for k in kernels), kernels
    y_cpu, state_cpu = cg.causal_conv1d(x, w, state, bias=b)
    assert_float_close(y.float(), y_cpu.float(), 1e-6 if dtype == torch.float32 else 2.0**-7)
    assert torch.equal(new_state, state_cpu)
    x1 = torch.randn(2, 48, 1, generator=g).to(dtype)
    cache, cache_cpu = state_cpu.clone(), state_cpu.clone()
    y1 = mg.causal_conv1d_(x1, w, cache, bias=b)
    y1_cpu = cg.causal_conv1d_(x1, w, cache_cpu, bias=b)
    assert_float_close(y1.float(), y1_cpu.float(), 1e-6 if dtype == torch.float32 else 2.0**-7)
    assert torch.equal(cache, cache_cpu)


def test_gates_l2_norm_and_gated_rms_norm(mg, cg):
    g = torch.Generator().manual_seed(9)
    A, dt = torch.randn(8, generator=g), torch.randn(8, generator=g)
    a, b = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    (gate, beta), kernels = both_schedules(mg, mg.gates, A, a, dt, b)
    for got, want in zip((gate, beta), cg.gates(A, a, dt, b), strict=True):
        assert_float_close(got, want, 1e-6)
    x, z, w = torch.randn(4, 3, 128, generator=g), torch.randn(4, 3, 128, generator=g), torch.randn(128, generator=g)
    y, kernels = both_schedules(mg, mg.gated_rms_norm, x, z, w)
    assert "kernel_swiglu_f32" in kernels, kernels
    assert_float_close(y, cg.gated_rms_norm(x, z, w), 1e-6)
    y, _ = both_schedules(mg, mg.l2_norm, x)
    assert_float_close(y, cg.l2_norm(x), 1e-6)

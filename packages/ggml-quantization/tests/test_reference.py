"""Checks of the pure-PyTorch reference (ggml_quantization/reference.py) against gguf-py, bit for bit.

The package `__init__` loads a compiled extension, so the two pure-Python modules are imported
as submodules of a bare stand-in package instead.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

_PKG_DIR = Path(__file__).resolve().parents[1] / "torch-ext" / "ggml_quantization"
_PKG_NAME = "ggml_quantization_ref_pkg"


def _load_modules():
    if _PKG_NAME not in sys.modules:
        pkg = types.ModuleType(_PKG_NAME)
        pkg.__path__ = [str(_PKG_DIR)]
        sys.modules[_PKG_NAME] = pkg
    return importlib.import_module(f"{_PKG_NAME}.types"), importlib.import_module(f"{_PKG_NAME}.reference")


gt, ref = _load_modules()


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


T = gt.GGMLType

STORAGE = sorted((t for t, i in gt.TYPE_INFO.items() if i.storage), key=int)
NOT_IN_GGUF = {T.Q1_0, T.Q2_0}
GGUF_DEQUANT = [t for t in STORAGE if t not in NOT_IN_GGUF]
GGUF_QUANT = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4]
REF_QUANT = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
SHAPES = [(rows, nb) for rows in (1, 3, 17) for nb in (1, 2, 5)]

# Byte offsets of the f16 scale fields in each block (kept finite in random data).
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,), T.Q1_0: (0,), T.Q2_0: (0,),
}  # fmt: skip


def _random_blocks(t, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random packed blocks (n_blocks, type_size) with every f16 scale finite in [-1, 1]."""
    info = gt.TYPE_INFO[t]
    b = rng.integers(0, 256, size=(n_blocks, info.type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(t, ()):
        b[:, off : off + 2] = rng.uniform(-1, 1, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    if t == T.IQ1_M:  # the f16 scale is the four top nibbles of the scales words @48
        bits = rng.uniform(-1, 1, n_blocks).astype(np.float16).view(np.uint16)
        for i in range(4):
            hi = 48 + 2 * i + 1
            b[:, hi] = (b[:, hi] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    if t == T.MXFP4:  # largest exponent whose values all stay finite in float32
        b[:, 0] = rng.integers(0, 253, n_blocks, dtype=np.uint8)
    return b


def _gguf_dequant(packed: np.ndarray, t) -> np.ndarray:
    return np.asarray(gq.dequantize(packed, GGMLQuantizationType(int(t))), dtype=np.float32)


def _assert_bits_equal(ours: torch.Tensor, theirs: np.ndarray) -> None:
    """Equal float32 bit patterns (so also the sign of zeros), any NaN matching any NaN."""
    theirs_t = torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32))
    assert ours.dtype == torch.float32 and ours.shape == theirs_t.shape
    nan = torch.isnan(ours)
    assert torch.equal(nan, torch.isnan(theirs_t))
    a, b = ours[~nan].view(torch.int32), theirs_t[~nan].view(torch.int32)
    bad = (a != b).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} values differ, first at {bad[0].item()}: {ours[~nan][bad[0]]} vs {theirs_t[~nan][bad[0]]}"
    )


def _rows(t, rows: int, n_blocks_per_row: int, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(blocks.reshape(rows, n_blocks_per_row * gt.TYPE_INFO[t].type_size).copy())


# ------------------------------------------------------------------------------------------------
# dequantize vs gguf-py
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", GGUF_DEQUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,nb", SHAPES)
def test_dequantize_random_bytes_matches_gguf(t, rows, nb):
    rng = np.random.default_rng(1000 * int(t) + 10 * rows + nb)
    info = gt.TYPE_INFO[t]
    packed = _rows(t, rows, nb, _random_blocks(t, rows * nb, rng))
    cols = nb * info.block_size
    ours = ref.dequantize(packed, t, rows, cols)
    _assert_bits_equal(ours, _gguf_dequant(packed.numpy(), t).reshape(rows, cols))


@pytest.mark.parametrize("t", GGUF_QUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,nb", SHAPES)
def test_dequantize_gguf_quantized_data_matches_gguf(t, rows, nb):
    rng = np.random.default_rng(2000 * int(t) + 10 * rows + nb)
    cols = nb * gt.TYPE_INFO[t].block_size
    x = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 10, (rows, 1))).astype(np.float32)
    packed_np = np.ascontiguousarray(gq.quantize(x, GGMLQuantizationType(int(t)))).view(np.uint8)
    packed = torch.from_numpy(packed_np.reshape(rows, -1).copy())
    _assert_bits_equal(ref.dequantize(packed, t, rows, cols), _gguf_dequant(packed_np, t).reshape(rows, cols))


def test_dequantize_all_bytes_for_small_blocks():
    """Every byte value in every byte position of the 1-2 byte-field types decodes like gguf-py."""
    for t in (T.F16, T.BF16, T.MXFP4, T.NVFP4):
        size = gt.TYPE_INFO[t].type_size
        b = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, size))
        if t == T.MXFP4:
            b[:, 0] = np.minimum(b[:, 0], 252)
        cols = 256 * gt.TYPE_INFO[t].block_size
        packed = torch.from_numpy(b.reshape(1, -1).copy())
        _assert_bits_equal(
            ref.dequantize(packed, t, 1, cols), _gguf_dequant(b.reshape(1, -1), t).reshape(1, cols)
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dequantize_output_dtype(dtype):
    rng = np.random.default_rng(7)
    packed = _rows(T.Q4_K, 3, 2, _random_blocks(T.Q4_K, 6, rng))
    f32 = ref.dequantize(packed, T.Q4_K, 3, 512)
    out = ref.dequantize(packed, "q4_k", 3, 512, dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, f32.to(dtype))


# ------------------------------------------------------------------------------------------------
# Q1_0 / Q2_0 (not in gguf-py) and NVFP4 scales: hand-built blocks
# ------------------------------------------------------------------------------------------------


def _f16_bytes(v: float) -> list[int]:
    return list(np.array([v], dtype=np.float16).view(np.uint8))


def test_q1_0_hand_built_block():
    qs = [0b00000101, 0xFF, 0x00, 0x80] + [0x0F] * 12
    packed = torch.tensor([_f16_bytes(0.5) + qs], dtype=torch.uint8)
    y = ref.dequantize(packed, T.Q1_0, 1, 128)[0]
    assert y[:8].tolist() == [0.5, -0.5, 0.5, -0.5, -0.5, -0.5, -0.5, -0.5]
    assert y[8:16].tolist() == [0.5] * 8
    assert y[16:24].tolist() == [-0.5] * 8
    assert y[24:32].tolist() == [-0.5] * 7 + [0.5]
    assert y[32:].tolist() == ([0.5] * 4 + [-0.5] * 4) * 12


def test_q2_0_hand_built_block():
    qs = [0b11100100, 0b00011011] + [0b01010101] * 14
    packed = torch.tensor([_f16_bytes(-0.25) + qs], dtype=torch.uint8)
    y = ref.dequantize(packed, T.Q2_0, 1, 64)[0]
    assert y[:4].tolist() == [0.25, 0.0, -0.25, -0.5]  # codes 0, 1, 2, 3 -> -1, 0, 1, 2 times d
    assert y[4:8].tolist() == [-0.5, -0.25, 0.0, 0.25]
    assert all(v == 0.0 for v in y[8:].tolist())


def _pack_q1_0(x: np.ndarray) -> list[int]:
    """One Q1_0 block the way quantize_row_q1_0_ref builds it: d = mean |x|, bit j = x[j] >= 0."""
    d = np.float32(np.abs(x).astype(np.float32).sum(dtype=np.float32) / np.float32(128))
    qs = [sum(1 << k for k in range(8) if x[8 * i + k] >= 0) for i in range(16)]
    return _f16_bytes(d) + qs


def _pack_q2_0(x: np.ndarray) -> list[int]:
    """One Q2_0 block the way quantize_row_q2_0_ref builds it: d = amax,
    code = clamp(roundf(x / d) + 1, 0, 3), four codes per byte, lowest bits first."""
    d = np.float32(np.abs(x).max())
    inv = np.float32(1) / d if d > 0 else np.float32(0)
    codes = [min(3, max(0, int(np.sign(v * inv) * np.floor(abs(v * inv) + 0.5)) + 1)) for v in x]
    qs = [sum(codes[4 * i + k] << (2 * k) for k in range(4)) for i in range(16)]
    return _f16_bytes(d) + qs


def test_q1_0_q2_0_round_trip():
    rng = np.random.default_rng(3)
    x1 = rng.standard_normal((4, 128)).astype(np.float32)
    p1 = torch.tensor([_pack_q1_0(r) for r in x1], dtype=torch.uint8)
    d1 = torch.tensor([float(np.float16(np.abs(r).sum(dtype=np.float32) / 128)) for r in x1])[:, None]
    y1 = ref.dequantize(p1, T.Q1_0, 4, 128)
    assert torch.equal(y1, torch.where(torch.from_numpy(x1) >= 0, d1, -d1))

    x2 = (rng.standard_normal((4, 64)) * 2).astype(np.float32)
    p2 = torch.tensor([_pack_q2_0(r) for r in x2], dtype=torch.uint8)
    y2 = ref.dequantize(p2, T.Q2_0, 4, 64)
    d2 = torch.from_numpy(np.abs(x2).max(1).astype(np.float16).astype(np.float32))[:, None]
    q = torch.round(torch.from_numpy(x2) / torch.from_numpy(np.abs(x2).max(1))[:, None]).clamp(-1, 2)
    assert torch.equal(y2, q * d2)
    # the round trip reproduces every value to within half a step (values above 1.5 * amax
    # cannot occur, so nothing is clipped)
    assert ((y2 - torch.from_numpy(x2)).abs() <= 0.5 * d2 * 1.001).all()


def test_nvfp4_hand_built_block():
    # scales: 1.0 (e=7, m=0), 0x00 -> 0, 0x7F -> 0, 0x01 -> subnormal 2**-9; all halved
    scales = [0x38, 0x00, 0x7F, 0x01]
    qs = [0x17] * 8 + [0x77] * 8 + [0x77] * 8 + [0xF7] * 8  # nibble 7 -> 6.0, 1 -> 0.5, 15 -> -6.0
    packed = torch.tensor([scales + qs], dtype=torch.uint8)
    y = ref.dequantize(packed, T.NVFP4, 1, 64)[0]
    assert y[:16].tolist() == [6.0] * 8 + [0.5] * 8
    assert y[16:48].tolist() == [0.0] * 32
    assert y[48:].tolist() == [6.0 * 2.0**-9] * 8 + [-6.0 * 2.0**-9] * 8


# ------------------------------------------------------------------------------------------------
# quantize_reference vs gguf-py's numpy ports of ggml's reference quantizers
# ------------------------------------------------------------------------------------------------


def _awkward_rows(block: int, rng: np.random.Generator) -> np.ndarray:
    """Rows with zero blocks, ties, repeated +/- maxima, constant blocks and wide ranges."""
    n = 8
    x = rng.standard_normal((n, block)).astype(np.float32)
    x[0] = 0
    x[1] = np.float32(3.25)
    x[2, ::2], x[2, 1::2] = 4.0, -4.0
    x[3] = np.arange(block, dtype=np.float32) - block // 2  # exact halves after scaling
    x[4, :4] = [127, 2.5, -3.5, 0.5]
    x[4, 4:] = 0.5
    x[5] *= 1e-6
    x[6] *= 1e4
    x[7, 1] = -np.abs(x[7]).max() * 2
    return x


@pytest.mark.parametrize("t", REF_QUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,nb", SHAPES)
def test_quantize_reference_matches_gguf(t, rows, nb):
    rng = np.random.default_rng(3000 * int(t) + 10 * rows + nb)
    cols = nb * gt.TYPE_INFO[t].block_size
    x = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
    ours = ref.quantize_reference(torch.from_numpy(x), t)
    theirs = (
        np.ascontiguousarray(gq.quantize(x, GGMLQuantizationType(int(t)))).view(np.uint8).reshape(rows, -1)
    )
    assert ours.dtype == torch.uint8
    assert torch.equal(ours, torch.from_numpy(theirs.copy()))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("t", REF_QUANT, ids=lambda t: t.name)
def test_quantize_reference_edge_cases_match_gguf(t):
    block = 32 if gt.TYPE_INFO[t].block_size == 1 else gt.TYPE_INFO[t].block_size
    x = _awkward_rows(block, np.random.default_rng(int(t)))
    if t in (T.F32, T.F16, T.BF16):
        x[0, :6] = [np.inf, -np.inf, np.nan, 1e-40, -0.0, 65520.0]
    ours = ref.quantize_reference(torch.from_numpy(x), t)
    theirs = (
        np.ascontiguousarray(gq.quantize(x, GGMLQuantizationType(int(t)))).view(np.uint8).reshape(len(x), -1)
    )
    assert torch.equal(ours, torch.from_numpy(theirs.copy()))


def test_quantize_reference_input_dtypes():
    x = torch.randn(2, 64, dtype=torch.float64)
    assert torch.equal(ref.quantize_reference(x, T.Q8_0), ref.quantize_reference(x.float(), T.Q8_0))
    assert ref.quantize_reference(x, T.Q4_0).shape == (2, gt.row_bytes(T.Q4_0, 64))


# ------------------------------------------------------------------------------------------------
# Activation quantization
# ------------------------------------------------------------------------------------------------


def _q8_k_scalar(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref followed by dequantize_row_q8_K, one block at a time in float32."""
    out = np.zeros_like(x)
    for i, blk in enumerate(x.reshape(-1, 256)):
        j = int(np.argmax(np.abs(blk)))
        if blk[j] == 0:
            continue
        iscale = np.float32(-127.0) / blk[j]
        q = np.minimum(127, np.rint(iscale * blk))  # nearest_int rounds ties to even
        out.reshape(-1, 256)[i] = (np.float32(1.0) / iscale) * q.astype(np.float32)
    return out


@pytest.mark.parametrize("vdt", [T.Q8_0, T.Q8_1])
def test_quantize_activation_q8_0_matches_gguf_round_trip(vdt):
    rng = np.random.default_rng(11)
    x = np.concatenate(
        [_awkward_rows(32, rng).reshape(2, -1), rng.standard_normal((3, 128)).astype(np.float32)]
    )
    ours = ref.quantize_activation(torch.from_numpy(x), vdt)
    theirs = gq.dequantize(gq.quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    _assert_bits_equal(ours, theirs)


def test_quantize_activation_q8_k_matches_scalar_emulation():
    rng = np.random.default_rng(12)
    x = np.concatenate(
        [_awkward_rows(256, rng).reshape(4, -1), rng.standard_normal((3, 512)).astype(np.float32)]
    )
    ours = ref.quantize_activation(torch.from_numpy(x), T.Q8_K)
    _assert_bits_equal(ours, _q8_k_scalar(x))


@pytest.mark.parametrize("vdt,block", [(T.Q8_0, 32), (T.Q8_1, 32), (T.Q8_K, 256)])
def test_quantize_activation_properties(vdt, block):
    x = torch.randn(5, 4 * block) * torch.logspace(-3, 3, 5)[:, None]
    y = ref.quantize_activation(x, vdt)
    assert y.dtype == torch.float32 and y.shape == x.shape
    y2 = ref.quantize_activation(y, vdt)
    if vdt == T.Q8_K:  # the float32 scale 1 / (-127 / max) can move by an ulp on the second pass
        torch.testing.assert_close(y2, y, rtol=1e-6, atol=0)
    else:
        assert torch.equal(y2, y)
    d = (x.reshape(-1, block).abs().amax(-1, keepdim=True) / 127).expand(-1, block).reshape(x.shape)
    # half a step, plus (Q8_0 / Q8_1) the fp16 rounding of d applied to |q| <= 127
    stored_d_error = 0 if vdt == T.Q8_K else 127 * (d.half().float() - d).abs()
    assert ((y - x).abs() <= d * (0.5 + 1e-5) + stored_d_error).all()
    assert torch.equal(ref.quantize_activation(x.double(), vdt), y)


def test_quantize_activation_float_types():
    x = torch.randn(3, 40) * 1000
    assert torch.equal(ref.quantize_activation(x, T.F32), x)
    assert torch.equal(ref.quantize_activation(x, T.F16), x.half().float())
    assert torch.equal(ref.quantize_activation(x, "bf16"), x.bfloat16().float())


# ------------------------------------------------------------------------------------------------
# Matrix products
# ------------------------------------------------------------------------------------------------

MATMUL_TYPES = [
    T.F32,
    T.F16,
    T.BF16,
    T.Q4_0,
    T.Q5_1,
    T.Q8_0,
    T.Q4_K,
    T.Q6_K,
    T.IQ2_XXS,
    T.IQ4_NL,
    T.MXFP4,
    T.Q1_0,
]


def _packed_matrix(t, rows: int, cols: int, seed: int) -> torch.Tensor:
    info = gt.TYPE_INFO[t]
    rng = np.random.default_rng(seed)
    if t in (T.F32, T.F16, T.BF16):
        return ref.quantize_reference(
            torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32)), t
        )
    blocks = _random_blocks(t, rows * cols // info.block_size, rng)
    if t == T.MXFP4:  # scales 2**-8 .. 2**1, so that products and sums stay far from overflow
        blocks[:, 0] = rng.integers(120, 130, len(blocks), dtype=np.uint8)
    return _rows(t, rows, cols // info.block_size, blocks)


@pytest.mark.parametrize("t", MATMUL_TYPES, ids=lambda t: t.name)
def test_mul_mat_matches_float64(t):
    n, k = 24, 512
    w = _packed_matrix(t, n, k, int(t))
    x = torch.randn(7, k, dtype=torch.bfloat16)
    expected = x.double() @ ref.dequantize(w, t, n, k, dtype=torch.float64).T
    for fn in (ref.mul_mat, ref.mul_mat_vec):
        y = fn(w, x, t, n)
        assert y.dtype == torch.float32 and y.shape == (7, n)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("t", MATMUL_TYPES, ids=lambda t: t.name)
def test_mul_mat_emulated_quantizes_activations(t):
    n, k = 16, 512
    w = _packed_matrix(t, n, k, int(t) + 1)
    x = torch.randn(3, k)
    xq = ref.quantize_activation(x, gt.TYPE_INFO[t].vec_dot_type)
    expected = xq.double() @ ref.dequantize(w, t, n, k, dtype=torch.float64).T
    y = ref.mul_mat_emulated(w, x, t, n)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_get_rows():
    t, n, k = T.IQ3_S, 9, 512
    w = _packed_matrix(t, n, k, 5)
    full = ref.dequantize(w, t, n, k)
    idx = torch.tensor([3, 0, 8, 3])
    assert torch.equal(ref.get_rows(w, idx, t, k), full[idx])
    assert torch.equal(ref.get_rows(w, idx.int(), t, k, dtype=torch.float16), full[idx].half())
    assert ref.get_rows(w, torch.tensor([], dtype=torch.long), t, k).shape == (0, k)


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K, T.IQ1_M, T.BF16], ids=lambda t: t.name)
def test_mul_mat_id(t):
    n_exp, n, k, tokens, n_ids = 4, 8, 256, 6, 3
    info = gt.TYPE_INFO[t]
    rng = np.random.default_rng(int(t))
    if info.block_size == 1:
        w = ref.quantize_reference(torch.randn(n_exp * n, k), t).reshape(n_exp, n, -1)
    else:
        w = _rows(
            t, n_exp * n, k // info.block_size, _random_blocks(t, n_exp * n * k // info.block_size, rng)
        )
        w = w.reshape(n_exp, n, -1)
    x = torch.randn(tokens, k)
    ids = torch.tensor(rng.integers(0, n_exp, (tokens, n_ids)))
    y = ref.mul_mat_id(w, x, ids, t, n)
    assert y.dtype == torch.float32 and y.shape == (tokens, n_ids, n)
    dense = [ref.dequantize(w[e], t, n, k, dtype=torch.float64) for e in range(n_exp)]
    xq = ref.quantize_activation(x, info.vec_dot_type)
    y_emulated = ref.mul_mat_id_emulated(w, x, ids.int(), t, n)
    expected = torch.stack(
        [torch.stack([dense[int(e)] @ x[ti].double() for e in ids[ti]]) for ti in range(tokens)]
    )
    expected_q = torch.stack(
        [torch.stack([dense[int(e)] @ xq[ti].double() for e in ids[ti]]) for ti in range(tokens)]
    )
    atol = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=atol)
    torch.testing.assert_close(y_emulated.double(), expected_q, rtol=1e-5, atol=atol)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_errors():
    good = torch.zeros(2, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unknown"):
        ref.dequantize(good, 4, 2, 32)
    with pytest.raises(ValueError, match="unknown"):
        ref.dequantize(good, 99, 2, 32)
    for activation_only in (T.Q8_1, T.Q8_K):
        with pytest.raises(ValueError, match="not a storage type"):
            ref.dequantize(good, activation_only, 2, 32)
    with pytest.raises(ValueError, match="shape"):
        ref.dequantize(good, T.Q4_0, 2, 64)  # row bytes 36 expected
    with pytest.raises(ValueError, match="shape"):
        ref.dequantize(good, T.Q4_0, 3, 32)
    with pytest.raises(ValueError, match="multiple"):
        ref.dequantize(good, T.Q4_0, 2, 48)
    with pytest.raises(ValueError, match="uint8"):
        ref.dequantize(good.to(torch.int8), T.Q4_0, 2, 32)
    with pytest.raises(ValueError, match="uint8"):
        ref.dequantize(good.float(), T.Q4_0, 2, 32)
    with pytest.raises(ValueError, match="indices"):
        ref.get_rows(good, torch.tensor([2]), T.Q4_0, 32)
    with pytest.raises(ValueError, match="indices"):
        ref.get_rows(good, torch.tensor([[0]]), T.Q4_0, 32)
    with pytest.raises(ValueError, match="x must"):
        ref.mul_mat(good, torch.zeros(32), T.Q4_0, 2)
    with pytest.raises(ValueError, match="shape"):
        ref.mul_mat(good, torch.zeros(1, 64), T.Q4_0, 2)
    experts = torch.zeros(3, 2, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ids"):
        ref.mul_mat_id(experts, torch.zeros(4, 32), torch.full((4, 1), 3), T.Q4_0, 2)
    with pytest.raises(ValueError, match="ids"):
        ref.mul_mat_id(experts, torch.zeros(4, 32), torch.zeros(5, 1, dtype=torch.long), T.Q4_0, 2)
    with pytest.raises(ValueError, match="blocks"):
        ref.mul_mat_id(good, torch.zeros(4, 32), torch.zeros(4, 1, dtype=torch.long), T.Q4_0, 2)
    with pytest.raises(ValueError, match="multiple"):
        ref.quantize_activation(torch.zeros(2, 48), T.Q8_0)
    with pytest.raises(ValueError, match="vec_dot_type"):
        ref.quantize_activation(torch.zeros(2, 64), T.Q4_0)
    with pytest.raises(ValueError, match="supports"):
        ref.quantize_reference(torch.zeros(2, 256), T.Q4_K)
    with pytest.raises(ValueError, match="multiple"):
        ref.quantize_reference(torch.zeros(2, 48), T.Q8_0)

"""Readable pure-PyTorch reference for ggml's packed GGUF tensor formats.

Everything here is plain tensor code: each storage type has one small decoder that takes the
packed bytes of `n` blocks as a uint8 tensor `(n, type_size)` and returns the `(n, block_size)`
float32 values, following ggml's `dequantize_row_*` arithmetic step by step (same float32
operations in the same order), so results are bit-identical to ggml and gguf-py.

Conventions used in the layout docstrings: offsets are in bytes inside one block, multi-byte
fields are little-endian, `f16` is an IEEE half, "nibbles" of a byte array `qs` mean that value
`j` of the first half is `qs[j] & 15` and value `j` of the second half is `qs[j] >> 4`.

Constant tables: the large IQ codebooks (iq2xxs/iq2xs/iq2s/iq3xxs/iq3s/iq1s grids) are not
written out here. They are taken, lazily and once, from gguf-py (`gguf.quants.<TYPE>.grid`), which
carries the same numbers as ggml; that is the only thing this module takes from gguf-py. All the
decoding logic is its own. Small tables (IQ4_NL values, the doubled E2M1 values, the parity sign
table of the IQ2/IQ3 types) are written or computed here.

Activation quantization (`quantize_activation`, `*_emulated`): before a quantized dot product,
ggml's CPU backend quantizes each activation row to the weight type's `vec_dot_type`. This
module follows ggml's portable reference quantizers (`quantize_row_q8_0_ref`,
`quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`). ggml's x86 AVX path for Q8_0 / Q8_1 uses the
scale `127 / amax` and rounds ties to even instead, so a few elements may differ by one step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from .types import TYPE_INFO, GGMLType, TypeInfo, row_bytes, type_info

__all__ = [
    "dequantize",
    "get_rows",
    "mul_mat",
    "mul_mat_vec",
    "mul_mat_id",
    "quantize_activation",
    "mul_mat_emulated",
    "mul_mat_id_emulated",
    "quantize_reference",
]

QK_K = 256
IQ1S_DELTA = 0.125

# kvalues_iq4nl: the 16 non-linear 4-bit levels of IQ4_NL / IQ4_XS.
_KVALUES_IQ4NL = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)
# kvalues_mxfp4: the E2M1 values doubled (sign bit 3), used by MXFP4 and NVFP4.
_KVALUES_E2M1X2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Bit helpers
# ---------------------------------------------------------------------------------------------


def _f16(b: Tensor) -> Tensor:
    """Little-endian halves: uint8 (..., 2k) -> float32 (..., k)."""
    return b.contiguous().view(torch.float16).float()


def _f16_from_bits(bits: Tensor) -> Tensor:
    """Integer tensor of 16-bit patterns -> the float32 values of those halves."""
    pair = torch.stack([bits & 0xFF, (bits >> 8) & 0xFF], dim=-1).to(torch.uint8)
    return pair.view(torch.float16).squeeze(-1).float()


def _f16_bytes(x: Tensor) -> Tensor:
    """float32 (..., k) -> its halves (rounded to nearest even) as uint8 (..., 2k)."""
    return x.half().contiguous().view(torch.uint8)


def _u16(b: Tensor) -> Tensor:
    """Little-endian uint16 fields: uint8 (..., 2k) -> int32 (..., k)."""
    b = b.int()
    return b[..., 0::2] | (b[..., 1::2] << 8)


def _u32(b: Tensor) -> Tensor:
    """Little-endian uint32 fields: uint8 (..., 4k) -> int64 (..., k)."""
    b = b.long()
    return b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)


def _fields(t: Tensor, width: int, count: int) -> Tensor:
    """Split each integer of `t` into `count` bit fields of `width` bits, lowest first:
    (...) -> (..., count), field i = (t >> (i * width)) & (2**width - 1)."""
    if t.dtype not in (torch.int32, torch.int64):
        t = t.int()
    shifts = torch.arange(0, width * count, width, dtype=t.dtype, device=t.device)
    return (t.unsqueeze(-1) >> shifts) & ((1 << width) - 1)


def _nibbles(b: Tensor) -> Tensor:
    """uint8 (..., k) -> int32 (..., 2k): the k low nibbles, then the k high nibbles."""
    b = b.int()
    return torch.cat([b & 0xF, b >> 4], dim=-1)


def _signs(b: Tensor) -> Tensor:
    """Sign bytes (...) -> float32 (..., 8): -1 where bit j is set, +1 elsewhere."""
    return 1.0 - 2.0 * _fields(b, 1, 8).float()


@functools.cache
def _ksigns() -> Tensor:
    """ksigns_iq2xs: 7 stored sign bits plus an 8th bit that makes the count of set bits even."""
    i = torch.arange(128, dtype=torch.int32)
    parity = _fields(i, 1, 7).sum(-1) & 1
    return i | (parity << 7)


@functools.cache
def _iq_grid(name: str) -> Tensor:
    """ggml's IQ codebook of type `name` as float32 (entries, values per entry), from gguf-py."""
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())


def _lookup(table: Tensor, idx: Tensor) -> Tensor:
    return table.to(idx.device)[idx.long()]


# ---------------------------------------------------------------------------------------------
# Decoders: uint8 (n, type_size) -> float32 (n, block_size)
# ---------------------------------------------------------------------------------------------


def _dequant_f32(b: Tensor) -> Tensor:
    """F32: one little-endian float32 per 4 bytes (returned as a copy, not a view of `b`)."""
    return b.contiguous().view(torch.float32).clone()


def _dequant_f16(b: Tensor) -> Tensor:
    """F16: one IEEE half per 2 bytes."""
    return _f16(b)


def _dequant_bf16(b: Tensor) -> Tensor:
    """BF16: one bfloat16 per 2 bytes, i.e. the upper 16 bits of a float32."""
    pairs = b.reshape(b.shape[0], -1, 2)
    words = torch.cat([torch.zeros_like(pairs), pairs], dim=-1).contiguous()
    return words.view(torch.float32).squeeze(-1)


def _dequant_q4_0(b: Tensor) -> Tensor:
    """Q4_0, 32 values in 18 bytes: d f16 @0, qs[16] nibbles @2; y = (q - 8) * d."""
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18])
    return (q - 8).float() * d


def _dequant_q4_1(b: Tensor) -> Tensor:
    """Q4_1, 32 values in 20 bytes: d f16 @0, m f16 @2, qs[16] nibbles @4; y = q * d + m."""
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20])
    return q.float() * d + m


def _dequant_q5_0(b: Tensor) -> Tensor:
    """Q5_0, 32 values in 22 bytes: d f16 @0, qh u32 @2 (bit j = 5th bit of value j),
    qs[16] nibbles @6 (low 4 bits); y = (q - 16) * d."""
    d = _f16(b[:, 0:2])
    high = _fields(_u32(b[:, 2:6]), 1, 32).squeeze(1)
    q = _nibbles(b[:, 6:22]) | (high.int() << 4)
    return (q - 16).float() * d


def _dequant_q5_1(b: Tensor) -> Tensor:
    """Q5_1, 32 values in 24 bytes: d f16 @0, m f16 @2, qh u32 @4 (bit j = 5th bit of value j),
    qs[16] nibbles @8; y = q * d + m."""
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    high = _fields(_u32(b[:, 4:8]), 1, 32).squeeze(1)
    q = _nibbles(b[:, 8:24]) | (high.int() << 4)
    return q.float() * d + m


def _dequant_q8_0(b: Tensor) -> Tensor:
    """Q8_0, 32 values in 34 bytes: d f16 @0, qs int8[32] @2; y = q * d."""
    d = _f16(b[:, 0:2])
    return b[:, 2:34].view(torch.int8).float() * d


def _dequant_q2_k(b: Tensor) -> Tensor:
    """Q2_K, 256 values in 84 bytes: scales[16] @0 (low nibble: scale, high nibble: min of each
    16 values), qs[64] @16, d f16 @80, dmin f16 @82. Value h*128 + j*32 + l (h < 2, j < 4, l < 32)
    is bits 2j..2j+1 of qs[h*32 + l]; y = d * scale * q - dmin * min."""
    n = b.shape[0]
    sc = b[:, 0:16].int()
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = _fields(b[:, 16:80].reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2).reshape(n, 16, 16)
    dl = (d * (sc & 0xF).float()).unsqueeze(-1)
    ml = (dmin * (sc >> 4).float()).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(n, QK_K)


def _dequant_q3_k(b: Tensor) -> Tensor:
    """Q3_K, 256 values in 110 bytes: hmask[32] @0, qs[64] @32, scales[12] @96, d f16 @108.
    Value h*128 + j*32 + l takes its low 2 bits from bits 2j..2j+1 of qs[h*32 + l] and loses 4
    when bit h*4 + j of hmask[l] is clear. The 16 six-bit scales (minus 32): scale k has low
    nibble scales[k] & 15 (k < 8) or scales[k-8] >> 4, and top bits (scales[8 + k%4] >> 2*(k//4))
    & 3. y = d * (scale - 32) * q."""
    n = b.shape[0]
    s = b[:, 96:108].int()
    low = torch.cat([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], dim=-1)
    high = _fields(s[:, 8:12], 2, 4).transpose(1, 2).reshape(n, 16)
    scale = (low | (high << 4)) - 32
    q = _fields(b[:, 32:96].reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2)
    hbit = _fields(b[:, 0:32], 1, 8).reshape(n, 32, 2, 4).permute(0, 2, 3, 1)
    q = (q - 4 * (1 - hbit)).reshape(n, 16, 16)
    d = _f16(b[:, 108:110])
    dl = (d * scale.float()).unsqueeze(-1)
    return (dl * q.float()).reshape(n, QK_K)


def _scale_min_k4(s: Tensor) -> tuple[Tensor, Tensor]:
    """The eight 6-bit (scale, min) pairs of Q4_K / Q5_K from their 12 packed bytes: for k < 4,
    scale = s[k] & 63, min = s[k+4] & 63; for k >= 4, scale = (s[k+4] & 15) | (s[k-4] >> 6) << 4,
    min = (s[k+4] >> 4) | (s[k] >> 6) << 4."""
    s = s.int()
    a, m, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 63, (c >> 4) | ((m >> 6) << 4)], dim=-1)
    return scale, mins


def _dequant_q4_k(b: Tensor) -> Tensor:
    """Q4_K, 256 values in 144 bytes: d f16 @0, dmin f16 @2, scales[12] @4 (see _scale_min_k4),
    qs[128] @16. Chunk c < 4 of 32 bytes gives sub-block 2c (low nibbles) and 2c+1 (high
    nibbles) of 32 values; y = d * scale * q - dmin * min."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scale, mins = _scale_min_k4(b[:, 4:16])
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    dl = (d * scale.float()).unsqueeze(-1)
    ml = (dmin * mins.float()).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(n, QK_K)


def _dequant_q5_k(b: Tensor) -> Tensor:
    """Q5_K, 256 values in 176 bytes: d f16 @0, dmin f16 @2, scales[12] @4, qh[32] @16,
    qs[128] @48. As Q4_K, plus 16 when bit k of qh[l] is set for value l of sub-block k."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scale, mins = _scale_min_k4(b[:, 4:16])
    high = _fields(b[:, 16:48], 1, 8).transpose(1, 2)
    q = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32) | (high << 4)
    dl = (d * scale.float()).unsqueeze(-1)
    ml = (dmin * mins.float()).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(n, QK_K)


def _dequant_q6_k(b: Tensor) -> Tensor:
    """Q6_K, 256 values in 210 bytes: ql[128] @0, qh[64] @128, scales int8[16] @192, d f16 @208.
    In half h, quarter k < 4, value l < 32: low 4 bits are nibble k//2 of ql[h*64 + (k%2)*32 + l],
    top 2 bits are bits 2k..2k+1 of qh[h*32 + l]; each 16 consecutive values share a scale.
    y = d * scale * (q - 32)."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32).int()
    low = torch.stack([ql & 0xF, ql >> 4], dim=2).reshape(n, 2, 4, 32)
    high = _fields(b[:, 128:192].reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2)
    q = ((low | (high << 4)) - 32).reshape(n, 16, 16)
    scale = b[:, 192:208].view(torch.int8).float()
    d = _f16(b[:, 208:210])
    return ((d * scale).unsqueeze(-1) * q.float()).reshape(n, QK_K)


def _dequant_iq2_xxs(b: Tensor) -> Tensor:
    """IQ2_XXS, 256 values in 66 bytes: d f16 @0, then 8 groups of 8 bytes for 32 values each:
    4 grid indices (bytes) into iq2xxs_grid (8 values each), and a u32 with four 7-bit sign
    indices into ksigns (bits 7l..7l+6) and a 4-bit scale ls (bits 28..31).
    y = d * (0.5 + ls) * 0.25 * grid * sign."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    g = b[:, 2:66].reshape(n, 8, 8)
    aux = _u32(g[..., 4:8]).squeeze(-1)
    db = d * (0.5 + (aux >> 28).float()) * 0.25
    signs = _signs(_lookup(_ksigns(), _fields(aux, 7, 4)))
    grid = _lookup(_iq_grid("IQ2_XXS"), g[..., 0:4])
    return (db[..., None, None] * grid * signs).reshape(n, QK_K)


def _iq2_scales(d: Tensor, scales: Tensor) -> Tensor:
    """IQ2_XS / IQ2_S: per 32 values one byte of two 4-bit scales, each for 16 values;
    returns d * (0.5 + s) * 0.25 as (n, 8, 4), one per 8 values."""
    db = d.unsqueeze(-1) * (0.5 + _fields(scales, 4, 2).float()) * 0.25
    return db.repeat_interleave(2, dim=-1)


def _dequant_iq2_xs(b: Tensor) -> Tensor:
    """IQ2_XS, 256 values in 74 bytes: d f16 @0, qs u16[32] @2 (bits 0..8: index into iq2xs_grid,
    bits 9..15: sign index into ksigns, one per 8 values), scales[8] @66 (two 4-bit scales per
    32 values). y = d * (0.5 + s) * 0.25 * grid * sign."""
    n = b.shape[0]
    qs = _u16(b[:, 2:66]).reshape(n, 8, 4)
    db = _iq2_scales(_f16(b[:, 0:2]), b[:, 66:74])
    signs = _signs(_lookup(_ksigns(), qs >> 9))
    grid = _lookup(_iq_grid("IQ2_XS"), qs & 511)
    return (db.unsqueeze(-1) * grid * signs).reshape(n, QK_K)


def _dequant_iq2_s(b: Tensor) -> Tensor:
    """IQ2_S, 256 values in 82 bytes: d f16 @0, qs[32] @2 (low 8 bits of an iq2s_grid index per
    8 values), signs[32] @34 (one plain sign byte per 8 values), qh[8] @66 (bits 2l..2l+1: index
    bits 8..9 of group l of 32 values), scales[8] @74 (as IQ2_XS)."""
    n = b.shape[0]
    idx = b[:, 2:34].reshape(n, 8, 4).int() | (_fields(b[:, 66:74], 2, 4) << 8)
    db = _iq2_scales(_f16(b[:, 0:2]), b[:, 74:82])
    signs = _signs(b[:, 34:66].reshape(n, 8, 4))
    grid = _lookup(_iq_grid("IQ2_S"), idx)
    return (db.unsqueeze(-1) * grid * signs).reshape(n, QK_K)


def _dequant_iq3_xxs(b: Tensor) -> Tensor:
    """IQ3_XXS, 256 values in 98 bytes: d f16 @0, qs[64] @2 (index into iq3xxs_grid, 4 values
    each), then 8 u32 @66, one per 32 values: four 7-bit ksigns indices (one per 8 values) and a
    4-bit scale ls in bits 28..31. y = d * (0.5 + ls) * 0.5 * grid * sign."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    aux = _u32(b[:, 66:98])
    db = d * (0.5 + (aux >> 28).float()) * 0.5
    signs = _signs(_lookup(_ksigns(), _fields(aux, 7, 4)))
    grid = _lookup(_iq_grid("IQ3_XXS"), b[:, 2:66].reshape(n, 8, 8)).reshape(n, 8, 4, 8)
    return (db[..., None, None] * grid * signs).reshape(n, QK_K)


def _dequant_iq3_s(b: Tensor) -> Tensor:
    """IQ3_S, 256 values in 110 bytes: d f16 @0, qs[64] @2, qh[8] @66, signs[32] @74,
    scales[4] @106. Group k of 32 values: grid indices qs[8k + m] | (bit m of qh[k]) << 8 into
    iq3s_grid (4 values each), sign bytes signs[4k..4k+3] (one per 8 values), scale s = nibble
    k%2 of scales[k//2]. y = d * (1 + 2s) * grid * sign."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    idx = b[:, 2:66].reshape(n, 8, 8).int() | (_fields(b[:, 66:74], 1, 8) << 8)
    db = d * (1 + 2 * _fields(b[:, 106:110], 4, 2).reshape(n, 8)).float()
    signs = _signs(b[:, 74:106].reshape(n, 8, 4))
    grid = _lookup(_iq_grid("IQ3_S"), idx).reshape(n, 8, 4, 8)
    return (db[..., None, None] * grid * signs).reshape(n, QK_K)


def _dequant_iq1_s(b: Tensor) -> Tensor:
    """IQ1_S, 256 values in 50 bytes: d f16 @0, qs[32] @2, qh u16[8] @34. Group k of 32 values:
    grid index qs[4k + l] | ((qh[k] >> 3l) & 7) << 8 into iq1s_grid (8 values in -1..1),
    scale s = (qh[k] >> 12) & 7, delta = -1/8 if bit 15 of qh[k] else +1/8.
    y = d * (2s + 1) * (grid + delta)."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qh = _u16(b[:, 34:50])
    dl = d * (2 * ((qh >> 12) & 7) + 1).float()
    delta = torch.where((qh & 0x8000) != 0, -IQ1S_DELTA, IQ1S_DELTA)
    idx = b[:, 2:34].reshape(n, 8, 4).int() | (_fields(qh, 3, 4) << 8)
    grid = _lookup(_iq_grid("IQ1_S"), idx)
    return (dl[..., None, None] * (grid + delta[..., None, None])).reshape(n, QK_K)


def _dequant_iq1_m(b: Tensor) -> Tensor:
    """IQ1_M, 256 values in 56 bytes: qs[32] @0, qh[16] @32, scales u16[4] @48. The f16 d is
    spread over the top nibbles of the four scales words (word i gives bits 4i..4i+3); the other
    12 bits of each word are four 3-bit scales s, one per 16 values. Each group g of 8 values has
    grid index qs[g] | (nibble & 7) << 8 into iq1s_grid and delta = -1/8 if nibble & 8 else +1/8,
    with nibble = nibble g%2 of qh[g//2]. y = d * (2s + 1) * (grid + delta)."""
    n = b.shape[0]
    sc = _u16(b[:, 48:56])
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = _f16_from_bits(bits).unsqueeze(-1)
    dl = d * (2 * _fields(sc, 3, 4).reshape(n, 16) + 1).float()
    nib = _fields(b[:, 32:48], 4, 2).reshape(n, 32)
    idx = b[:, 0:32].int() | ((nib & 7) << 8)
    delta = torch.where((nib & 8) != 0, -IQ1S_DELTA, IQ1S_DELTA).reshape(n, 16, 2, 1)
    grid = _lookup(_iq_grid("IQ1_S"), idx).reshape(n, 16, 2, 8)
    return (dl[..., None, None] * (grid + delta)).reshape(n, QK_K)


def _dequant_iq4_nl(b: Tensor) -> Tensor:
    """IQ4_NL, 32 values in 18 bytes: d f16 @0, qs[16] nibbles @2; y = d * kvalues_iq4nl[q]."""
    d = _f16(b[:, 0:2])
    return d * _lookup(_KVALUES_IQ4NL, _nibbles(b[:, 2:18]))


def _dequant_iq4_xs(b: Tensor) -> Tensor:
    """IQ4_XS, 256 values in 136 bytes: d f16 @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8.
    Group k of 32 values: 6-bit scale ls = nibble k%2 of scales_l[k//2] | ((scales_h >> 2k) & 3)
    << 4, values = nibbles of qs[16k..16k+15]; y = d * (ls - 32) * kvalues_iq4nl[q]."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    high = _fields(_u16(b[:, 2:4]), 2, 8).reshape(n, 8)
    ls = _fields(b[:, 4:8], 4, 2).reshape(n, 8) | (high << 4)
    dl = (d * (ls - 32).float()).unsqueeze(-1)
    q = _nibbles(b[:, 8:136].reshape(n, 8, 16))
    return (dl * _lookup(_KVALUES_IQ4NL, q)).reshape(n, QK_K)


def _trits(b: Tensor, count: int) -> Tensor:
    """Base-3 digits stored as fixed-point fractions: (..., k) bytes -> (..., count, k) in 0..2,
    digit i = ((b * 3**i mod 256) * 3) >> 8."""
    pow3 = torch.tensor([1, 3, 9, 27, 81][:count], dtype=torch.int32, device=b.device)
    q = (b.int().unsqueeze(-2) * pow3.unsqueeze(-1)) & 0xFF
    return (q * 3) >> 8


def _dequant_tq1_0(b: Tensor) -> Tensor:
    """TQ1_0, 256 values in 54 bytes: qs[48] @0, qh[4] @48, d f16 @52. Bytes hold base-3 digits
    (see _trits): qs[0:32] give 5 x 32 values (digit-major), qs[32:48] 5 x 16, qh 4 x 4;
    y = (digit - 1) * d."""
    n = b.shape[0]
    d = _f16(b[:, 52:54])
    q = torch.cat(
        [
            _trits(b[:, 0:32], 5).reshape(n, 160),
            _trits(b[:, 32:48], 5).reshape(n, 80),
            _trits(b[:, 48:52], 4).reshape(n, 16),
        ],
        dim=-1,
    )
    return (q - 1).float() * d


def _dequant_tq2_0(b: Tensor) -> Tensor:
    """TQ2_0, 256 values in 66 bytes: qs[64] @0, d f16 @64. Value h*128 + j*32 + l is bits
    2j..2j+1 of qs[h*32 + l]; y = (q - 1) * d."""
    n = b.shape[0]
    d = _f16(b[:, 64:66])
    q = _fields(b[:, 0:64].reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2).reshape(n, QK_K)
    return (q - 1).float() * d


def _e8m0_half(e: Tensor) -> Tensor:
    """ggml_e8m0_to_fp32_half: 2**(e - 128) as float32 (denormal for e < 2)."""
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _dequant_mxfp4(b: Tensor) -> Tensor:
    """MXFP4, 32 values in 17 bytes: e (E8M0 exponent) @0, qs[16] nibbles @1 (E2M1 codes);
    y = kvalues_mxfp4[q] * 2**(e - 128) (the table holds E2M1 values doubled)."""
    d = _e8m0_half(b[:, 0:1])
    return _lookup(_KVALUES_E2M1X2, _nibbles(b[:, 1:17])) * d


def _ue4m3_half(x: Tensor) -> Tensor:
    """ggml_ue4m3_to_fp32: unsigned E4M3 (bias 7; bit 7 ignored) times 0.5, with 0x7F read as 0."""
    x = x.int()
    e, m = (x >> 3) & 0xF, (x & 7).float()
    pow2 = ((e + 116) << 23).view(torch.float32)  # 2**(e - 11)
    half = torch.where(e == 0, m * 2.0**-10, (8 + m) * pow2)
    return torch.where(x == 0x7F, 0.0, half)


def _dequant_nvfp4(b: Tensor) -> Tensor:
    """NVFP4, 64 values in 36 bytes: d[4] UE4M3 scales @0 (one per 16 values), qs[32] @4.
    Sub-block s uses qs[8s..8s+7] as nibbles; y = kvalues_mxfp4[q] * ue4m3(d[s]) / 2."""
    n = b.shape[0]
    d = _ue4m3_half(b[:, 0:4]).unsqueeze(-1)
    q = _nibbles(b[:, 4:36].reshape(n, 4, 8))
    return (_lookup(_KVALUES_E2M1X2, q) * d).reshape(n, 64)


def _dequant_q1_0(b: Tensor) -> Tensor:
    """Q1_0, 128 values in 18 bytes: d f16 @0, qs[16] @2, value j is bit j%8 of qs[j//8];
    y = d if the bit is set else -d."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    bit = _fields(b[:, 2:18], 1, 8).reshape(n, 128)
    return torch.where(bit != 0, d, -d)


def _dequant_q2_0(b: Tensor) -> Tensor:
    """Q2_0, 64 values in 18 bytes: d f16 @0, qs[16] @2, value j is bits 2(j%4)..2(j%4)+1 of
    qs[j//4]; y = (q - 1) * d."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = _fields(b[:, 2:18], 2, 4).reshape(n, 64)
    return (q - 1).float() * d


_DECODERS: dict[GGMLType, Callable[[Tensor], Tensor]] = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q2_K: _dequant_q2_k,
    GGMLType.Q3_K: _dequant_q3_k,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
    GGMLType.IQ2_XXS: _dequant_iq2_xxs,
    GGMLType.IQ2_XS: _dequant_iq2_xs,
    GGMLType.IQ2_S: _dequant_iq2_s,
    GGMLType.IQ3_XXS: _dequant_iq3_xxs,
    GGMLType.IQ3_S: _dequant_iq3_s,
    GGMLType.IQ1_S: _dequant_iq1_s,
    GGMLType.IQ1_M: _dequant_iq1_m,
    GGMLType.IQ4_NL: _dequant_iq4_nl,
    GGMLType.IQ4_XS: _dequant_iq4_xs,
    GGMLType.TQ1_0: _dequant_tq1_0,
    GGMLType.TQ2_0: _dequant_tq2_0,
    GGMLType.MXFP4: _dequant_mxfp4,
    GGMLType.NVFP4: _dequant_nvfp4,
    GGMLType.Q1_0: _dequant_q1_0,
    GGMLType.Q2_0: _dequant_q2_0,
}


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _storage_info(ggml_type) -> TypeInfo:
    info = type_info(ggml_type)
    if not info.storage or info.type not in _DECODERS:
        raise ValueError(
            f"{info.name} is not a storage type (it only exists as a dot-product activation format)"
        )
    return info


def _check_blocks(blocks, info: TypeInfo, rows: int, cols: int) -> None:
    if not isinstance(blocks, Tensor) or blocks.dtype != torch.uint8:
        got = blocks.dtype if isinstance(blocks, Tensor) else type(blocks).__name__
        raise ValueError(f"packed {info.name} blocks must be a torch.uint8 tensor, got {got}")
    rb = row_bytes(info.type, cols)
    if tuple(blocks.shape) != (rows, rb):
        raise ValueError(
            f"{info.name} blocks for {rows} rows x {cols} cols must have shape ({rows}, {rb}), "
            f"got {tuple(blocks.shape)}"
        )


def _check_matrix(x, name: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a 2-D floating point tensor")


def _check_indices(idx, name: str, dims: int, bound: int) -> None:
    is_int = isinstance(idx, Tensor) and not (
        idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool
    )
    if not is_int or idx.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D integer tensor")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= bound):
        raise ValueError(
            f"{name} must lie in [0, {bound}), got values in [{int(idx.min())}, {int(idx.max())}]"
        )


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------


def dequantize(blocks: Tensor, ggml_type, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed rows uint8 (rows, row_bytes) of `ggml_type` -> (rows, cols) values, computed in
    float32 exactly as ggml does, then cast to `dtype`."""
    info = _storage_info(ggml_type)
    _check_blocks(blocks, info, rows, cols)
    n_blocks = rows * (cols // info.block_size)
    values = _DECODERS[info.type](blocks.reshape(n_blocks, info.type_size))
    return values.reshape(rows, cols).to(dtype)


def get_rows(
    blocks: Tensor, indices: Tensor, ggml_type, cols: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Dequantized rows `indices` (1-D) of a packed (rows, row_bytes) tensor -> (len(indices), cols)."""
    info = _storage_info(ggml_type)
    if not isinstance(blocks, Tensor) or blocks.dim() != 2:
        raise ValueError(f"packed {info.name} blocks must be a 2-D (rows, row_bytes) tensor")
    rows = blocks.shape[0]
    _check_blocks(blocks, info, rows, cols)
    _check_indices(indices, "indices", 1, rows)
    picked = blocks[indices.to(device=blocks.device, dtype=torch.long)]
    return dequantize(picked, info.type, picked.shape[0], cols, dtype)


def mul_mat(blocks: Tensor, x: Tensor, ggml_type, out_features: int) -> Tensor:
    """y = x @ W.T in float32: W packed (out_features, row_bytes), x (M, K) of any float dtype,
    y (M, out_features)."""
    _check_matrix(x, "x")
    w = dequantize(blocks, ggml_type, out_features, x.shape[1])
    return x.float() @ w.T


def mul_mat_vec(blocks: Tensor, x: Tensor, ggml_type, out_features: int) -> Tensor:
    """Same as mul_mat (ggml's matrix-vector path computes the same product)."""
    return mul_mat(blocks, x, ggml_type, out_features)


def mul_mat_group(blocks: list[Tensor], x: Tensor, ggml_types, out_features) -> list[Tensor]:
    """One mul_mat per weight, all on the same activations x (M, K)."""
    return [mul_mat(b, x, t, n) for b, t, n in zip(blocks, ggml_types, out_features, strict=True)]


def mul_mat_id(blocks: Tensor, x: Tensor, ids: Tensor, ggml_type, out_features: int) -> Tensor:
    """Mixture-of-experts product: blocks (E, N, row_bytes) holds E packed weights, x (T, K),
    ids int (T, n_ids) -> float32 (T, n_ids, N) with out[t, j] = W[ids[t, j]] @ x[t]."""
    _check_matrix(x, "x")
    if not isinstance(blocks, Tensor) or blocks.dim() != 3 or blocks.shape[1] != out_features:
        shape = tuple(blocks.shape) if isinstance(blocks, Tensor) else None
        raise ValueError(f"blocks must have shape (n_experts, {out_features}, row_bytes), got {shape}")
    n_experts, _, rb = blocks.shape
    _check_indices(ids, "ids", 2, n_experts)
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids has {ids.shape[0]} rows but x has {x.shape[0]}")
    k = x.shape[1]
    w = dequantize(blocks.reshape(n_experts * out_features, rb), ggml_type, n_experts * out_features, k)
    w = w.reshape(n_experts, out_features, k)
    xf = x.float()
    ids = ids.to(device=x.device, dtype=torch.long)
    out = torch.zeros(ids.shape[0], ids.shape[1], out_features, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        out[t, j] = xf[t] @ w[e].T
    return out


# ---------------------------------------------------------------------------------------------
# Activation quantization emulation
# ---------------------------------------------------------------------------------------------


def _round_half_away(v: Tensor) -> Tensor:
    """C roundf: nearest integer, ties away from zero."""
    a = v.abs()
    f = a.floor()
    return torch.sign(v) * (f + (a - f >= 0.5).float())


def _safe_inverse(d: Tensor) -> Tensor:
    """1 / d, and 0 where d == 0 (ggml's `id = d ? 1.0f/d : 0.0f`)."""
    return torch.where(d != 0, 1.0 / d, 0.0)


def _q8_0_scale_and_quants(xb: Tensor) -> tuple[Tensor, Tensor]:
    """quantize_row_q8_0_ref on blocks (n, 32): d = amax / 127 and q = roundf(x / d) (as x * (1/d))."""
    d = xb.abs().amax(dim=-1, keepdim=True) / 127
    return d, _round_half_away(xb * _safe_inverse(d))


def _q8_0_roundtrip(x: Tensor) -> Tensor:
    """Values of quantize_row_q8_0_ref / q8_1_ref: q * fp16(d). (Q8_1's extra sum term does not
    change the values.)"""
    d, q = _q8_0_scale_and_quants(x.reshape(-1, 32))
    return (q * d.half().float()).reshape(x.shape)


def _q8_k_roundtrip(x: Tensor) -> Tensor:
    """Values of quantize_row_q8_K_ref: with `max` the signed value of largest magnitude in each
    block of 256, iscale = -127 / max, q = min(127, round_half_even(iscale * x)), d = 1 / iscale
    kept as float32; an all-zero block gives zeros."""
    xb = x.reshape(-1, QK_K)
    mx = xb.gather(-1, xb.abs().argmax(dim=-1, keepdim=True))
    nonzero = mx != 0
    iscale = torch.where(nonzero, torch.full_like(mx, -127.0) / mx, 0.0)
    q = torch.round(iscale * xb).clamp(max=127)
    d = torch.where(nonzero, 1.0 / iscale, 0.0)
    return (d * q).reshape(x.shape)


def quantize_activation(x: Tensor, vec_dot_type) -> Tensor:
    """x (..., K) -> float32 x with each row replaced by what ggml's CPU backend feeds the dot
    product of a weight whose vec_dot_type is `vec_dot_type`: dequantize(quantize(row)) for
    Q8_0 / Q8_1 (blocks of 32) and Q8_K (blocks of 256), the row rounded to half / bfloat16 for
    F16 / BF16, the row itself for F32."""
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError("x must be a floating point tensor of at least one dimension")
    t = type_info(vec_dot_type).type
    xf = x.float()
    if t == GGMLType.F32:
        return xf.clone()
    if t == GGMLType.F16:
        return xf.half().float()
    if t == GGMLType.BF16:
        return xf.bfloat16().float()
    if t in (GGMLType.Q8_0, GGMLType.Q8_1, GGMLType.Q8_K):
        block = TYPE_INFO[t].block_size
        if x.shape[-1] % block:
            raise ValueError(f"row length {x.shape[-1]} is not a multiple of the {t.name} block size {block}")
        return _q8_k_roundtrip(xf) if t == GGMLType.Q8_K else _q8_0_roundtrip(xf)
    raise ValueError(f"{t.name} is not a vec_dot_type (expected F32, F16, BF16, Q8_0, Q8_1 or Q8_K)")


def mul_mat_emulated(blocks: Tensor, x: Tensor, ggml_type, out_features: int) -> Tensor:
    """mul_mat with x first passed through quantize_activation for the weight's vec_dot_type."""
    _check_matrix(x, "x")
    xq = quantize_activation(x, _storage_info(ggml_type).vec_dot_type)
    return mul_mat(blocks, xq, ggml_type, out_features)


def mul_mat_id_emulated(blocks: Tensor, x: Tensor, ids: Tensor, ggml_type, out_features: int) -> Tensor:
    """mul_mat_id with x first passed through quantize_activation for the weight's vec_dot_type."""
    _check_matrix(x, "x")
    xq = quantize_activation(x, _storage_info(ggml_type).vec_dot_type)
    return mul_mat_id(blocks, xq, ids, ggml_type, out_features)


# ---------------------------------------------------------------------------------------------
# Reference quantizers (simple types): float32 blocks (n, block_size) -> uint8 (n, type_size)
# ---------------------------------------------------------------------------------------------


def _signed_absmax(xb: Tensor) -> Tensor:
    """Per block, the first value of largest magnitude, with its sign: (n, k) -> (n, 1)."""
    return xb.gather(-1, xb.abs().argmax(dim=-1, keepdim=True))


def _pack_nibbles(q: Tensor) -> Tensor:
    """(n, 2k) values in 0..15 -> (n, k) bytes: value j low nibble, value j + k high nibble."""
    k = q.shape[-1] // 2
    return (q[:, :k] | (q[:, k:] << 4)).to(torch.uint8)


def _pack_bits32(bits: Tensor) -> Tensor:
    """(n, 32) bits -> (n, 4) bytes of the little-endian u32 with bit j = bits[:, j]."""
    weights = 1 << torch.arange(8, dtype=torch.int32, device=bits.device)
    return (bits.reshape(-1, 4, 8) * weights).sum(-1).to(torch.uint8)


def _quant_q4_0(xb: Tensor) -> Tensor:
    d = _signed_absmax(xb) / -8
    q = torch.trunc(xb * _safe_inverse(d) + 8.5).clamp(0, 15).int()
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=-1)


def _quant_q4_1(xb: Tensor) -> Tensor:
    lo, hi = xb.amin(dim=-1, keepdim=True), xb.amax(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((xb - lo) * _safe_inverse(d) + 0.5).clamp(0, 15).int()
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], dim=-1)


def _quant_q5_0(xb: Tensor) -> Tensor:
    d = _signed_absmax(xb) / -16
    q = torch.trunc(xb * _safe_inverse(d) + 16.5).clamp(0, 31).int()
    return torch.cat([_f16_bytes(d), _pack_bits32(q >> 4), _pack_nibbles(q & 0xF)], dim=-1)


def _quant_q5_1(xb: Tensor) -> Tensor:
    lo, hi = xb.amin(dim=-1, keepdim=True), xb.amax(dim=-1, keepdim=True)
    d = (hi - lo) / 31
    q = torch.trunc((xb - lo) * _safe_inverse(d) + 0.5).clamp(0, 31).int()
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_bits32(q >> 4), _pack_nibbles(q & 0xF)], dim=-1)


def _quant_q8_0(xb: Tensor) -> Tensor:
    d, q = _q8_0_scale_and_quants(xb)
    return torch.cat([_f16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=-1)


def _quant_f32(xb: Tensor) -> Tensor:
    return xb.contiguous().view(torch.uint8)


def _quant_f16(xb: Tensor) -> Tensor:
    return _f16_bytes(xb)


def _quant_bf16(xb: Tensor) -> Tensor:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaNs are kept (made quiet), not rounded."""
    u = xb.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    h = torch.where(is_nan, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return torch.stack([h & 0xFF, (h >> 8) & 0xFF], dim=-1).reshape(xb.shape[0], -1).to(torch.uint8)


_QUANTIZERS: dict[GGMLType, Callable[[Tensor], Tensor]] = {
    GGMLType.F32: _quant_f32,
    GGMLType.F16: _quant_f16,
    GGMLType.BF16: _quant_bf16,
    GGMLType.Q4_0: _quant_q4_0,
    GGMLType.Q4_1: _quant_q4_1,
    GGMLType.Q5_0: _quant_q5_0,
    GGMLType.Q5_1: _quant_q5_1,
    GGMLType.Q8_0: _quant_q8_0,
}


def quantize_reference(x: Tensor, ggml_type) -> Tensor:
    """x (rows, cols) -> packed uint8 (rows, row_bytes), bit for bit as ggml's
    quantize_row_*_ref, for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0."""
    info = type_info(ggml_type)
    if info.type not in _QUANTIZERS:
        names = ", ".join(t.name for t in _QUANTIZERS)
        raise ValueError(f"quantize_reference supports {names}; not {info.name}")
    _check_matrix(x, "x")
    rows, cols = x.shape
    rb = row_bytes(info.type, cols)
    xb = x.float().reshape(-1, info.block_size)
    return _QUANTIZERS[info.type](xb).reshape(rows, rb)

"""GGUF / ggml tensor types: ids, names, block geometry, and the activation type each one's dot
product uses on ggml's CPU backend. Numbers are the pinned ggml's (see upstream.toml)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


@dataclass(frozen=True)
class TypeInfo:
    type: GGMLType
    block_size: int  # values per block
    type_size: int  # bytes per block
    vec_dot_type: GGMLType  # what ggml-cpu quantizes activations to for this type's dot product
    storage: bool = True  # False for activation-only formats (Q8_1, Q8_K)

    @property
    def name(self) -> str:
        return self.type.name


T = GGMLType
_Q80, _Q81, _Q8K = T.Q8_0, T.Q8_1, T.Q8_K
TYPE_INFO: dict[GGMLType, TypeInfo] = {
    i.type: i
    for i in [
        TypeInfo(T.F32, 1, 4, T.F32),
        TypeInfo(T.F16, 1, 2, T.F16),
        TypeInfo(T.BF16, 1, 2, T.BF16),
        TypeInfo(T.Q4_0, 32, 18, _Q80),
        TypeInfo(T.Q4_1, 32, 20, _Q81),
        TypeInfo(T.Q5_0, 32, 22, _Q80),
        TypeInfo(T.Q5_1, 32, 24, _Q81),
        TypeInfo(T.Q8_0, 32, 34, _Q80),
        TypeInfo(T.Q8_1, 32, 36, _Q81, storage=False),
        TypeInfo(T.Q2_K, 256, 84, _Q8K),
        TypeInfo(T.Q3_K, 256, 110, _Q8K),
        TypeInfo(T.Q4_K, 256, 144, _Q8K),
        TypeInfo(T.Q5_K, 256, 176, _Q8K),
        TypeInfo(T.Q6_K, 256, 210, _Q8K),
        TypeInfo(T.Q8_K, 256, 292, _Q8K, storage=False),
        TypeInfo(T.IQ2_XXS, 256, 66, _Q8K),
        TypeInfo(T.IQ2_XS, 256, 74, _Q8K),
        TypeInfo(T.IQ3_XXS, 256, 98, _Q8K),
        TypeInfo(T.IQ1_S, 256, 50, _Q8K),
        TypeInfo(T.IQ4_NL, 32, 18, _Q80),
        TypeInfo(T.IQ3_S, 256, 110, _Q8K),
        TypeInfo(T.IQ2_S, 256, 82, _Q8K),
        TypeInfo(T.IQ4_XS, 256, 136, _Q8K),
        TypeInfo(T.IQ1_M, 256, 56, _Q8K),
        TypeInfo(T.TQ1_0, 256, 54, _Q8K),
        TypeInfo(T.TQ2_0, 256, 66, _Q8K),
        TypeInfo(T.MXFP4, 32, 17, _Q80),
        TypeInfo(T.NVFP4, 64, 36, _Q80),
        TypeInfo(T.Q1_0, 128, 18, _Q80),
        TypeInfo(T.Q2_0, 64, 18, _Q80),
    ]
}

# Storage types: what a GGUF tensor can be stored as and every op here accepts.
STORAGE_TYPES: frozenset[int] = frozenset(int(t) for t, i in TYPE_INFO.items() if i.storage)
# Types whose quantization needs an importance matrix (ggml refuses to quantize them without one).
IMATRIX_TYPES: frozenset[int] = frozenset({int(T.IQ2_XXS), int(T.IQ2_XS), int(T.IQ1_S)})


# Added to a type id for a weight held in ggml-cpu's repacked layout (see `repack`).
REPACKED = 1024


def repacked_type(t: int | str | GGMLType) -> int:
    """The type id of a `t` weight in the repacked layout (what `repack` returns is passed with it)."""
    return type_id(t) + REPACKED


def type_id(t: int | str | GGMLType) -> int:
    """A ggml type id from an id, a GGMLType or a name such as "Q4_K" (case-insensitive)."""
    if isinstance(t, str):
        try:
            return int(GGMLType[t.upper()])
        except KeyError:
            raise ValueError(f"unknown ggml type name {t!r}; known: {[x.name for x in GGMLType]}") from None
    if isinstance(t, bool) or not isinstance(t, int):
        raise TypeError(f"ggml_type must be an int id or a type name, got {type(t).__name__}")
    return int(t)


def type_name(t: int | str | GGMLType) -> str:
    tid = type_id(t)
    try:
        return GGMLType(tid).name
    except ValueError:
        raise ValueError(f"unknown ggml type id {tid}") from None


def type_info(t: int | str | GGMLType) -> TypeInfo:
    tid = type_id(t)
    try:
        return TYPE_INFO[GGMLType(tid)]
    except ValueError:
        raise ValueError(f"unknown ggml type id {tid}") from None


def row_bytes(ggml_type: int | str | GGMLType, cols: int) -> int:
    """Bytes of one packed row of `cols` values (cols must be a multiple of the block size)."""
    info = type_info(ggml_type)
    if cols <= 0 or cols % info.block_size:
        raise ValueError(f"cols={cols} is not a positive multiple of the {info.name} block size {info.block_size}")
    return cols // info.block_size * info.type_size

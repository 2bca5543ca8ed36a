"""The shape and dtype rules of every op, for the fake (meta) implementations: what the CPU kernel
refuses from shapes and dtypes alone, a traced call (torch.compile, the meta device) refuses too,
with the kernel's exception type and words. Rules that need the data (indices in range, finite
values, the IQ quantizers' magnitude limits) stay in the kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._ggml_runtime import check_dim, check_dtype, check_size, dtype_name
from .types import REPACKED, STORAGE_TYPES, TYPE_INFO, GGMLType, TypeInfo

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_INDEX = (torch.int32, torch.int64)


def _id_ranges(ids) -> str:
    """0-3, 6-8, 29, 30: runs of three or more ids as a range, the others one by one."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r)) for r in runs)


def storage_type(type_id: int) -> TypeInfo:
    if type_id not in STORAGE_TYPES:
        raise ValueError(f"unknown or unsupported ggml type id {type_id} (GGUF storage types are "
                         f"{_id_ranges(STORAGE_TYPES)})")
    return TYPE_INFO[GGMLType(type_id)]


def stored(type_id: int) -> tuple[TypeInfo, bool]:
    """A type id of the product / dequantize / get_rows ops: its type, and whether it names the repacked
    layout (id + REPACKED). Whether this CPU has that layout only the kernel can tell."""
    repacked = REPACKED <= type_id < 2 * REPACKED
    return storage_type(type_id - REPACKED if repacked else type_id), repacked


def repacked_rows(blocks: torch.Tensor, info: TypeInfo, repacked: bool, name: str) -> None:
    rows = blocks.shape[-2]
    if repacked and rows % REPACK_ROWS:
        raise ValueError(f"{name} is a repacked {info.name} weight of {rows} rows; repacked weights hold a "
                         f"multiple of {REPACK_ROWS}")


REPACK_ROWS = 8


def out_dtype(dtype: torch.dtype) -> None:
    if dtype not in _FLOAT:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype_name(dtype)}")


def row_bytes(info: TypeInfo, cols: int) -> int:
    """Bytes of a packed row of `cols` values (the kernel's packed_row_bytes)."""
    if cols <= 0:
        raise ValueError(f"cols must be positive, got {cols}")
    if cols % info.block_size:
        raise ValueError(f"cols={cols} is not a multiple of the {info.name} block size {info.block_size}")
    if cols // info.block_size > (2**63 - 1) // info.type_size:
        raise ValueError(f"cols={cols} is too large: {info.name} rows of that many values take more than "
                         "2^63 - 1 bytes")
    return cols // info.block_size * info.type_size


def packed_cols(blocks: torch.Tensor, info: TypeInfo, name: str) -> int:
    """Values per packed row of a product's weight, from the row's byte size (the kernel's cols_of)."""
    rb = blocks.shape[-1]
    if rb <= 0 or rb % info.type_size:
        raise ValueError(f"{name} rows of {rb} bytes are not a whole number of {info.name} blocks "
                         f"({info.type_size} bytes each)")
    k = rb // info.type_size * info.block_size
    if k > 2**31 - 1:
        raise ValueError(f"{name} rows hold {k} values; ggml's dot products take at most 2^31 - 1")
    return k


def packed(blocks: torch.Tensor, info: TypeInfo, cols: int, name: str) -> None:
    """uint8, last dim the packed row of `cols` values, contiguous (the kernel's check_packed)."""
    check_dtype(blocks, (torch.uint8,), name)
    rb = row_bytes(info, cols)
    if blocks.shape[-1] != rb:
        raise ValueError(f"{name} has {blocks.shape[-1]} bytes per row but {info.name} rows of {cols} "
                         f"values take {rb} bytes")
    if not blocks.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); got strides {list(blocks.stride())}")


def packed_weight(blocks: torch.Tensor, info: TypeInfo, dim: int, name: str) -> int:
    """A packed weight (N, row_bytes) or experts (E, N, row_bytes); returns K, its values per row."""
    check_dtype(blocks, (torch.uint8,), name)
    check_dim(blocks, dim, name)
    k = packed_cols(blocks, info, name)
    packed(blocks, info, k, name)
    return k


def activations(x: torch.Tensor, k: int, info: TypeInfo, blocks: torch.Tensor, *, tokens_only: bool = False) -> None:
    """x (..., K), or (T, K) when tokens_only (mul_mat_id)."""
    check_dtype(x, _FLOAT, "x")
    if tokens_only:
        check_dim(x, 2, "x")
    elif x.dim() < 1:
        raise ValueError("x must be (..., K) with at least one dim, got a 0-D tensor")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features (shape {list(x.shape)}) but the {info.name} weight rows "
                         f"hold {k} values ({blocks.shape[-1]} bytes)")


def product(blocks: torch.Tensor, type_id: int, out_features: int, x: torch.Tensor, name: str = "blocks") -> None:
    """One packed weight of mul_mat / mul_mat_vec / mul_mat_group times x (..., K)."""
    info, repacked = stored(type_id)
    k = packed_weight(blocks, info, 2, name)
    if blocks.shape[0] != out_features:
        raise ValueError(f"out_features={out_features} but {name} has {blocks.shape[0]} rows")
    activations(x, k, info, blocks)
    repacked_rows(blocks, info, repacked, name)


def group(blocks: Sequence[torch.Tensor], x: torch.Tensor, type_ids: Sequence[int], out_features: Sequence[int]) -> None:
    n = len(blocks)
    if n == 0:
        raise ValueError("mul_mat_group needs at least one weight")
    if len(type_ids) != n or len(out_features) != n:
        raise ValueError(f"mul_mat_group got {n} weights, {len(type_ids)} ggml types and {len(out_features)} "
                         "out_features: one each")
    for i, (b, t, nf) in enumerate(zip(blocks, type_ids, out_features, strict=True)):
        product(b, t, nf, x, f"blocks[{i}]")


def experts(blocks: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, type_id: int, out_features: int) -> None:
    """mul_mat_id: experts (E, N, row_bytes), x (T, K), ids (T, n_ids)."""
    info, repacked = stored(type_id)
    if repacked:
        raise ValueError(f"mul_mat_id takes expert weights in the plain GGUF layout, not repacked ones (type id "
                         f"{type_id})")
    k = packed_weight(blocks, info, 3, "blocks")
    if blocks.shape[1] != out_features:
        raise ValueError(f"out_features={out_features} but each expert in blocks has {blocks.shape[1]} rows")
    activations(x, k, info, blocks, tokens_only=True)
    check_dtype(ids, _INDEX, "ids")
    check_dim(ids, 2, "ids")
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids has {ids.shape[0]} rows but x has {x.shape[0]} tokens")


def dequantize(blocks: torch.Tensor, type_id: int, rows: int, cols: int, dtype: torch.dtype) -> None:
    info, repacked = stored(type_id)
    out_dtype(dtype)
    check_dtype(blocks, (torch.uint8,), "blocks")
    check_dim(blocks, 2, "blocks")
    if blocks.shape[0] != rows:
        raise ValueError(f"rows={rows} but blocks has {blocks.shape[0]} rows")
    packed(blocks, info, cols, "blocks")
    repacked_rows(blocks, info, repacked, "blocks")


def get_rows(blocks: torch.Tensor, indices: torch.Tensor, type_id: int, cols: int, dtype: torch.dtype) -> None:
    info, repacked = stored(type_id)
    out_dtype(dtype)
    check_dtype(blocks, (torch.uint8,), "blocks")
    check_dim(blocks, 2, "blocks")
    packed(blocks, info, cols, "blocks")
    check_dtype(indices, _INDEX, "indices")
    check_dim(indices, 1, "indices")
    repacked_rows(blocks, info, repacked, "blocks")


def repack(blocks: torch.Tensor, type_id: int) -> None:
    """repack: a plain packed weight (N, row_bytes), N a multiple of REPACK_ROWS."""
    info = storage_type(type_id)
    packed_weight(blocks, info, 2, "blocks")
    if blocks.shape[0] % REPACK_ROWS:
        raise ValueError(f"repacking takes rows in groups of {REPACK_ROWS}; blocks has {blocks.shape[0]}")


def unrepack(blocks: torch.Tensor, type_id: int) -> None:
    """unrepack: a repacked weight (N, row_bytes) of the plain type `type_id`."""
    info = storage_type(type_id)
    packed_weight(blocks, info, 2, "blocks")
    repacked_rows(blocks, info, True, "blocks")


def quantize(x: torch.Tensor, type_id: int, imatrix: torch.Tensor | None, needs_imatrix: bool) -> None:
    """x (rows, cols) float; imatrix float32 (cols,), required when needs_imatrix."""
    info = storage_type(type_id)
    check_size(x, "x")
    check_dtype(x, _FLOAT, "x")
    check_dim(x, 2, "x")
    cols = x.shape[1]
    row_bytes(info, cols)
    if imatrix is not None:
        check_dtype(imatrix, (torch.float32,), "imatrix")
        if imatrix.dim() != 1 or imatrix.shape[0] != cols:
            raise ValueError(f"imatrix must be 1-D with {cols} values (one importance per column), got shape "
                             f"{list(imatrix.shape)}")
    elif needs_imatrix:
        raise ValueError(f"{info.name} quantization needs an importance matrix: pass imatrix (float32, one "
                         "value per column; torch.ones(cols) weighs all columns equally)")

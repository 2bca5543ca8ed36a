"""Compute on packed GGUF tensors with ggml's own kernels.

A packed weight is a GGUF tensor as stored: uint8, one row per output feature,
`row_bytes(ggml_type, cols)` bytes per row. Every op accepts the type as an id, a `GGMLType` or a
name ("Q4_K"). Matrix products return float32 whatever the activation dtype, as llama.cpp does.
"""

from __future__ import annotations

import torch

from . import _checks, cpu, dense_prefill, huge_pages, layers, reference
from ._ggml_runtime import BACKEND, EMULATED_METAL, check_size, info, same_device
from ._ops import add_op_namespace_prefix, ops
from .types import (
    IMATRIX_TYPES,
    REPACKED,
    STORAGE_TYPES,
    TYPE_INFO,
    GGMLType,
    TypeInfo,
    repacked_type,
    row_bytes,
    type_id,
    type_info,
    type_name,
)

__all__ = [
    "GEMV_TYPES",
    "GGMLType",
    "IMATRIX_TYPES",
    "MAX_GEMV_ROWS",
    "QUANTIZE_TYPES",
    "REPACKED",
    "STORAGE_TYPES",
    "TYPE_INFO",
    "TypeInfo",
    "cpu",
    "dense_prefill",
    "dequantize",
    "faster_repacked_types",
    "get_rows",
    "huge_pages",
    "info",
    "layers",
    "mul_mat",
    "mul_mat_group",
    "mul_mat_id",
    "mul_mat_vec",
    "quantize",
    "reference",
    "repack",
    "repacked_type",
    "repacked_types",
    "row_bytes",
    "type_id",
    "type_info",
    "type_name",
    "unrepack",
]

if BACKEND in EMULATED_METAL:  # the emulated-Metal builds (never on the Hub) alone have them
    from ._metal_emu import metal_dispatches, reset_metal_dispatches

    __all__ += ["metal_dispatches", "reset_metal_dispatches"]


# Every storage type has a ggml-cpu dot product in the pinned ggml, so every one stays packed.
GEMV_TYPES: frozenset[int] = STORAGE_TYPES
# transformers calls mul_mat_vec for at most this many rows (it keeps its own copy of the number).
MAX_GEMV_ROWS = 8
# ggml can quantize to every storage type (IMATRIX_TYPES need an importance matrix).
QUANTIZE_TYPES: frozenset[int] = STORAGE_TYPES



def _flatten(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return x
    check_size(x, "x")  # before a reshape that may copy
    return x.reshape(-1, x.shape[-1])


def mul_mat_vec(blocks: torch.Tensor, x: torch.Tensor, ggml_type, out_features: int) -> torch.Tensor:
    """`x @ W.T` for a packed weight W `(out_features, row_bytes)` and x `(..., K)` float32/bf16/f16;
    returns `(..., out_features)` float32. Made for at most MAX_GEMV_ROWS rows (decode), correct for any."""
    return ops.mul_mat_vec.default(blocks, x, type_id(ggml_type), int(out_features))


def mul_mat(blocks: torch.Tensor, x: torch.Tensor, ggml_type, out_features: int, *, exact: bool = False) -> torch.Tensor:
    """`x @ W.T` on the packed weight for any number of rows (prefill), without a dense copy of W.
    x `(..., K)` -> `(..., out_features)` float32.

    On the CPU build with CPU tensors, a block-32 weight (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, repacked or
    not) times at least `dense_prefill.MIN_ROWS[type]` rows (32 to 128 by type) on a CPU with native
    bfloat16 dot products (AVX512-BF16 / AMX), and on a CPU with AMX also a Q4_K / Q5_K / Q6_K weight
    times `dense_prefill.AMX_MIN_ROWS[type]` rows (192 / 192 / 256), takes the dense path: ggml dequantizes the weight a
    chunk at a time and torch multiplies in bfloat16 with float32 accumulation, several times faster
    there. Its result is within bfloat16 rounding of the float32 product of the dequantized weight
    (each of x, W and the output rounded once: |error| <= ~3 * 2^-9 * (|x| @ |W|.T) per entry), and
    not bit-independent of the row count (torch's GEMM may pick another kernel for other rows).
    Everything else, and every call with `exact=True`, runs ggml's own mul_mat: activations rounded
    to 8 bits per block as llama.cpp does, each row computed alone, bit for bit llama.cpp's ggml.
    The Metal builds always run ggml's kernels. See `dense_prefill` for the thresholds' measurements."""
    t = type_id(ggml_type)
    if not exact and dense_prefill.applies(blocks, x, t):
        return dense_prefill.matmul(blocks, x, t, int(out_features))
    return ops.mul_mat.default(blocks, x, t, int(out_features))


def mul_mat_group(
    blocks: list[torch.Tensor], x: torch.Tensor, ggml_types, out_features, *, exact: bool = False
) -> list[torch.Tensor]:
    """`[mul_mat(W, x, ...) for W in blocks]` for several packed weights that read the same activations
    (a layer's q/k/v or gate/up projections); weights may differ in type and rows, not in columns. x
    `(..., K)` -> one `(..., out_features[i])` float32 tensor per weight, each equal to `mul_mat(W_i,
    x, ggml_types[i], out_features[i], exact=exact)`: the weights `mul_mat` would take its dense path
    for (`dense_prefill`) take it, the others run ggml's kernels together. For up to 128 activation
    rows (a decode step, a prompt) those are quantized once per dot-product type and all their rows
    split over the threads together, in one call instead of one per weight."""
    types = [type_id(t) for t in ggml_types]
    outs = [int(n) for n in out_features]
    dense = (set() if exact or not dense_prefill.may_apply(x)
             else {i for i, t in enumerate(types) if dense_prefill.applies(blocks[i], x, t)})
    if not dense:
        return ops.mul_mat_group.default(list(blocks), x, types, outs)
    rest = [i for i in range(len(types)) if i not in dense]
    result = {i: dense_prefill.matmul(blocks[i], x, types[i], outs[i]) for i in dense}
    if rest:
        grouped = ops.mul_mat_group.default([blocks[i] for i in rest], x, [types[i] for i in rest],
                                            [outs[i] for i in rest])
        result.update(zip(rest, grouped, strict=True))
    return [result[i] for i in range(len(types))]


def mul_mat_id(blocks: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, ggml_type, out_features: int) -> torch.Tensor:
    """Mixture-of-experts product: blocks `(E, N, row_bytes)`, x `(T, K)`, ids `(T, n_ids)` int32/int64
    -> `(T, n_ids, N)` float32 with `out[t, j] = W[ids[t, j]] @ x[t]`."""
    return ops.mul_mat_id.default(blocks, x, ids, type_id(ggml_type), int(out_features))


def dequantize(blocks: torch.Tensor, ggml_type, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed `(rows, row_bytes)` -> `(rows, cols)` in dtype (float32, float16 or bfloat16)."""
    return ops.dequantize.default(blocks, type_id(ggml_type), int(rows), int(cols), dtype)


def get_rows(blocks: torch.Tensor, indices: torch.Tensor, ggml_type, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `indices` (1-D int32/int64) of a packed matrix, dequantized: `(n, cols)` in dtype."""
    return ops.get_rows.default(blocks, indices, type_id(ggml_type), int(cols), dtype)


def quantize(x: torch.Tensor, ggml_type, imatrix: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize float rows `(..., cols)` to packed uint8 `(..., row_bytes)` with ggml's quantizers.
    `imatrix` (float32, one importance per column) weighs the rounding error; IMATRIX_TYPES need it."""
    out = ops.quantize.default(_flatten(x), type_id(ggml_type), imatrix)
    return out.view(*x.shape[:-1], out.shape[-1]) if x.dim() != 2 else out


def repacked_types() -> frozenset[int]:
    """GGUF type ids this CPU's ggml holds in a repacked layout (x86 with AVX2: Q4_0, Q4_K, IQ4_NL,
    MXFP4; with AVX-512 also Q2_K; none on older CPUs)."""
    return frozenset(ops.repacked_types.default())


def faster_repacked_types() -> frozenset[int]:
    """Of `repacked_types()`, those whose weights are measured faster repacked on this CPU (a decode
    step's products and short prompts; see `cpu`): what an integration repacks by default. Empty on
    the Metal builds and on CPUs where the plain layout is as fast or not measured."""
    if BACKEND != "cpu":
        return frozenset()
    return cpu.faster_repacked_types() & repacked_types()


def repack(blocks: torch.Tensor, ggml_type) -> torch.Tensor:
    """A packed weight `(N, row_bytes)` (N a multiple of 8) in ggml-cpu's repacked layout: 8 rows
    interleaved block by block, as llama.cpp's CPU backend holds these types. Pass the result with
    `repacked_type(ggml_type)` to mul_mat / mul_mat_vec / mul_mat_group (2-47 activation rows run
    ggml's tiled gemm: 1.2-1.6x the plain kernels on Q4_K), dequantize and get_rows (exact, through
    the inverse of ggml's repack). The bytes suit this CPU's ggml only; `repacked_types()` says which
    types it repacks (ValueError for the others)."""
    return ops.repack.default(blocks, type_id(ggml_type))


def unrepack(blocks: torch.Tensor, ggml_type) -> torch.Tensor:
    """The inverse of `repack`: a repacked `ggml_type` weight back in the plain GGUF layout (exact)."""
    return ops.unrepack.default(blocks, type_id(ggml_type))


# ---- fake (meta) implementations: shapes only, so torch.compile traces without graph breaks ----
# Mixed devices dispatch here too (the meta key outranks the others), so they are refused here; every
# shape and dtype rule of the kernel is checked here too (_checks), so a traced call fails as an eager one.


@torch.library.register_fake(add_op_namespace_prefix("mul_mat"))
def _mul_mat_fake(blocks, x, ggml_type, out_features):
    same_device("mul_mat", blocks=blocks, x=x)
    _checks.product(blocks, ggml_type, out_features, x)
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


@torch.library.register_fake(add_op_namespace_prefix("mul_mat_vec"))
def _mul_mat_vec_fake(blocks, x, ggml_type, out_features):
    same_device("mul_mat_vec", blocks=blocks, x=x)
    _checks.product(blocks, ggml_type, out_features, x)
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


@torch.library.register_fake(add_op_namespace_prefix("mul_mat_group"))
def _mul_mat_group_fake(blocks, x, ggml_types, out_features):
    same_device("mul_mat_group", x=x, **{f"blocks[{i}]": b for i, b in enumerate(blocks)})
    _checks.group(blocks, x, ggml_types, out_features)
    return [x.new_empty((*x.shape[:-1], n), dtype=torch.float32) for n in out_features]


@torch.library.register_fake(add_op_namespace_prefix("mul_mat_id"))
def _mul_mat_id_fake(blocks, x, ids, ggml_type, out_features):
    same_device("mul_mat_id", blocks=blocks, x=x, ids=ids)
    _checks.experts(blocks, x, ids, ggml_type, out_features)
    return x.new_empty((x.shape[0], ids.shape[1], out_features), dtype=torch.float32)


@torch.library.register_fake(add_op_namespace_prefix("dequantize"))
def _dequantize_fake(blocks, ggml_type, rows, cols, dtype):
    _checks.dequantize(blocks, ggml_type, rows, cols, dtype)
    return blocks.new_empty((rows, cols), dtype=dtype)


@torch.library.register_fake(add_op_namespace_prefix("get_rows"))
def _get_rows_fake(blocks, indices, ggml_type, cols, dtype):
    same_device("get_rows", blocks=blocks, indices=indices)
    _checks.get_rows(blocks, indices, ggml_type, cols, dtype)
    return blocks.new_empty((indices.shape[0], cols), dtype=dtype)


@torch.library.register_fake(add_op_namespace_prefix("repack"))
def _repack_fake(blocks, ggml_type):
    _checks.repack(blocks, ggml_type)
    return torch.empty_like(blocks, memory_format=torch.contiguous_format)


@torch.library.register_fake(add_op_namespace_prefix("unrepack"))
def _unrepack_fake(blocks, ggml_type):
    _checks.unrepack(blocks, ggml_type)
    return torch.empty_like(blocks, memory_format=torch.contiguous_format)


@torch.library.register_fake(add_op_namespace_prefix("quantize"))
def _quantize_fake(x, ggml_type, imatrix=None):
    same_device("quantize", x=x, imatrix=imatrix)
    _checks.quantize(x, ggml_type, imatrix, ggml_type in IMATRIX_TYPES)
    return x.new_empty((x.shape[0], row_bytes(ggml_type, x.shape[1])), dtype=torch.uint8)

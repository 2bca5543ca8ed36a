"""The shape and dtype rules of the ops, as the kernels (attn_inputs.cpp, and attn_metal.cpp for
the Metal head dims) enforce them, for the fake (meta) implementations: what a kernel refuses from
shapes and dtypes alone, a traced call (torch.compile, the meta device) refuses too, with the
kernel's exception type and words. Rules that need the data (overlapping memory) stay in the kernel."""

from __future__ import annotations

import torch

from ._ggml_runtime import FLOAT32_RANGE, METAL, check_dim, check_dtype, dtype_name, fits_float32

MAX_HEAD_DIM = 1024
# ggml-metal's flash-attention kernels: the (key, value) head dim pairs upstream instantiates them
# for, vec and tiled alike (its supports_op lets any value head dim up to the key's through, and the
# pipeline of a pair without a kernel then fails to build); kMetalHeadDims in attn_metal.cpp.
METAL_HEAD_DIM_PAIRS = (
    (32, 32), (40, 40), (48, 48), (64, 64), (72, 72), (80, 80), (96, 64), (96, 96), (112, 112), (128, 128),
    (192, 128), (192, 192), (256, 256), (320, 256), (512, 512), (576, 512),
)
METAL_HEAD_DIMS = tuple(sorted({key for key, _ in METAL_HEAD_DIM_PAIRS}))  # the key head dims among them
_METAL = METAL
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.float32, torch.float16, torch.bfloat16)


def flash_attn(q, k, v, mask, scale: float, softcap: float, sinks) -> None:
    for t, name in ((q, "query"), (k, "key"), (v, "value")):
        check_dtype(t, SUPPORTED_DTYPES, name)
        check_dim(t, 4, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {dtype_name(q.dtype)}, "
                        f"{dtype_name(k.dtype)}, {dtype_name(v.dtype)}")
    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: query {b}, key {k.shape[0]}, value {v.shape[0]}")
    if v.shape[1] != hkv or v.shape[2] != skv:
        raise ValueError(f"key {list(k.shape)} and value {list(v.shape)} must have the same heads and length")
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if k.shape[3] != d:
        raise ValueError(f"query head dim {d} != key head dim {k.shape[3]}")
    if not (1 <= d <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM):
        raise ValueError(f"head dim {d}/{dv} is not supported (1..{MAX_HEAD_DIM})")
    if _METAL and (d, dv) not in METAL_HEAD_DIM_PAIRS:
        raise NotImplementedError(metal_head_dims_message(d, dv))
    if not (fits_float32(scale) and fits_float32(softcap) and softcap >= 0):
        raise ValueError(f"scale must be finite and softcap finite and >= 0{FLOAT32_RANGE}, got scale {scale:g}, "
                         f"softcap {softcap:g}")
    if sinks is not None:
        check_dtype(sinks, SUPPORTED_DTYPES, "sinks")
        if sinks.dim() != 1 or sinks.shape[0] != hq:
            raise ValueError(f"sinks must hold one value per query head ({hq}), got shape {list(sinks.shape)}")
    if mask is not None:
        _mask(mask, b, hq, sq, skv)


def metal_head_dims_message(d: int, dv: int) -> str:
    """The Metal build's words for head dims it has no kernel for (attn_metal.cpp says the same)."""
    pairs = ", ".join(f"{key}/{value}" for key, value in METAL_HEAD_DIM_PAIRS)
    return (f"ggml-metal has no kernel for FLASH_ATTN_EXT with key head dim {d} and value head dim {dv}; its "
            f"kernels take the key/value head dims {pairs} (supports_flash_attn says which), the CPU build any "
            f"up to {MAX_HEAD_DIM}")


def _mask(mask, b, hq, sq, skv) -> None:
    check_dtype(mask, MASK_DTYPES, "mask")
    if not 2 <= mask.dim() <= 4:
        raise ValueError(f"mask must be (Sq, Skv), (B, Sq, Skv) or (B, 1 or Hq, Sq, Skv), got shape {list(mask.shape)}")
    m = mask.shape
    mb, mh = (1, 1) if mask.dim() == 2 else (m[0], 1) if mask.dim() == 3 else (m[0], m[1])
    if m[-1] != skv or m[-2] != sq or mh not in (1, hq) or mb not in (1, b):
        raise ValueError(f"mask of shape {list(m)} does not broadcast to (B, Hq, Sq, Skv) = ({b}, {hq}, {sq}, {skv})")


def rotary_half(q, k, cos, sin) -> None:
    for t, name in ((cos, "cos"), (sin, "sin")):
        check_dtype(t, (torch.float32,), name)
        check_dim(t, 3, name)
    if cos.shape != sin.shape:
        raise ValueError(f"cos {list(cos.shape)} and sin {list(sin.shape)} must have one shape")
    if cos.shape[2] % 2:
        raise ValueError(f"the rotated head dim must be even, got {cos.shape[2]}")
    for x, name in ((q, "q"), (k, "k")):
        _rotary_input(x, name, cos)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k has {k.shape[0]}")


def _rotary_input(x, name, table) -> None:
    check_dtype(x, (torch.float32,), name)
    check_dim(x, 4, name)
    if x.shape[2] != table.shape[1] or x.shape[3] != table.shape[2] or table.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"{name} (batch, heads, tokens, head dim) {list(x.shape)} does not match cos / sin "
                         f"(batch or 1, tokens, head dim) {list(table.shape)}")
    if x.stride(3) != 1 and x.shape[3] != 1:
        raise ValueError(f"{name}'s last dim must be dense, got strides {list(x.stride())}")


def kv_write(keys, values, k, v, position: int) -> None:
    _cache_rows(keys, k, position, "keys", "k")
    _cache_rows(values, v, position, "values", "v")


def _cache_rows(buf, x, position, buf_name, x_name) -> None:
    check_dtype(buf, SUPPORTED_DTYPES, buf_name)
    if buf.dtype != x.dtype:
        raise TypeError(f"{x_name} has dtype {dtype_name(x.dtype)} but {buf_name} holds {dtype_name(buf.dtype)}")
    if buf.dim() < 2 or x.dim() != buf.dim():
        raise ValueError(f"{x_name} {list(x.shape)} and {buf_name} {list(buf.shape)} must both be (..., rows, D) "
                         "with the same number of dims")
    if any(i != buf.dim() - 2 and buf.shape[i] != x.shape[i] for i in range(buf.dim())):
        raise ValueError(f"{x_name} {list(x.shape)} does not fit {buf_name} {list(buf.shape)}: all dims but the rows "
                         "must match")
    rows, capacity = x.shape[-2], buf.shape[-2]
    if not (position >= 0 and rows <= capacity and position <= capacity - rows):
        raise IndexError(f"position {position} + {rows} rows of {x_name} do not fit in the {capacity} rows of {buf_name}")
    if buf.stride(-1) != 1 and buf.shape[-1] > 1:
        raise ValueError(f"{buf_name}'s last dim must be dense, got strides {list(buf.stride())}")

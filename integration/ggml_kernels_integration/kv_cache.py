"""A key/value cache that grows in place on the CPU.

transformers' `DynamicLayer.update` appends each step's keys and values with `torch.cat`, so every
decode step copies the whole cache of every attention layer: O(n^2) bytes over a generation. On a
Qwen3.5-0.8B-shaped model (256-wide heads) that was ~0.6 ms of an ~18 ms token at 200 positions,
growing with the context; llama.cpp writes one row into a preallocated cache instead.

`install()` makes `DynamicLayer.update` (and the layers that inherit it, such as Qwen3.5's
`LinearAttentionAndFullAttentionLayer`) keep CPU keys and values in buffers with spare capacity and
return views of their first `seq_len` positions: an update copies only the new positions, and
reallocates (1.25x, at least 128 positions more) when a buffer is full. The spare capacity is memory
held: a float32 cache of SmolLM2-135M is 45 KiB a position, and after a 512-token prompt the
earlier 1.5x / 256 policy held 256 spare positions (11 MiB) where this one holds 128; the copies a
smaller step costs are one pass over the cache per reallocation, a few per thousand tokens. Everything else in
transformers keeps working on those views: `crop` narrows them (the next update writes over the
cropped positions), `reorder_cache` / `batch_select_indices` / `batch_repeat_interleave` replace them
with new tensors (the next update starts a new buffer), `reset` drops them. Values and shapes are
exactly what `torch.cat` returns; the views are not contiguous (their head stride spans the
capacity), which transformers' attention paths and ggml-attn accept. Other devices keep `torch.cat`.
"""

from __future__ import annotations

import torch

from . import compat

compat.needs(
    ("transformers.cache_utils", "DynamicLayer.update", ("self", "key_states", "value_states")),
    ("transformers.cache_utils", "DynamicLayer.lazy_initialization", ("self", "key_states", "value_states")),
)


MIN_SPARE_POSITIONS = 128
SPARE_FRACTION = 4  # spare positions: a quarter of those needed, at least MIN_SPARE_POSITIONS
_BUFFERS = "_ggml_kernels_kv_buffers"  # a layer's {"keys" | "values": _Buffer}

def _capacity(needed: int) -> int:
    return needed + max(MIN_SPARE_POSITIONS, needed // SPARE_FRACTION)


class _Buffer:
    """One key or value buffer of a layer: the tensor (..., capacity, D), how many positions hold
    data, and the view of them returned last, with the shape parts a decode step reuses."""

    __slots__ = ("tensor", "length", "view", "lead", "width", "stride", "capacity")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.length, self.view = tensor, 0, None
        self.lead, self.width, self.capacity = tuple(tensor.shape[:-2]), tensor.shape[-1], tensor.shape[-2]
        self.stride = tensor.stride()


def _append(layer, name: str, current: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`torch.cat([current, new], dim=-2)` as a view of the layer's buffer `name`."""
    buffers = layer.__dict__.get(_BUFFERS)
    if buffers is None:
        buffers = layer.__dict__[_BUFFERS] = {}
    buf = buffers.get(name)
    added = new.shape[-2]
    if buf is not None and current is buf.view:  # the view returned last (a decode step): in the buffer
        length = buf.length
    else:
        length = current.shape[-2] if current.dim() == new.dim() else 0
        in_buffer = (
            buf is not None
            and length > 0
            and current.data_ptr() == buf.tensor.data_ptr()
            and current.dtype == buf.tensor.dtype
            and tuple(current.shape[:-2]) == buf.lead
            and current.shape[-1] == buf.width
            and current.stride() == buf.stride
        )
        if not in_buffer:
            buf = None
    if buf is None or length + added > buf.capacity:
        grown = new.new_empty((*new.shape[:-2], _capacity(length + added), new.shape[-1]))
        if length:
            grown[..., :length, :].copy_(current)
        buf = buffers[name] = _Buffer(grown)
    # narrow / as_strided with the kept shape parts: one aten call each, where `buffer[..., a:b, :]`
    # costs several and re-reading shapes and strides costs more than the copy
    buf.tensor.narrow(-2, length, added).copy_(new)
    buf.length = length + added
    buf.view = buf.tensor.as_strided((*buf.lead, buf.length, buf.width), buf.stride)
    return buf.view


def install(patches, write=None) -> None:
    """Patch `DynamicLayer.update` for CPU tensors through `patches` (a `PatchSet`). `write` is
    ggml-attn's `kv_write` op: a decode step whose keys and values both fit their buffers appends
    both with one call (1.4 us instead of ~3.8 for a narrow and a copy_ each)."""
    from transformers.cache_utils import DynamicLayer

    original = DynamicLayer.update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not (key_states.is_cpu and value_states.is_cpu):
            return original(self, key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        buffers = self.__dict__.get(_BUFFERS)
        if buffers is not None and write is not None:
            kb, vb = buffers.get("keys"), buffers.get("values")
            if kb is not None and vb is not None and self.keys is kb.view and self.values is vb.view:
                n = key_states.shape[-2]
                length = kb.length
                if (
                    vb.length == length
                    and length + n <= kb.capacity
                    and length + n <= vb.capacity
                    and key_states.dtype == kb.tensor.dtype
                    and value_states.dtype == vb.tensor.dtype
                ):
                    write(kb.tensor, vb.tensor, key_states, value_states, length)
                    kb.length = vb.length = length + n
                    self.keys = kb.view = kb.tensor.as_strided((*kb.lead, length + n, kb.width), kb.stride)
                    self.values = vb.view = vb.tensor.as_strided((*vb.lead, length + n, vb.width), vb.stride)
                    return self.keys, self.values
        self.keys = _append(self, "keys", self.keys, key_states)
        self.values = _append(self, "values", self.values, value_states)
        return self.keys, self.values

    update.__doc__ = original.__doc__
    patches.set_attr(DynamicLayer, "update", update)

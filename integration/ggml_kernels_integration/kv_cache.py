"""A key/value cache that grows in place on the CPU.

transformers' `DynamicLayer.update` appends each step's keys and values with `torch.cat`, so every
decode step copies the whole cache of every attention layer: O(n^2) bytes over a generation. On a
Qwen3.5-0.8B-shaped model (256-wide heads) that was ~0.6 ms of an ~18 ms token at 200 positions,
growing with the context; llama.cpp writes one row into a preallocated cache instead.

`install()` makes `DynamicLayer.update` (and the layers that inherit it, such as Qwen3.5's
`LinearAttentionAndFullAttentionLayer`) keep CPU keys and values in buffers with spare capacity and
return views of their first `seq_len` positions: an update copies only the new positions, and
reallocates (1.5x, at least 256 positions more) when a buffer is full. Everything else in
transformers keeps working on those views: `crop` narrows them (the next update writes over the
cropped positions), `reorder_cache` / `batch_select_indices` / `batch_repeat_interleave` replace them
with new tensors (the next update starts a new buffer), `reset` drops them. Values and shapes are
exactly what `torch.cat` returns; the views are not contiguous (their head stride spans the
capacity), which transformers' attention paths and ggml-attn accept. Other devices keep `torch.cat`.
"""

from __future__ import annotations

import torch

MIN_SPARE_POSITIONS = 256
GROWTH = 1.5

_state: dict = {}


def _capacity(needed: int) -> int:
    return max(needed + MIN_SPARE_POSITIONS, int(needed * GROWTH))


def _append(layer, name: str, current: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`torch.cat([current, new], dim=-2)` as a view of the layer's buffer `name`."""
    buffers = layer.__dict__.setdefault("_ggml_kernels_kv_buffers", {})
    buffer, returned = buffers.get(name, (None, None))
    added = new.shape[-2]
    if current is returned:  # the view this function returned last (a decode step): in the buffer
        length = current.shape[-2]
    else:
        length = current.shape[-2] if current.dim() == new.dim() else 0
        in_buffer = (
            buffer is not None
            and length > 0
            and current.data_ptr() == buffer.data_ptr()
            and current.dtype == buffer.dtype
            and current.shape[:-2] == buffer.shape[:-2]
            and current.shape[-1] == buffer.shape[-1]
            and current.stride() == buffer.stride()
        )
        if not in_buffer:
            buffer = None
    if buffer is None or length + added > buffer.shape[-2]:
        grown = new.new_empty((*new.shape[:-2], _capacity(length + added), new.shape[-1]))
        if length:
            grown[..., :length, :].copy_(current)
        buffer = grown
    # narrow / as_strided: one aten call each, where `buffer[..., a:b, :]` costs several
    buffer.narrow(-2, length, added).copy_(new)
    view = buffer.as_strided((*buffer.shape[:-2], length + added, buffer.shape[-1]), buffer.stride())
    buffers[name] = (buffer, view)
    return view


def install() -> None:
    """Patch `DynamicLayer.update` for CPU tensors (idempotent)."""
    if _state.get("installed"):
        return
    from transformers.cache_utils import DynamicLayer

    original = DynamicLayer.update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.device.type != "cpu" or value_states.device.type != "cpu":
            return original(self, key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = _append(self, "keys", self.keys, key_states)
        self.values = _append(self, "values", self.values, value_states)
        return self.keys, self.values

    update.__doc__ = original.__doc__
    DynamicLayer.update = update
    _state.update(installed=True, original=original)

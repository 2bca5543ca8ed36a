"""GGUF configs read without a numpy object per vocabulary entry.

For architectures outside its newer GGUF reader (`llama`: SmolLM2, Llama, Mistral-style files)
transformers builds a model's config (and AutoTokenizer its config) with
`load_gguf_checkpoint(path, return_tensors=False)`, which opens the file with gguf-py's `GGUFReader`.
That reader makes a memory-mapped numpy view for every element of every metadata array: two per
token string and one per token score and type. For SmolLM2's 49,152-token vocabulary and 48,900
merges that is ~400,000 views, +166 MiB of peak memory and 2.4 s before a single weight is read:
more than the whole 92 MiB model, and the peak of our whole load.

`install()` makes that one call read the long arrays compactly: a string element becomes a `bytes`
object, the elements of a numeric array become views of one ordinary array, and the string length
parts (which transformers never reads) share one array. transformers parses the same values out of
them, so the config and tokenizer dictionaries are equal to those of the plain reader; the call
peaks at +30 MiB and takes 0.18 s on SmolLM2 (`python -m tools.bench.config_read_memory --gguf F`). Only calls with `return_tensors=False` read this way,
and only on the thread making the call: every other use of `GGUFReader` keeps gguf-py's own parts.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from . import compat

compat.needs(
    ("transformers.modeling_gguf_pytorch_utils", "load_gguf_checkpoint", ("gguf_checkpoint_path", "return_tensors")),
    ("gguf", "GGUFReader._get_field_parts", ("self", "orig_offs", "raw_type")),
    ("gguf", "GGUFReader._get", ("self", "offset", "dtype", "count")),
)


_local = threading.local()


def _compact_array_parts(original):
    """gguf-py's `GGUFReader._get_field_parts`, with arrays of strings or numbers made compact while
    a lean read is active on this thread (little-endian files; anything else as gguf-py reads it)."""
    from gguf import GGUFValueType

    read_length = struct.Struct("<Q").unpack_from

    def get_field_parts(self, orig_offs: int, raw_type: int):
        if not getattr(_local, "active", False) or raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return original(self, orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count = int(alen[0])
        itype = GGUFValueType(raw_itype[0])
        offs = orig_offs + 12
        if count == 0:
            return original(self, orig_offs, raw_type)
        if itype == GGUFValueType.STRING:
            buf = memoryview(self.data)
            length_part = np.zeros(1, dtype=np.uint64)  # never read by transformers
            parts = [raw_itype, alen]
            for _ in range(count):
                (n,) = read_length(buf, offs)
                parts += (length_part, bytes(buf[offs + 8 : offs + 8 + n]))
                offs += 8 + n
            data = list(range(3, 2 + 2 * count, 2))
            return offs - orig_offs, parts, data, [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # arrays of arrays
            return original(self, orig_offs, raw_type)
        values = np.array(self._get(offs, nptype, count))  # one ordinary array, not a memmap view
        parts = [raw_itype, alen, *(values[i : i + 1] for i in range(count))]
        return 12 + values.nbytes, parts, list(range(2, 2 + count)), [GGUFValueType.ARRAY, itype]

    return get_field_parts


def install(patches) -> None:
    """Make `load_gguf_checkpoint(..., return_tensors=False)` read metadata arrays compactly, through
    `patches` (a `PatchSet`)."""
    from gguf import GGUFReader
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    patches.wrap(GGUFReader, "_get_field_parts", _compact_array_parts)
    original_load = gguf_utils.load_gguf_checkpoint

    def load_gguf_checkpoint(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if return_tensors or getattr(_local, "active", False):
            return original_load(gguf_checkpoint_path, return_tensors, *args, **kwargs)
        _local.active = True
        try:
            return original_load(gguf_checkpoint_path, return_tensors, *args, **kwargs)
        finally:
            _local.active = False

    load_gguf_checkpoint.__doc__ = original_load.__doc__
    patches.set_attr(gguf_utils, "load_gguf_checkpoint", load_gguf_checkpoint)  # its callers import it when they call

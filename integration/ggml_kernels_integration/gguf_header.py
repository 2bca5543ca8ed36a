"""The bounds-checked reader of a GGUF file's header: metadata and tensor table, never the weights.

`read_header()` raises `GgufFileError` (a ValueError naming the file) for a file that is not GGUF,
of a version we do not read, or cut short (its header, or any tensor's data, ends past the end of
the file); a `general.alignment` that is not a power of two; metadata arrays nested more than
`MAX_ARRAY_DEPTH` deep; a metadata key listed twice; a tensor listed twice, of a dimension 0, of a
ggml type id that does not exist, whose rows do not fill whole blocks, whose data is not aligned or
overlaps another tensor's; a metadata key, string value (a vocabulary entry, say) or tensor name
that is not UTF-8 (GGUF's text encoding: transformers' config and tokenizer reads fail on anything
else, without naming the key). Every length is checked against what is left of the file before
anything of that length is read or allocated.

What a model needs from the header it read is `validate`'s business.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 16  # arrays of arrays: far below what would exhaust Python's stack in any reader
MAX_DIMENSIONS = 4  # ggml's GGML_MAX_DIMS

# metadata value type id -> struct format of a scalar (strings and arrays are handled apart)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# the tokenizer's long arrays (vocabulary, merges, scores) are skipped, not kept: only these are read
TOKENIZER_KEYS_KEPT = ("tokenizer.ggml.model", "tokenizer.ggml.pre")


class GgufFileError(ValueError):
    """The file cannot be loaded; the message says why, naming the file."""


class ArrayLength(int):
    """The length of a metadata array whose items were skipped rather than read (the vocabulary,
    the merges); `item_type` is the GGUF value type of its items."""

    item_type: int


def is_int(value) -> bool:
    return type(value) is int  # not a bool, nor the length of an array (`ArrayLength`)


@dataclass
class GgufSummary:
    path: Path
    version: int
    architecture: str
    metadata: dict = field(repr=False)
    tensors: dict[str, tuple[int, tuple[int, ...]]] = field(repr=False)  # name -> (ggml type id, shape)
    file_bytes: int = 0
    data_bytes: int = 0
    nested_arrays: tuple[str, ...] = ()  # metadata keys whose value is an array of arrays

    @property
    def type_names(self) -> dict[str, int]:
        """ggml type name -> number of tensors of that type."""
        from gguf import GGMLQuantizationType

        counts: dict[str, int] = {}
        for type_id, _ in self.tensors.values():
            name = GGMLQuantizationType(type_id).name
            counts[name] = counts.get(name, 0) + 1
        return counts

    def fail(self, problem: str):
        raise GgufFileError(f"{self.path}: {problem}")


class _Reader:
    """Bounds-checked little-endian reads from the header of an open file."""

    def __init__(self, f, path: Path, size: int):
        self.f, self.path, self.size = f, path, size
        self.nested: list[str] = []

    def fail(self, problem: str):
        raise GgufFileError(f"{self.path}: {problem}")

    def left(self) -> int:
        return self.size - self.f.tell()

    def take(self, n: int, what: str) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            self.overrun(what, f"{n} bytes")
        return data

    def overrun(self, what: str, claimed: str):
        self.fail(
            f"truncated GGUF file: it ends inside the header ({what} needs {claimed}, "
            f"{max(self.left(), 0):,} bytes are left)"
        )

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, item: int | None = None) -> str:
        """A GGUF string: its length, then that many bytes of UTF-8 (what every reader decodes)."""
        n = self.scalar("<Q", what)
        if n > self.left():
            self.overrun(what, f"{n:,} bytes")
        data = self.take(n, what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            where = f"{what}{'' if item is None else f' (item {item:,})'}"
            raise GgufFileError(
                f"{self.path}: corrupt GGUF file: {where} is not valid UTF-8 (byte {data[error.start]:#04x} at "
                f"position {error.start} of its {n:,} bytes {data[:40]!r}{'...' if n > 40 else ''})"
            ) from None

    def value(self, type_id: int, what: str, keep: bool = True, depth: int = 0):
        if type_id in SCALARS:
            return self.scalar(SCALARS[type_id], what)
        if type_id == STRING:
            return self.string(what)
        if type_id == ARRAY:
            return self.array(what, keep, depth + 1)
        self.fail(f"corrupt GGUF file: {what} has unknown value type {type_id}")

    def array(self, what: str, keep: bool, depth: int):
        if depth > MAX_ARRAY_DEPTH:
            self.fail(f"corrupt GGUF file: {what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        item_type, count = self.scalar("<I", what), self.scalar("<Q", what)
        if item_type == ARRAY and what not in self.nested:
            self.nested.append(what)
        items = self._scalar_items(item_type, count, what, keep) if item_type in SCALARS else \
            self._other_items(item_type, count, what, keep, depth)
        if items is not None:
            return items
        length = ArrayLength(count)
        length.item_type = item_type
        return length

    def _scalar_items(self, item_type: int, count: int, what: str, keep: bool) -> list | None:
        width = struct.calcsize(SCALARS[item_type])
        if count * width > self.left():
            self.overrun(what, f"{count:,} items")
        if keep:
            return list(struct.unpack(f"<{count}{SCALARS[item_type][1]}", self.take(count * width, what)))
        self.f.seek(count * width, os.SEEK_CUR)
        return None

    def _other_items(self, item_type: int, count: int, what: str, keep: bool, depth: int) -> list | None:
        if count > self.left():  # every item takes at least one byte
            self.overrun(what, f"{count:,} items")
        if item_type == STRING:  # a string item is named by its index when it is not UTF-8
            items = [self.string(what, item) for item in range(count)]
        else:
            items = [self.value(item_type, what, keep, depth) for _ in range(count)]
        return items if keep else None


def read_header(path: str | os.PathLike) -> GgufSummary:
    """Parse and bounds-check the header and tensor table; raise GgufFileError on a damaged file."""
    path = Path(path)
    if not path.is_file():
        raise GgufFileError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, path, size)
        version, n_tensors, n_kv = _read_preamble(r)
        metadata = _read_metadata(r, n_kv)
        tensors, offsets = _read_tensor_table(r, n_tensors)
        alignment = _alignment(metadata, path)
        data_start = -(-f.tell() // alignment) * alignment
    data_end = data_start + _data_bytes(path, size, data_start, _tensor_extents(path, tensors, offsets, alignment))
    return GgufSummary(
        path=path, version=version, architecture=str(metadata.get("general.architecture", "")),
        metadata=metadata, tensors=tensors, file_bytes=size, data_bytes=data_end - data_start,
        nested_arrays=tuple(r.nested),
    )


def _read_preamble(r: _Reader) -> tuple[int, int, int]:
    """(version, tensor count, metadata count), after the magic."""
    magic = r.f.read(len(MAGIC))
    if magic != MAGIC:
        r.fail(f"not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
    version = r.scalar("<I", "version")
    if version not in VERSIONS:
        r.fail(f"GGUF version {version} is not supported (only {VERSIONS})")
    n_tensors, n_kv = r.scalar("<Q", "tensor count"), r.scalar("<Q", "metadata count")
    if n_tensors > r.size or n_kv > r.size:
        r.fail(f"corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")
    return version, n_tensors, n_kv


def _read_metadata(r: _Reader, n_kv: int) -> dict:
    metadata = {}
    key = None
    for index in range(n_kv):
        key = r.string(f"metadata key {index:,}" + (f" (the one after {key!r})" if key is not None else ""))
        if key in metadata:
            r.fail(f"corrupt GGUF file: metadata key {key!r} appears twice")
        type_id = r.scalar("<I", f"metadata {key!r}")
        keep = not key.startswith("tokenizer.ggml.") or key in TOKENIZER_KEYS_KEPT
        metadata[key] = r.value(type_id, f"metadata {key!r}", keep)
    return metadata


def _read_tensor_table(r: _Reader, n_tensors: int) -> tuple[dict, dict]:
    """(name -> (ggml type id, shape), name -> data offset), in file order."""
    tensors, offsets = {}, {}
    for index in range(n_tensors):
        name = r.string(f"the name of tensor {index:,} in the tensor table")
        if name in tensors:
            r.fail(f"corrupt tensor table: tensor {name!r} is listed twice")
        n_dims = r.scalar("<I", f"tensor {name!r}")
        if n_dims > MAX_DIMENSIONS:
            r.fail(f"corrupt tensor table: {name!r} has {n_dims} dimensions")
        shape = tuple(r.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims))
        if 0 in shape or any(dim >= 1 << 63 for dim in shape):
            r.fail(f"corrupt tensor table: {name!r} has shape {list(shape)}")
        type_id, offset = r.scalar("<I", f"tensor {name!r}"), r.scalar("<Q", f"tensor {name!r}")
        tensors[name], offsets[name] = (type_id, shape), offset
    return tensors, offsets


def _alignment(metadata: dict, path: Path) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not is_int(alignment) or alignment < 1 or alignment & (alignment - 1):
        raise GgufFileError(f"{path}: general.alignment is {alignment!r}; it must be a power of two")
    return alignment


def _data_bytes(path: Path, size: int, data_start: int, extents: list[tuple[int, int, str]]) -> int:
    """The length of the data section; no two tensors' data overlap, and all of it is in the file."""
    for (_, end, name), (next_start, _, next_name) in zip(extents, extents[1:], strict=False):
        if next_start < end:
            raise GgufFileError(f"{path}: corrupt tensor table: the data of tensors {name!r} and {next_name!r} overlap")
    data_bytes = extents[-1][1] if extents else 0
    if extents and data_start + data_bytes > size:  # (no tensors: the header may end unaligned)
        _, end, name = max(extents, key=lambda extent: extent[1])
        raise GgufFileError(
            f"{path}: truncated GGUF file: tensor {name!r} ends at byte {data_start + end:,}, the file has {size:,} bytes"
        )
    return data_bytes


def _tensor_extents(path: Path, tensors: dict, offsets: dict, alignment: int) -> list[tuple[int, int, str]]:
    """(start, end, name) of each tensor's data, relative to the data section, in file order."""
    from gguf import GGML_QUANT_SIZES

    extents = []
    for name, (type_id, shape) in tensors.items():
        if type_id not in GGML_QUANT_SIZES:
            raise GgufFileError(
                f"{path}: tensor {name!r} has ggml type id {type_id}, which is not a ggml type "
                f"(known ids: {sorted(int(t) for t in GGML_QUANT_SIZES)})"
            )
        block_elements, block_bytes = GGML_QUANT_SIZES[type_id]
        if shape and shape[0] % block_elements:
            raise GgufFileError(f"{path}: tensor {name!r}: rows of {shape[0]} do not fill whole blocks of {block_elements}")
        if offsets[name] % alignment:
            raise GgufFileError(
                f"{path}: corrupt tensor table: the data of tensor {name!r} starts at offset {offsets[name]:,}, "
                f"not a multiple of the alignment {alignment}"
            )
        extents.append((offsets[name], offsets[name] + math.prod(shape) // block_elements * block_bytes, name))
    return sorted(extents)

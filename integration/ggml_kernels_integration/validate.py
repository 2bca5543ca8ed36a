"""Check a GGUF file before anything is loaded from it, and say what is wrong in one sentence.

transformers reads a GGUF file in several passes (config, tokenizer, weights). A damaged or
unsupported file gets through the first ones and then fails deep inside the loader, with a numpy,
tokenizer or shape error that does not name the file's problem, and sometimes after a model has
been built. `check_gguf()` reads only the header (metadata and tensor table, never the weights) and
raises `GgufFileError` (a ValueError) for:

- a file that is not GGUF, of a version we do not read, or cut short (its tensor table or any
  tensor's data ends past the end of the file);
- an architecture neither transformers' packed loader (plus ours, see `archs`) nor its legacy
  loader knows;
- a missing tokenizer (no `tokenizer.ggml.model` / `tokenizer.ggml.tokens`);
- a tensor of a ggml type id that does not exist, or that transformers 5.22's GGUF reader cannot
  read (it has no block table for Q5_0 / Q5_1, for instance).

`enable()` runs it in front of transformers' own header reads, so `from_pretrained` fails before
building a model; the CLI runs it first thing.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# metadata value type id -> struct format of a scalar (strings and arrays are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufFileError(ValueError):
    """The file cannot be loaded; the message says why, naming the file."""


@dataclass
class GgufSummary:
    path: Path
    version: int
    architecture: str
    metadata: dict = field(repr=False)
    tensors: dict[str, tuple[int, tuple[int, ...]]] = field(repr=False)  # name -> (ggml type id, shape)
    file_bytes: int = 0
    data_bytes: int = 0

    @property
    def type_names(self) -> dict[str, int]:
        """ggml type name -> number of tensors of that type."""
        from gguf import GGMLQuantizationType

        counts: dict[str, int] = {}
        for type_id, _ in self.tensors.values():
            name = GGMLQuantizationType(type_id).name
            counts[name] = counts.get(name, 0) + 1
        return counts


class _Reader:
    """Bounds-checked little-endian reads from the header of an open file."""

    def __init__(self, f, path: Path, size: int):
        self.f, self.path, self.size = f, path, size

    def take(self, n: int, what: str) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            self.overrun(what, f"{n} bytes")
        return data

    def overrun(self, what: str, claimed: str):
        left = self.size - self.f.tell()
        raise GgufFileError(
            f"{self.path}: truncated GGUF file: it ends inside the header ({what} needs {claimed}, "
            f"{max(left, 0):,} bytes are left)"
        )

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        if n > self.size - self.f.tell():
            self.overrun(what, f"{n:,} bytes")
        return self.take(n, what).decode("utf-8", errors="replace")

    def value(self, type_id: int, what: str, keep: bool = True):
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id], what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            item_type, count = self.scalar("<I", what), self.scalar("<Q", what)
            if item_type in _SCALARS:
                width = struct.calcsize(_SCALARS[item_type])
                if count * width > self.size - self.f.tell():
                    self.overrun(what, f"{count:,} items")
                if not keep:
                    self.f.seek(count * width, os.SEEK_CUR)
                    return count
                raw = self.take(count * width, what)
                return list(struct.unpack(f"<{count}{_SCALARS[item_type][1]}", raw))
            if count > self.size - self.f.tell():  # every item takes at least one byte
                self.overrun(what, f"{count:,} items")
            items = [self.value(item_type, what, keep) for _ in range(count)]
            return items if keep else count
        raise GgufFileError(f"{self.path}: corrupt GGUF file: {what} has unknown value type {type_id}")


def _supported_architectures() -> tuple[set[str], set[str]]:
    """(architectures transformers loads packed, including ours; ones its legacy loader handles)."""
    from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS

    from . import archs

    packed = set(GGUF_ARCHS) | set(archs.ARCHS)
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES as legacy
    except ImportError:  # a transformers without the legacy loader
        legacy = ()
    return packed, set(legacy) - {"general", "tokenizer"}  # the legacy table's two non-architecture keys


def read_header(path: str | os.PathLike) -> GgufSummary:
    """Parse and bounds-check the header and tensor table; raise GgufFileError on a damaged file."""
    from gguf import GGML_QUANT_SIZES

    path = Path(path)
    if not path.is_file():
        raise GgufFileError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, path, size)
        magic = f.read(4)
        if magic != MAGIC:
            raise GgufFileError(f"{path}: not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
        version = r.scalar("<I", "version")
        if version not in VERSIONS:
            raise GgufFileError(f"{path}: GGUF version {version} is not supported (only {VERSIONS})")
        n_tensors, n_kv = r.scalar("<Q", "tensor count"), r.scalar("<Q", "metadata count")
        if n_tensors > size or n_kv > size:
            raise GgufFileError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")
        metadata = {}
        for _ in range(n_kv):
            key = r.string("a metadata key")
            type_id = r.scalar("<I", f"metadata {key!r}")
            keep = not key.startswith("tokenizer.ggml.") or key in ("tokenizer.ggml.model", "tokenizer.ggml.pre")
            metadata[key] = r.value(type_id, f"metadata {key!r}", keep)
        tensors, offsets = {}, {}
        for _ in range(n_tensors):
            name = r.string("a tensor name")
            n_dims = r.scalar("<I", f"tensor {name!r}")
            if n_dims > 4:
                raise GgufFileError(f"{path}: corrupt tensor table: {name!r} has {n_dims} dimensions")
            shape = tuple(r.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims))
            type_id, offset = r.scalar("<I", f"tensor {name!r}"), r.scalar("<Q", f"tensor {name!r}")
            tensors[name], offsets[name] = (type_id, shape), offset
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        data_start = -(-f.tell() // alignment) * alignment

    data_end = data_start
    for name, (type_id, shape) in tensors.items():
        if type_id not in GGML_QUANT_SIZES:
            raise GgufFileError(
                f"{path}: tensor {name!r} has ggml type id {type_id}, which is not a ggml type "
                f"(known ids: {sorted(GGML_QUANT_SIZES)})"
            )
        block_elements, block_bytes = GGML_QUANT_SIZES[type_id]
        elements = 1
        for dim in shape:
            elements *= dim
        if shape and shape[0] % block_elements:
            raise GgufFileError(f"{path}: tensor {name!r}: rows of {shape[0]} do not fill whole blocks of {block_elements}")
        end = data_start + offsets[name] + elements // block_elements * block_bytes
        if end > size:
            raise GgufFileError(
                f"{path}: truncated GGUF file: tensor {name!r} ends at byte {end:,}, the file has {size:,} bytes"
            )
        data_end = max(data_end, end)
    return GgufSummary(
        path=path, version=version, architecture=str(metadata.get("general.architecture", "")),
        metadata=metadata, tensors=tensors, file_bytes=size, data_bytes=data_end - data_start,
    )


def check_gguf(path: str | os.PathLike) -> GgufSummary:
    """Everything `read_header` checks, plus: an architecture, a tokenizer and tensor types that
    transformers can load. Returns the header summary."""
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf.dequant import GGML_BLOCK

    summary = read_header(path)
    arch = summary.architecture
    if not arch:
        raise GgufFileError(f"{summary.path}: no general.architecture in the metadata")
    packed, legacy = _supported_architectures()
    if arch not in packed | legacy:
        raise GgufFileError(
            f"{summary.path}: architecture {arch!r} is not supported by transformers' GGUF loader "
            f"(packed on our kernels: {sorted(packed)}; dequantized: {sorted(legacy - packed)})"
        )
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in summary.metadata]
    if missing:
        raise GgufFileError(
            f"{summary.path}: the file has no tokenizer (missing {', '.join(missing)}); transformers takes "
            f"the vocabulary from it"
        )
    if arch not in packed:  # the legacy loader dequantizes with gguf-py, which reads every ggml type
        return summary
    float_types = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    for name, (type_id, _) in summary.tensors.items():
        if type_id not in float_types and type_id not in GGML_BLOCK:
            raise GgufFileError(
                f"{summary.path}: tensor {name!r} is {GGMLQuantizationType(type_id).name}, a ggml type "
                f"transformers' GGUF reader cannot read (it reads {sorted(GGMLQuantizationType(t).name for t in GGML_BLOCK)})"
            )
    return summary

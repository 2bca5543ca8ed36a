"""Check a GGUF file before anything is loaded from it, and say what is wrong in one sentence.

transformers reads a GGUF file in several passes (config, tokenizer, weights). A damaged or
unsupported file gets through the first ones and then fails deep inside the loader, with a numpy,
tokenizer or shape error that does not name the file's problem; worse, a file whose metadata and
tensors disagree builds a model (of whatever size the metadata says) and fills what the file lacks
with random weights, after a warning. `check_gguf()` reads only the header (metadata and tensor
table, never the weights) and raises `GgufFileError` (a ValueError) for:

- a file that is not GGUF, of a version we do not read, or cut short (its header, or any tensor's
  data, ends past the end of the file); a `general.alignment` that is not a power of two; metadata
  arrays nested more than `MAX_ARRAY_DEPTH` deep; a tensor listed twice, of a dimension 0, whose
  data is not aligned or overlaps another tensor's; a metadata key, string value (a vocabulary
  entry, say) or tensor name that is not UTF-8 (GGUF's text encoding: transformers' config and
  tokenizer reads fail on anything else, without naming the key);
- an architecture neither transformers' packed loader (plus ours, see `archs`) nor its legacy
  loader knows;
- a missing or empty tokenizer (`tokenizer.ggml.model` / `tokenizer.ggml.tokens`), or a special
  token id (bos, eos, padding, ...) outside the vocabulary;
- a file with no tensors, a `block_count` other than the number of `blk.N` blocks the file has, a
  `context_length` above `MAX_CONTEXT_LENGTH`, and a size that is not a positive integer or a
  `rope.freq_base` / norm epsilon that is not a finite positive number;
- for the architectures in `ARCH_RULES` (qwen35, qwen35moe, llama): a hyperparameter its config
  needs that is missing, hyperparameters that contradict each other, and a tensor the model needs
  that is missing or of another shape than the hyperparameters make it;
- for the packed loader: a tensor of a ggml type id that does not exist, or that transformers
  5.22's GGUF reader cannot read (it has no block table for Q5_0 / Q5_1, for instance), and
  metadata arrays of arrays, which its reader cannot read either.

`enable()` runs it in front of transformers' own header reads, so `from_pretrained` fails before
building a model; the CLI runs it first thing.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 16  # arrays of arrays: far below what would exhaust Python's stack in any reader
# no tensor has a row per position, so nothing but a bound checks this one: 16M tokens, above any
# released model's context (10M)
MAX_CONTEXT_LENGTH = 1 << 24

# metadata value type id -> struct format of a scalar (strings and arrays are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_BLOCK = re.compile(r"blk\.(\d+)\.")


class GgufFileError(ValueError):
    """The file cannot be loaded; the message says why, naming the file."""


class ArrayLength(int):
    """The length of a metadata array whose items were skipped rather than read (the vocabulary,
    the merges); `item_type` is the GGUF value type of its items."""

    item_type: int


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

    def string(self, what: str, item: int | None = None) -> str:
        """A GGUF string: its length, then that many bytes of UTF-8 (what every reader decodes)."""
        n = self.scalar("<Q", what)
        if n > self.size - self.f.tell():
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
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id], what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            return self.array(what, keep, depth + 1)
        raise GgufFileError(f"{self.path}: corrupt GGUF file: {what} has unknown value type {type_id}")

    def array(self, what: str, keep: bool, depth: int):
        if depth > MAX_ARRAY_DEPTH:
            raise GgufFileError(f"{self.path}: corrupt GGUF file: {what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        item_type, count = self.scalar("<I", what), self.scalar("<Q", what)
        if item_type == _ARRAY and what not in self.nested:
            self.nested.append(what)
        if item_type in _SCALARS:
            width = struct.calcsize(_SCALARS[item_type])
            if count * width > self.size - self.f.tell():
                self.overrun(what, f"{count:,} items")
            if keep:
                return list(struct.unpack(f"<{count}{_SCALARS[item_type][1]}", self.take(count * width, what)))
            self.f.seek(count * width, os.SEEK_CUR)
        else:
            if count > self.size - self.f.tell():  # every item takes at least one byte
                self.overrun(what, f"{count:,} items")
            if item_type == _STRING:  # a string item is named by its index when it is not UTF-8
                items = [self.string(what, item) for item in range(count)]
            else:
                items = [self.value(item_type, what, keep, depth) for _ in range(count)]
            if keep:
                return items
        length = ArrayLength(count)
        length.item_type = item_type
        return length


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


def _is_int(value) -> bool:
    return type(value) is int  # not a bool, nor the length of an array (`ArrayLength`)


def _alignment(metadata: dict, path: Path) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not _is_int(alignment) or alignment < 1 or alignment & (alignment - 1):
        raise GgufFileError(f"{path}: general.alignment is {alignment!r}; it must be a power of two")
    return alignment


def read_header(path: str | os.PathLike) -> GgufSummary:
    """Parse and bounds-check the header and tensor table; raise GgufFileError on a damaged file."""
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
        key = None
        for index in range(n_kv):
            key = r.string(f"metadata key {index:,}" + (f" (the one after {key!r})" if key is not None else ""))
            if key in metadata:
                raise GgufFileError(f"{path}: corrupt GGUF file: metadata key {key!r} appears twice")
            type_id = r.scalar("<I", f"metadata {key!r}")
            keep = not key.startswith("tokenizer.ggml.") or key in ("tokenizer.ggml.model", "tokenizer.ggml.pre")
            metadata[key] = r.value(type_id, f"metadata {key!r}", keep)
        tensors, offsets = {}, {}
        for index in range(n_tensors):
            name = r.string(f"the name of tensor {index:,} in the tensor table")
            if name in tensors:
                raise GgufFileError(f"{path}: corrupt tensor table: tensor {name!r} is listed twice")
            n_dims = r.scalar("<I", f"tensor {name!r}")
            if n_dims > 4:
                raise GgufFileError(f"{path}: corrupt tensor table: {name!r} has {n_dims} dimensions")
            shape = tuple(r.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims))
            if 0 in shape or any(dim >= 1 << 63 for dim in shape):
                raise GgufFileError(f"{path}: corrupt tensor table: {name!r} has shape {list(shape)}")
            type_id, offset = r.scalar("<I", f"tensor {name!r}"), r.scalar("<Q", f"tensor {name!r}")
            tensors[name], offsets[name] = (type_id, shape), offset
        alignment = _alignment(metadata, path)
        data_start = -(-f.tell() // alignment) * alignment

    extents = _tensor_extents(path, tensors, offsets, alignment)
    for (_, end, name), (next_start, _, next_name) in zip(extents, extents[1:], strict=False):
        if next_start < end:
            raise GgufFileError(f"{path}: corrupt tensor table: the data of tensors {name!r} and {next_name!r} overlap")
    data_end = data_start + (extents[-1][1] if extents else 0)
    if data_end > size:
        _, end, name = max(extents, key=lambda extent: extent[1])
        raise GgufFileError(
            f"{path}: truncated GGUF file: tensor {name!r} ends at byte {data_start + end:,}, the file has {size:,} bytes"
        )
    return GgufSummary(
        path=path, version=version, architecture=str(metadata.get("general.architecture", "")),
        metadata=metadata, tensors=tensors, file_bytes=size, data_bytes=data_end - data_start,
        nested_arrays=tuple(r.nested),
    )


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


# ---------------------------------------------------------------------------------------------
# what a model of each architecture needs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """A hyperparameter read from `<arch>.<key>`."""

    key: str
    default: Callable[[SimpleNamespace], object] | None = None  # from the ones before it; None: required
    kind: str = "size"  # see _KINDS


_KINDS = {  # kind -> (test, what the value must be)
    "size": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "count": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "real": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
             "a finite positive number"),
    "sizes": (lambda v: isinstance(v, list) and v and all(_is_int(x) and x >= 0 for x in v),
              "a list of non-negative integers"),
}

# Checked on every architecture where the file has them (`<arch>.<key>`: kind).
GENERAL_PARAMS = {
    "block_count": "size", "context_length": "size", "embedding_length": "size", "attention.head_count": "size",
    "vocab_size": "size", "rope.freq_base": "real", "attention.layer_norm_rms_epsilon": "real",
    "attention.layer_norm_epsilon": "real",
}


@dataclass(frozen=True)
class ArchRules:
    """What a model of one architecture reads from a file: its hyperparameters (name -> where the
    file states it), relations between them, and the tensors (groups of `TENSORS`) of the whole
    model and of block `i`."""

    params: dict[str, Param]
    relations: tuple[tuple[str, Callable[[SimpleNamespace], bool]], ...]  # (statement, holds)
    block_groups: Callable[[SimpleNamespace, int], tuple[str, ...]]
    model_groups: tuple[str, ...] = ("model",)


# Tensor shapes as the file lists them (ggml order: the row length first), from the hyperparameters
# above (and `tokens`, the tokenizer's length); `blk.{i}.` goes in front of the block ones.
TENSORS: dict[str, dict[str, Callable[[SimpleNamespace], tuple[int, ...]]]] = {
    "model": {
        "token_embd.weight": lambda p: (p.embd, p.vocab),
        "output_norm.weight": lambda p: (p.embd,),
        "output.weight": lambda p: (p.embd, p.vocab),
    },
    "llama_attention": {
        "attn_norm.weight": lambda p: (p.embd,),
        "attn_q.weight": lambda p: (p.embd, p.heads * p.head_dim),
        "attn_k.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_v.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_output.weight": lambda p: (p.heads * p.head_dim, p.embd),
        "ffn_norm.weight": lambda p: (p.embd,),
    },
    "qwen35_norms": {
        "attn_norm.weight": lambda p: (p.embd,),
        "post_attention_norm.weight": lambda p: (p.embd,),
    },
    "gated_attention": {  # each head's query followed by its output gate
        "attn_q.weight": lambda p: (p.embd, 2 * p.heads * p.head_dim),
        "attn_k.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_v.weight": lambda p: (p.embd, p.kv_heads * p.head_dim),
        "attn_output.weight": lambda p: (p.heads * p.head_dim, p.embd),
        "attn_q_norm.weight": lambda p: (p.head_dim,),
        "attn_k_norm.weight": lambda p: (p.head_dim,),
    },
    "linear_attention": {  # gated delta net: fused q/k/v, then a convolution over it
        "attn_qkv.weight": lambda p: (p.embd, 2 * p.k_heads * p.k_dim + p.v_size),
        "attn_gate.weight": lambda p: (p.embd, p.v_size),
        "ssm_conv1d.weight": lambda p: (p.conv, 2 * p.k_heads * p.k_dim + p.v_size),
        "ssm_dt.bias": lambda p: (p.v_heads,),
        "ssm_a": lambda p: (p.v_heads,),
        "ssm_beta.weight": lambda p: (p.embd, p.v_heads),
        "ssm_alpha.weight": lambda p: (p.embd, p.v_heads),
        "ssm_norm.weight": lambda p: (p.v_size // p.v_heads,),
        "ssm_out.weight": lambda p: (p.v_size, p.embd),
    },
    "dense_ffn": {
        "ffn_gate.weight": lambda p: (p.embd, p.ff),
        "ffn_up.weight": lambda p: (p.embd, p.ff),
        "ffn_down.weight": lambda p: (p.ff, p.embd),
    },
    "moe_ffn": {  # routed experts, and a shared one with its gate
        "ffn_gate_inp.weight": lambda p: (p.embd, p.experts),
        "ffn_gate_exps.weight": lambda p: (p.embd, p.expert_ff, p.experts),
        "ffn_up_exps.weight": lambda p: (p.embd, p.expert_ff, p.experts),
        "ffn_down_exps.weight": lambda p: (p.expert_ff, p.embd, p.experts),
        "ffn_gate_inp_shexp.weight": lambda p: (p.embd,),
        "ffn_gate_shexp.weight": lambda p: (p.embd, p.shared_ff),
        "ffn_up_shexp.weight": lambda p: (p.embd, p.shared_ff),
        "ffn_down_shexp.weight": lambda p: (p.shared_ff, p.embd),
    },
}
# llama.cpp writes the output projection only when it is not the embedding matrix
OPTIONAL_TENSORS = {"output.weight"}

# What transformers' Qwen3.5 config reads (gguf_config_mapping._qwen35_config).
_QWEN35_PARAMS = {
    "blocks": Param("block_count"),
    "mtp": Param("nextn_predict_layers", lambda p: 0, "count"),  # the file counts them in block_count
    "context": Param("context_length"),
    "embd": Param("embedding_length"),
    "heads": Param("attention.head_count"),
    "kv_heads": Param("attention.head_count_kv"),
    "head_dim": Param("attention.key_length"),
    "eps": Param("attention.layer_norm_rms_epsilon", kind="real"),
    "rope_base": Param("rope.freq_base", kind="real"),
    "rope_dims": Param("rope.dimension_count"),
    "rope_sections": Param("rope.dimension_sections", kind="sizes"),
    "interval": Param("full_attention_interval"),
    "conv": Param("ssm.conv_kernel"),
    "k_dim": Param("ssm.state_size"),
    "k_heads": Param("ssm.group_count"),
    "v_heads": Param("ssm.time_step_rank"),
    "v_size": Param("ssm.inner_size"),
}
_QWEN35_RELATIONS = (
    ("{mtp} must be less than {blocks}", lambda p: p.mtp < p.blocks),
    ("{heads} must be a multiple of {kv_heads}", lambda p: p.heads % p.kv_heads == 0),
    ("{v_heads} must be a multiple of {k_heads}", lambda p: p.v_heads % p.k_heads == 0),
    ("{v_size} must be a multiple of {v_heads}", lambda p: p.v_size % p.v_heads == 0),
    ("{rope_dims} must be even and at most {head_dim}", lambda p: p.rope_dims % 2 == 0 and p.rope_dims <= p.head_dim),
    ("{rope_sections} must add up to half {rope_dims}", lambda p: 2 * sum(p.rope_sections) == p.rope_dims),
)


def _qwen35_blocks(ffn: str) -> Callable[[SimpleNamespace, int], tuple[str, ...]]:
    # every `interval`-th layer is full attention, the others linear (transformers' layer_types)
    return lambda p, i: ("qwen35_norms", "gated_attention" if (i + 1) % p.interval == 0 else "linear_attention", ffn)


ARCH_RULES = {
    "qwen35": ArchRules(
        params=_QWEN35_PARAMS | {"ff": Param("feed_forward_length")},
        relations=_QWEN35_RELATIONS,
        block_groups=_qwen35_blocks("dense_ffn"),
    ),
    "qwen35moe": ArchRules(
        params=_QWEN35_PARAMS | {
            "experts": Param("expert_count"),
            "experts_used": Param("expert_used_count"),
            "expert_ff": Param("expert_feed_forward_length"),
            "shared_ff": Param("expert_shared_feed_forward_length"),
        },
        relations=_QWEN35_RELATIONS + (("{experts_used} must be at most {experts}", lambda p: p.experts_used <= p.experts),),
        block_groups=_qwen35_blocks("moe_ffn"),
    ),
    # transformers' legacy llama config (integrations/ggml.py), which our packed llama load uses too
    "llama": ArchRules(
        params={
            "blocks": Param("block_count"),
            "context": Param("context_length"),
            "embd": Param("embedding_length"),
            "ff": Param("feed_forward_length"),
            "heads": Param("attention.head_count"),
            "kv_heads": Param("attention.head_count_kv", lambda p: p.heads),
            "head_dim": Param("rope.dimension_count", lambda p: p.embd // p.heads),
            "vocab": Param("vocab_size", lambda p: p.tokens),
        },
        relations=(
            ("{heads} must be a multiple of {kv_heads}", lambda p: p.heads % p.kv_heads == 0),
            ("{head_dim} must be even", lambda p: p.head_dim % 2 == 0),  # ggml's rope rotates pairs
            ("{tokens} must not outnumber {vocab}", lambda p: p.tokens <= p.vocab),
        ),
        block_groups=lambda p, i: ("llama_attention", "dense_ffn"),
    ),
}


# ---------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------


def check_gguf(path: str | os.PathLike) -> GgufSummary:
    """Everything `read_header` checks, plus: an architecture, a tokenizer, hyperparameters,
    tensors and tensor types from which transformers can build the model the file declares.
    Returns the header summary."""
    summary = read_header(path)
    arch = summary.architecture
    if not arch:
        summary.fail("no general.architecture in the metadata")
    packed, legacy = _supported_architectures()
    if arch not in packed | legacy:
        summary.fail(
            f"architecture {arch!r} is not supported by transformers' GGUF loader "
            f"(packed on our kernels: {sorted(packed)}; dequantized: {sorted(legacy - packed)})"
        )
    tokens = _check_tokenizer(summary)
    if not summary.tensors:
        summary.fail("the file has no tensors")
    for key, kind in GENERAL_PARAMS.items():
        if f"{arch}.{key}" in summary.metadata and not isinstance(summary.metadata[f"{arch}.{key}"], list):
            _param(summary, f"{arch}.{key}", kind)
    context = summary.metadata.get(f"{arch}.context_length", 0)
    if _is_int(context) and context > MAX_CONTEXT_LENGTH:
        summary.fail(f"{arch}.context_length is {context:,}, more than the {MAX_CONTEXT_LENGTH:,} tokens we accept")
    _check_blocks(summary)
    if arch in ARCH_RULES:
        _check_model(summary, ARCH_RULES[arch], tokens)
    if arch in packed:
        _check_packed_reader_can_read(summary)
    return summary


def _param(summary: GgufSummary, key: str, kind: str):
    value = summary.metadata[key]
    test, meaning = _KINDS[kind]
    if not test(value):
        summary.fail(f"{key} is {value!r}; it must be {meaning}")
    return value


def _check_tokenizer(summary: GgufSummary) -> int:
    """The vocabulary's length, after checking it and every special token id against it."""
    metadata = summary.metadata
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in metadata]
    if missing:
        summary.fail(f"the file has no tokenizer (missing {', '.join(missing)}); transformers takes the vocabulary from it")
    tokens = metadata["tokenizer.ggml.tokens"]
    if not isinstance(tokens, ArrayLength) or tokens.item_type != _STRING or tokens == 0:
        summary.fail("tokenizer.ggml.tokens is empty or not a list of strings; the vocabulary needs one token at least")
    for key, value in metadata.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not (_is_int(value) and 0 <= value < tokens):
            summary.fail(f"{key} is {value!r}, not a token of the {tokens:,}-token vocabulary")
    return int(tokens)


def _check_blocks(summary: GgufSummary) -> None:
    """`<arch>.block_count` is the number of blocks `blk.0.` ... the file has tensors for."""
    key = f"{summary.architecture}.block_count"
    present = sorted({int(m.group(1)) for name in summary.tensors if (m := _BLOCK.match(name))})
    count = summary.metadata.get(key)
    contiguous = present == list(range(len(present)))
    if _is_int(count) and not (contiguous and count == len(present)):
        has = f"blk.0 to blk.{present[-1]}" if contiguous else f"blocks {present}"
        summary.fail(f"{key} is {count:,}, but the file has tensors for {has if present else 'no blocks'}")


def _check_model(summary: GgufSummary, rules: ArchRules, tokens: int) -> None:
    """The hyperparameters `rules` read, their relations, and the tensors of the model they make."""
    p, sources = _read_params(summary, rules, tokens)
    for statement, holds in rules.relations:
        if not holds(p):
            summary.fail(f"{summary.architecture} hyperparameters disagree: {statement.format(**sources)}")
    _check_tensors(summary, rules, p, sources)


def _read_params(summary: GgufSummary, rules: ArchRules, tokens: int) -> tuple[SimpleNamespace, dict[str, str]]:
    """(the hyperparameters by name, where each came from, for messages)."""
    arch = summary.architecture
    p = SimpleNamespace(tokens=tokens, vocab=tokens)
    sources = {"tokens": f"the tokenizer's {tokens:,} tokens", "vocab": f"the tokenizer's {tokens:,} tokens"}
    for name, param in rules.params.items():
        key = f"{arch}.{param.key}"
        if key in summary.metadata:
            setattr(p, name, _param(summary, key, param.kind))
            sources[name] = f"{key} ({getattr(p, name)})"
        elif param.default is None:
            summary.fail(f"{key} is missing; a {arch} model's config needs it")
        else:
            setattr(p, name, param.default(p))
            sources[name] = f"{key} (not given: {getattr(p, name)})"
    return p, sources


def _check_tensors(summary: GgufSummary, rules: ArchRules, p: SimpleNamespace, sources: dict[str, str]) -> None:
    """Every tensor the model needs is there, of the shape the hyperparameters make it."""
    expected = {name: shape for group in rules.model_groups for name, shape in TENSORS[group].items()}
    for i in range(p.blocks - getattr(p, "mtp", 0)):
        for group in rules.block_groups(p, i):
            expected |= {f"blk.{i}.{name}": shape for name, shape in TENSORS[group].items()}
    for name, shape_of in expected.items():
        if name not in summary.tensors:
            if name in OPTIONAL_TENSORS:
                continue
            unknown = sorted(set(summary.tensors) - set(expected))
            hint = f" (tensors it does not use: {', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''})" if unknown else ""
            summary.fail(f"the file has no tensor {name!r}, which a {summary.architecture} model needs{hint}")
        want, have = _squeeze(shape_of(p)), _squeeze(summary.tensors[name][1])
        if want != have:
            used = [sources[n] for n in shape_of.__code__.co_names if n in sources]
            summary.fail(f"tensor {name!r} has shape {list(have)}, but {', '.join(used)} make it {list(want)}")


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    """ggml pads every shape to four dimensions with ones: (n,) and (n, 1) are the same tensor."""
    while shape and shape[-1] == 1:
        shape = shape[:-1]
    return tuple(shape)


def _check_packed_reader_can_read(summary: GgufSummary) -> None:
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf.dequant import GGML_BLOCK

    if summary.nested_arrays:
        summary.fail(f"{summary.nested_arrays[0]} is an array of arrays, which transformers' GGUF reader cannot read")
    float_types = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    for name, (type_id, _) in summary.tensors.items():
        if type_id not in float_types and type_id not in GGML_BLOCK:
            summary.fail(
                f"tensor {name!r} is {GGMLQuantizationType(type_id).name}, a ggml type transformers' GGUF reader "
                f"cannot read (it reads {sorted(GGMLQuantizationType(t).name for t in GGML_BLOCK)})"
            )

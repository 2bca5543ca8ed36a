"""Check a GGUF file before anything is loaded from it, and say what is wrong in one sentence.

transformers reads a GGUF file in several passes (config, tokenizer, weights). A damaged or
unsupported file gets through the first ones and then fails deep inside the loader, with a numpy,
tokenizer or shape error that does not name the file's problem; worse, a file whose metadata and
tensors disagree builds a model (of whatever size the metadata says) and fills what the file lacks
with random weights, after a warning. `check_gguf()` reads only the header (`gguf_header`, which
refuses a damaged file: cut short, misaligned, overlapping tensors, ...) and raises `GgufFileError`
(a ValueError) for what transformers cannot build a model from:

- an architecture neither transformers' packed loader (plus ours, see `archs`) nor its legacy
  loader knows;
- a missing or empty tokenizer (`tokenizer.ggml.model` / `tokenizer.ggml.tokens`), or a special
  token id (bos, eos, padding, ...) outside the vocabulary;
- a file with no tensors, a `block_count` other than the number of `blk.N` blocks the file has, a
  `context_length` above `MAX_CONTEXT_LENGTH`, and a size that is not a positive integer or a
  `rope.freq_base` / norm epsilon that is not a finite positive number (`arch_rules.GENERAL_PARAMS`);
- for the architectures in `arch_rules.ARCH_RULES` (qwen35, qwen35moe, llama): a hyperparameter its
  config needs that is missing, hyperparameters that contradict each other, and a tensor the model
  needs that is missing or of another shape than the hyperparameters make it;
- for the packed loader: a tensor of a ggml type that transformers 5.22's GGUF reader cannot read
  (it has no block table for Q5_0 / Q5_1, for instance), and metadata arrays of arrays, which its
  reader cannot read either.

`enable()` runs it in front of transformers' own header reads, so `from_pretrained` fails before
building a model; the CLI runs it first thing.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

from .arch_rules import ARCH_RULES, GENERAL_PARAMS, KINDS, OPTIONAL_TENSORS, TENSORS, ArchRules
from .gguf_header import STRING, ArrayLength, GgufFileError, GgufSummary, is_int, read_header

__all__ = ["MAX_CONTEXT_LENGTH", "GgufFileError", "GgufSummary", "check_gguf", "read_header"]

# no tensor has a row per position, so nothing but a bound checks this one: 16M tokens, above any
# released model's context (10M)
MAX_CONTEXT_LENGTH = 1 << 24
_BLOCK = re.compile(r"blk\.(\d+)\.")


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


def check_gguf(path: str | os.PathLike) -> GgufSummary:
    """Everything `read_header` checks, plus: an architecture, a tokenizer, hyperparameters,
    tensors and tensor types from which transformers can build the model the file declares.
    Returns the header summary."""
    summary = read_header(path)
    packed = _check_architecture(summary)
    tokens = _check_tokenizer(summary)
    if not summary.tensors:
        summary.fail("the file has no tensors")
    _check_general_params(summary)
    _check_blocks(summary)
    if summary.architecture in ARCH_RULES:
        _check_model(summary, ARCH_RULES[summary.architecture], tokens)
    if packed:
        _check_packed_reader_can_read(summary)
    return summary


def _check_architecture(summary: GgufSummary) -> bool:
    """Whether transformers loads the file's architecture packed (refused if it loads it not at all)."""
    arch = summary.architecture
    if not arch:
        summary.fail("no general.architecture in the metadata")
    packed, legacy = _supported_architectures()
    if arch not in packed | legacy:
        summary.fail(
            f"architecture {arch!r} is not supported by transformers' GGUF loader "
            f"(packed on our kernels: {sorted(packed)}; dequantized: {sorted(legacy - packed)})"
        )
    return arch in packed


def _check_general_params(summary: GgufSummary) -> None:
    arch = summary.architecture
    for key, kind in GENERAL_PARAMS.items():
        if f"{arch}.{key}" in summary.metadata and not isinstance(summary.metadata[f"{arch}.{key}"], list):
            _param(summary, f"{arch}.{key}", kind)
    context = summary.metadata.get(f"{arch}.context_length", 0)
    if is_int(context) and context > MAX_CONTEXT_LENGTH:
        summary.fail(f"{arch}.context_length is {context:,}, more than the {MAX_CONTEXT_LENGTH:,} tokens we accept")


def _param(summary: GgufSummary, key: str, kind: str):
    value = summary.metadata[key]
    test, meaning = KINDS[kind]
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
    if not isinstance(tokens, ArrayLength) or tokens.item_type != STRING or tokens == 0:
        summary.fail("tokenizer.ggml.tokens is empty or not a list of strings; the vocabulary needs one token at least")
    for key, value in metadata.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not (is_int(value) and 0 <= value < tokens):
            summary.fail(f"{key} is {value!r}, not a token of the {tokens:,}-token vocabulary")
    return int(tokens)


def _check_blocks(summary: GgufSummary) -> None:
    """`<arch>.block_count` is the number of blocks `blk.0.` ... the file has tensors for."""
    key = f"{summary.architecture}.block_count"
    present = sorted({int(m.group(1)) for name in summary.tensors if (m := _BLOCK.match(name))})
    count = summary.metadata.get(key)
    contiguous = present == list(range(len(present)))
    if is_int(count) and not (contiguous and count == len(present)):
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

"""Compiled decode steps as AOTInductor packages: exported once, loaded by a later process in
milliseconds, run without dynamo.

A `torch.compile`d step is traced by dynamo again in every process (7-18 s) and checks guards before
every call; a stored dynamo step (`stored_steps`) still takes 1.3-1.4 s to load. `torch.export`
captures the step as a graph with no Python left in it, and AOTInductor compiles that graph into a
shared library (`torch._inductor.aoti_compile_and_package`): loading the package is a `dlopen`, and a
call runs the generated C++, which calls our ops through torch's dispatcher, with no guard check.
SmolLM2-135M Q4_1 (AMD EPYC zen4, 2 threads, torch 2.15): export and compile 28-29 s once (with
`decode_graph`'s pass), load 8-11 ms, generate() of 32 tokens after 12 in 300-311 ms against
424 ms eager, the same tokens.

What is exported (`_Step`): the model's forward over the running generation's cache, whose tensors
(keys, values, lengths, a linear-attention layer's states: `_cache_tensors`) are buffers; the decode
step's tensor arguments (input_ids, position_ids, the attention mask or Qwen3.5's masks by layer
type) are the inputs and its plain ones (use_cache, logits_to_keep) constants; the output is the
logits. transformers' static cache gives every step the same shapes, its masks included, so one
package serves a whole generation, padded rows too. The weights are not put in the package
(`package_constants_in_so=False`): the loaded step is given the model's own parameters and the
generation's cache tensors (`load_constants(user_managed=True)`, no copy), again whenever another
cache comes. Each package is kept per shape and arguments' layout; calls it cannot serve (`_split`:
several tokens, hidden states or attentions asked for, arguments that are not tensors or plain
values) go to `fallback` (the stored dynamo step or `torch.compile`), as does a step whose export
failed.

A prompt's forward (several tokens per row over the static cache, which transformers' chunked prefill
sends through the compiled call: `compiled_decode` asks for one chunk) is packaged too
(`PackagedSteps._prompt_package_for`; `GGML_KERNELS_PACKAGED_PROMPTS=0` turns it off): exported with
the prompt's length dynamic (`Dim.AUTO` on every dim of that length), so that one package serves
every length in the range the export proves the graph for (`_token_range`: our ops' paths change
with the row count, so SmolLM2's prompts take three packages: 2-8, 9-31 and 32-128 tokens), named by
that range, up to `MAX_PROMPT_TOKENS`. A prompt no package serves runs the eager forward, never a
`torch.compile` of its own shape. A short prompt's eager forward spends about what a decode step
does in Python and small torch ops, which the package saves: SmolLM2's 16-token prompt 61 ms eager,
52 ms packaged (Intel Xeon, 2 threads). Before a package runs, the cache must hold every tensor the
prompt writes (`_ready_for_prompt`): transformers makes a static cache anew for each generate() and
its linear-attention states on their first update, so the states an eager prompt made are kept
(`StateShapes`) and made in the next new cache; a model's first prompt in a process runs eagerly.
After it, the Python state an eager prompt leaves (`has_previous_state`) is set (`_after_prompt`).

Packages live in the stored steps' folder (`stored_steps.folder()`), named by the model's fingerprint
(`fingerprint`: `stored_steps.key` of the model without inputs: config, parameter layout, modules'
plain attributes, software, CPU, threads), the step's shape and the hash of its inputs' layout, so
that a generate() can tell whether its step is stored before it starts (`stored_positions`, which
compiled decode's "auto" reads). Off where GGML_KERNELS_PACKAGED_STEPS is 0.
Two things make one program serve torch 2.13, 2.14 and 2.15 alike: the cache's filled lengths
(`cumulative_length`, a 0-d tensor each step adds its tokens to) are inputs, not buffers
(`_length_slots`: AOTInductor in 2.13 and 2.14 writes a mutated 0-d constant back on the first
call only, so every later step wrote its keys to the same row), and the step takes its tensors as
one dict argument holding tensors only (`_step_inputs`, `_flat`: 2.13's export cannot match
dynamic shapes to keyword arguments, nor to inputs holding None).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from . import compat, stored_steps

compat.needs(
    ("transformers.modeling_outputs", "CausalLMOutputWithPast", None),
    # a prompt's forward sets has_previous_state of each linear-attention state (`_after_prompt`)
    ("transformers.cache_utils", "LinearAttentionLayer.update_conv_state", ("self", "conv_states")),
    # ... and makes a new cache's linear-attention states on their first update (`StateShapes`)
    ("transformers.cache_utils", "LinearAttentionLayer.lazy_initialization",
     ("self", "conv_states", "recurrent_states", "state_idx", "conv_kernel_size")),
    ("torch._inductor", "aoti_compile_and_package", ("exported_program",)),
    ("torch._inductor", "aoti_load_package", ("path",)),
)

LOGGER = logging.getLogger("ggml_kernels_integration")
ENV = "GGML_KERNELS_PACKAGED_STEPS"
PROMPTS_ENV = "GGML_KERNELS_PACKAGED_PROMPTS"
MIN_TORCH = (2, 13)
FORMAT = 2  # of what a package's name covers and what it holds: a change exports anew
SUFFIX = ".pt2"
# The longest prompt a package serves; longer ones run the eager forward. A package saves a fixed
# ~10-15 ms of Python and small torch ops, and its graph costs a little more per token than the eager
# forward on the Qwen3.5 shape. Intel Xeon (2 vCPUs, AVX-512 + AMX), torch 2.15, 2 threads, the same
# static cache, eager / packaged, alternating (2026-12-06): the 0.8B shape 1.28x / 1.18x / 1.07x /
# 1.01x at 4 / 16 / 64 / 128 tokens, 0.97x / 0.94-0.98x at 256 / 512; SmolLM2 1.19x at 128, 1.06x /
# 1.04x at 256 / 512.
MAX_PROMPT_TOKENS = 128


def enabled() -> bool:
    """torch has AOTInductor packages whose weights are given at load (>= `MIN_TORCH`) and they are
    not switched off."""
    if os.environ.get(ENV) == "0":
        return False
    return stored_steps.torch_at_least(MIN_TORCH) and hasattr(torch._inductor, "aoti_load_package")


def prompts_enabled() -> bool:
    """Whether prompts' forwards are packaged too (`enabled()`, and not switched off on their own)."""
    return enabled() and os.environ.get(PROMPTS_ENV) != "0"


def fingerprint(model, options: str) -> str:
    """The model, software and CPU part of a package's name (`stored_steps.key` without inputs, in
    one grad mode: the name's inputs part has the step's)."""
    with torch.inference_mode(False), torch.no_grad():
        return stored_steps.key(model, {}, f"packaged {FORMAT} {options}")


def any_stored() -> bool:
    """Whether the store holds any step package (before a model's `fingerprint` is worth reading)."""
    return next(stored_steps.folder().glob(f"*{SUFFIX}"), None) is not None


def _name(fingerprint_: str, batch: int, positions: int, inputs_key: str = "*") -> str:
    return f"{fingerprint_}-{batch}x{positions}-{inputs_key}{SUFFIX}"


def _prompt_name(fingerprint_: str, batch: int, positions: int, tokens: str, inputs_key: str) -> str:
    """A prompt package's file name; `tokens` the lengths it serves, "<first>-<last>" ("*" in a glob)."""
    return f"{fingerprint_}-prompt-{batch}x{positions}-t{tokens}-{inputs_key}{SUFFIX}"


def _prompt_tokens(name: str) -> tuple[int, int] | None:
    """The lengths a prompt package serves, from its file name."""
    match = re.search(r"-t(\d+)-(\d+)-[0-9a-f]+" + re.escape(SUFFIX) + "$", name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _layer_tensors(i: int, layer) -> dict[str, torch.Tensor]:
    """A cache layer's tensors by buffer name: its tensor attributes (keys, values, the filled length)
    and the tensors of its dict and list attributes (a linear-attention layer's states by index)."""
    found = {}
    for name, value in vars(layer).items():
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
        if isinstance(value, torch.Tensor):
            found[f"cache_{i}_{name}"] = value
        elif items is not None:
            found.update((f"cache_{i}_{name}_{k}", t) for k, t in items if isinstance(t, torch.Tensor))
    return found


def _cache_tensors(cache) -> dict[str, torch.Tensor]:
    """The cache's tensors by buffer name (`_layer_tensors` of every layer)."""
    return {name: t for i, layer in enumerate(cache.layers) for name, t in _layer_tensors(i, layer).items()}


def _length_slots(cache) -> list[tuple[object, str, str]]:
    """(layer, attribute, input name) of the cache's filled lengths: its layers' 0-d tensor attributes
    (a static layer's `cumulative_length`, which a step adds its tokens to). They are a step's inputs,
    not buffers: AOTInductor in torch 2.13 and 2.14 writes a mutated 0-d constant back on its first
    call only (later steps wrote their keys to the same row), a mutated input on every call."""
    return [(layer, name, f"cache_{i}_{name}") for i, layer in enumerate(cache.layers)
            for name, value in vars(layer).items() if isinstance(value, torch.Tensor) and value.dim() == 0]


def _cache_buffers(cache) -> dict[str, torch.Tensor]:
    """The cache's tensors a step takes as buffers: all but its filled lengths (`_length_slots`)."""
    lengths = {name for _, _, name in _length_slots(cache)}
    return {name: t for name, t in _cache_tensors(cache).items() if name not in lengths}


def _cache_lengths(cache) -> dict[str, torch.Tensor]:
    """The cache's filled lengths by input name (`_length_slots`)."""
    return {name: getattr(layer, attribute) for layer, attribute, name in _length_slots(cache)}


def _cache_marks(cache) -> tuple:
    """What tells another set of cache tensors cheaply: the ids of its first and last layers' tensors."""
    last = len(cache.layers) - 1
    return tuple(map(id, (*_layer_tensors(0, cache.layers[0]).values(), *_layer_tensors(last, cache.layers[last]).values())))


class _Step(torch.nn.Module):
    """A decode step as `torch.export` takes it: the model over `cache`, whose tensors are buffers but
    its filled lengths, with the step's plain arguments (`constants`) fixed; the tensor arguments and
    the cache's lengths are the inputs (`_step_inputs`)."""

    def __init__(self, model, cache, tensors: dict, constants: dict):
        super().__init__()
        self.model, self.cache, self.constants = model, cache, constants
        self.lengths, self.template = _length_slots(cache), _template(tensors)
        for name, value in _cache_buffers(cache).items():
            self.register_buffer(name, value, persistent=False)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = dict(inputs)
        for layer, attribute, name in self.lengths:  # the cache reads its lengths from the inputs
            setattr(layer, attribute, inputs.pop(name))
        return self.model(past_key_values=self.cache, **_nested(inputs, self.template), **self.constants).logits


def _flat(tensors: dict) -> dict[str, torch.Tensor]:
    """A forward's tensor arguments as a program's inputs, tensors only: a dict's items (the masks by
    layer type) by "<name>__<key>", its None items left out (`_template` keeps them). torch 2.13's
    export cannot match dynamic shapes to inputs holding None."""
    flat = {}
    for name, value in tensors.items():
        if isinstance(value, dict):
            flat.update((f"{name}__{key}", item) for key, item in value.items() if item is not None)
        else:
            flat[name] = value
    return flat


def _template(tensors: dict) -> dict:
    """What `_nested` rebuilds the arguments by: True for a tensor, a dict's keys each with whether its
    item is a tensor (False: None)."""
    return {name: {key: item is not None for key, item in value.items()} if isinstance(value, dict) else True
            for name, value in tensors.items()}


def _nested(flat: dict, template: dict) -> dict:
    """The forward's tensor arguments from a program's inputs (`_flat`) and their `_template`."""
    return {name: {key: flat[f"{name}__{key}"] if present else None for key, present in shape.items()}
            if isinstance(shape, dict) else flat[name] for name, shape in template.items()}


def _step_inputs(cache, tensors: dict) -> dict[str, torch.Tensor]:
    """What a step's program is called with, as its one argument (torch 2.13's export cannot match
    dynamic shapes to keyword arguments): the forward's tensor arguments (`_flat`) and the cache's
    lengths."""
    return {**_flat(tensors), **_cache_lengths(cache)}


def export_step(model, cache, tensors: dict, constants: dict, path: Path, inductor: dict | None) -> None:
    """Export the decode step of `model` over `cache` called with `tensors` and `constants` and compile
    it into the package `path` (written whole or not at all), without its weights, inductor's
    `inductor` options on top."""
    step = _Step(model, cache, tensors, constants)
    with _without_torchs_notes():
        program = torch.export.export(step, (_step_inputs(cache, tensors),), strict=True)
    package(program, path, inductor)


# what torch says while exporting and packaging a step that its user can do nothing about: dynamo's
# list of the forward's side effects (ours: the cache's lengths set from the inputs, `_Step.forward`;
# transformers' output collector) and a deprecation inside torch's own pytree copies (2.13)
_TORCHS_NOTES = ((UserWarning, "While compiling, we found certain side effects"),
                 (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"))


@contextlib.contextmanager
def _without_torchs_notes():
    """`_TORCHS_NOTES` held back; every other warning shown."""
    with warnings.catch_warnings():
        for category, message in _TORCHS_NOTES:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def _is_token_dim(t: torch.Tensor, dim: int, tokens: int) -> bool:
    """Whether dim `dim` of a prompt's input `t` is its length: of that size, and not a batch dim."""
    return t.shape[dim] == tokens and (dim > 0 or t.dim() == 1)


def _token_dims(value: torch.Tensor, tokens: int) -> dict | None:
    """`torch.export`'s dynamic_shapes for one input of a prompt's forward: Dim.AUTO on its length's
    dims, None for an input without one."""
    dims = {d: torch.export.Dim.AUTO for d in range(value.dim()) if _is_token_dim(value, d, tokens)}
    return dims or None


def export_prompt(model, cache, tensors: dict, constants: dict):
    """The forward of a prompt over `cache` (input_ids (batch, tokens) among `tensors`), exported with
    its length dynamic: the program serves the lengths `_token_range` reads from it."""
    tokens = tensors["input_ids"].shape[1]
    inputs = _step_inputs(cache, tensors)
    dims = ({name: _token_dims(value, tokens) for name, value in inputs.items()},)
    with _without_torchs_notes():
        return torch.export.export(_Step(model, cache, tensors, constants), (inputs,), dynamic_shapes=dims,
                                   strict=True)


def _token_range(program, positions: int) -> tuple[int, int]:
    """The prompt lengths an exported prompt's forward serves: the range its guards proved for the
    length of input_ids, below the cache's `positions` and up to `MAX_PROMPT_TOKENS`."""
    ids = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name.endswith("input_ids"))
    length = ids.meta["val"].shape[1]
    if isinstance(length, int):  # specialized: that length alone
        return length, length
    bounds = program.range_constraints[length.node.expr]
    upper = int(bounds.upper) if getattr(bounds.upper, "is_Integer", False) else positions - 1
    return int(bounds.lower), min(upper, positions - 1, MAX_PROMPT_TOKENS)


def package(program, path: Path, inductor: dict | None) -> None:
    """Compile an exported program into the package `path` (written whole or not at all), without its
    weights, inductor's `inductor` options on top."""
    configs = {"aot_inductor.package_constants_in_so": False, **(inductor or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        written = Path(scratch) / path.name
        with stored_steps.inductor_files(), _without_torchs_notes():
            torch._inductor.aoti_compile_and_package(program, package_path=str(written), inductor_configs=configs)
        os.replace(written, path)


class _Loaded:
    """A loaded package and what it was last given: the model's weights once, a generation's cache
    tensors whenever another cache comes (its lengths then kept for the calls)."""

    __slots__ = ("runner", "wanted", "cache", "marks", "lengths")

    def __init__(self, runner, weights: dict[str, torch.Tensor]):
        self.runner, self.cache, self.marks, self.lengths = runner, None, None, {}
        self.wanted = set(runner.get_constant_fqns())
        runner.load_constants({k: v for k, v in weights.items() if k in self.wanted}, check_full_update=False,
                              user_managed=True)

    def run(self, cache, tensors: dict) -> torch.Tensor:
        marks = _cache_marks(cache)
        if cache is not self.cache or marks != self.marks:
            buffers = {k: v for k, v in _cache_buffers(cache).items() if k in self.wanted}
            self.runner.load_constants(buffers, check_full_update=False, user_managed=True)
            self.cache, self.marks, self.lengths = cache, marks, _cache_lengths(cache)
        return self.runner({**_flat(tensors), **self.lengths})


_PLAIN = (bool, int, float, str, type(None))


def _split(kwargs: dict) -> tuple | None:
    """A forward's arguments as (cache, tensors, plain values) where a package can serve them: a cache
    with layers, tensors among them (input_ids (batch, tokens): one token a decode step, more a
    prompt), every other value plain, nothing asked beyond the logits; else None."""
    cache, ids = kwargs.get("past_key_values"), kwargs.get("input_ids")
    if not getattr(cache, "layers", None) or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
        return None
    tensors, plain = {}, {}
    for name, value in kwargs.items():
        if name == "past_key_values":
            continue
        if isinstance(value, torch.Tensor) or (isinstance(value, dict) and value and all(
                isinstance(item, (torch.Tensor, type(None))) for item in value.values())):  # masks by layer type
            tensors[name] = value
        elif isinstance(value, _PLAIN):
            plain[name] = value
        else:
            return None
    if plain.get("output_attentions") or plain.get("output_hidden_states") or plain.get("return_dict") is False:
        return None
    return cache, tensors, plain


def _ready_for_prompt(cache) -> bool:
    """Whether a package can run a new prompt's forward on `cache`: every layer holds its tensors
    (transformers makes a layer's tensors on its first update, and a package only writes into the
    tensors it is given; a generation's first prompt on a new cache runs eagerly) and no
    linear-attention layer holds a previous state (a prompt continuing one takes another path)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) is False or getattr(layer, "record_past", False):
            return False
        for flags in ("is_conv_states_initialized", "is_recurrent_states_initialized"):
            if not all(getattr(layer, flags, {}).values()):
                return False
        if any(getattr(layer, "has_previous_state", {}).values()):
            return False
    return True


class StateShapes:
    """The linear-attention states a model's prompt makes in a cache, kept from an eager prompt's
    forward so that a later generation's new cache gets them before its prompt: transformers makes
    a static cache anew for every generate() and its linear-attention states on their first update
    (their shapes come from the layer's own tensors), where a package needs them made beforehand.
    Made with the eager forward's shapes, strides and dtypes (ggml-gated-delta-net's states keep
    ggml's layout), by transformers' own `lazy_initialization`."""

    def __init__(self):
        self.by_batch: dict[int, list] = {}  # batch -> [(layer index, state index, conv, kernel, recurrent)]

    def keep(self, cache, batch: int) -> None:
        """Keep what `cache`'s layers hold after a prompt of `batch` rows (each state's first time)."""
        if batch in self.by_batch:
            return
        self.by_batch[batch] = [
            (i, k, _like(conv), layer.conv_kernel_size[k], _like(layer.recurrent_states.get(k)))
            for i, layer in enumerate(cache.layers) for k, conv in getattr(layer, "conv_states", {}).items()
            if conv is not None]

    def make(self, cache, batch: int) -> None:
        """Make the states kept for `batch` rows in `cache`'s layers that lack them."""
        for i, k, conv, kernel, recurrent in self.by_batch.get(batch, ()):
            layer = cache.layers[i]
            if not layer.is_conv_states_initialized[k]:
                layer.lazy_initialization(conv_states=_empty(conv), recurrent_states=_empty(recurrent), state_idx=k,
                                          conv_kernel_size=kernel)


def _like(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)


def _empty(like: tuple | None) -> torch.Tensor | None:
    return None if like is None else torch.empty_strided(like[0], like[1], dtype=like[2])


def _after_prompt(cache) -> None:
    """What a prompt's eager forward leaves in the cache beyond its tensors, which a package's run
    cannot: each linear-attention state marked as holding a previous state (so that the next step
    continues it)."""
    for layer in cache.layers:
        flags = getattr(layer, "has_previous_state", None)
        if isinstance(flags, dict):
            flags.update(dict.fromkeys(flags, True))


def _prompt_layout(tensors: dict, tokens: int) -> str | None:
    """A prompt's inputs without their length (dtypes, shapes with "T" for its dims): what its
    package is named and kept by; None where one is not contiguous (a package takes contiguous ones)."""
    def layout(value):
        if isinstance(value, dict):
            return {name: layout(item) for name, item in value.items()}
        if not isinstance(value, torch.Tensor):
            return None
        if not value.is_contiguous():
            raise ValueError("not contiguous")
        return [str(value.dtype), ["T" if _is_token_dim(value, d, tokens) else n for d, n in enumerate(value.shape)],
                value.is_inference()]

    try:
        return json.dumps({name: layout(value) for name, value in sorted(tensors.items())}, sort_keys=True)
    except ValueError:
        return None


def _output(step: _Loaded, split: tuple):
    """What the model's forward returns, from a package's run on a `_split` call."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    cache, tensors, _ = split
    return CausalLMOutputWithPast(logits=step.run(cache, tensors), past_key_values=cache)


def _load_package(path: Path):
    """`aoti_load_package` without inductor's probe of the CPU's vector instructions, which it makes
    only to warn where the package's differ: it builds and loads a probe per instruction set in a
    Python subprocess each (1.2-1.3 s of a process's first generate(), Intel Xeon, torch 2.13), and
    with `cpp.vec_isa_ok` still its bfloat16, VNNI and AMX probes (~0.3 s). Here inductor's pick is
    `decode_graph.vector_isa`, the same answer read from the CPU's flags (a package's name holds it
    too), for the load only: a module that took inductor's pick by name while it was replaced (such
    as inductor's codecache, imported by its first load) gets inductor's own back (`_unbind`).
    `cpp.vec_isa_ok` covers a torch that reads the pick another way, and what inductor keeps of such
    a probe is dropped after (a compile probes them anew)."""
    from unittest import mock

    from torch._inductor import config, cpu_vec_isa

    from . import decode_graph

    picked = _IsaName(decode_graph.vector_isa())
    original, probed = cpu_vec_isa.pick_vec_isa, cpu_vec_isa.valid_vec_isa_list.cache_info().currsize

    def pick():
        return picked

    try:
        with stored_steps.inductor_files(), config.patch({"cpp.vec_isa_ok": True}), \
                mock.patch.object(cpu_vec_isa, "pick_vec_isa", pick):
            return torch._inductor.aoti_load_package(str(path))
    finally:
        _unbind(pick, original)
        if not probed:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()


def _unbind(stand_in, original) -> None:
    """Every loaded module that took `stand_in` by name as `pick_vec_isa` gets `original` back."""
    for module in list(sys.modules.values()):
        held = getattr(module, "__dict__", {})
        if held.get("pick_vec_isa") is stand_in:
            module.pick_vec_isa = original


class _IsaName:
    """What the package loader reads of inductor's picked instruction set: its name."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return self.name


class PackagedSteps:
    """Stands in for `fallback` (the stored dynamo step or `torch.compile` of the model's forward):
    each step's package, by shape and arguments' layout, loaded or exported and stored; `fallback` for
    calls no package serves (`_split`, a failed export). `may_export()` says whether compiling is
    asked for now; where it is not (compiled decode's "auto" on a stored package), a step without a
    package runs `fallback_without_compile` (the eager forward) instead of exporting or compiling.
    `shape_of` gives a call's (batch, cache length), as compiled decode records its steps."""

    def __init__(self, model, fallback, fallback_without_compile, may_export, shape_of, inductor: dict | None):
        self.model, self.fallback, self.eager = model, fallback, fallback_without_compile
        self.may_export, self.shape_of, self.inductor = may_export, shape_of, inductor
        self.options = stored_steps.options_id(inductor)
        self.steps: dict[tuple, _Loaded | None] = {}  # (shape, layout) -> the package, None: fallback
        self.loaded: dict[tuple, float] = {}  # shape (batch, positions) -> seconds its package took to load
        self.exported: dict[tuple, float] = {}  # shape -> seconds its export and compile took
        self.absent: set[tuple] = set()  # steps found without a package while no export was allowed
        # prompts: (shape, layout, constants) -> [(first, last, package)] for the lengths each serves
        self.prompts: dict[tuple, list[tuple[int, int, _Loaded]]] = {}
        self.prompt_loaded: dict[tuple, float] = {}  # (batch, positions, first, last) -> seconds of its load
        self.prompt_exported: dict[tuple, float] = {}  # the same -> seconds of its export and compile
        self.prompt_absent: set[tuple] = set()  # (key of `prompts`, tokens) not stored, no export allowed
        self.prompt_failed: set[tuple] = set()  # the same whose export failed: eager in this process
        self.states = StateShapes()
        self._fingerprint = None
        self._weights = None

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            with stored_steps.inductor_files():  # `key` reads inductor's options, whose probe compiles C++
                self._fingerprint = fingerprint(self.model, self.options)
        return self._fingerprint

    def __call__(self, *args, **kwargs):
        split = None if args else _split(kwargs)
        prompt = split is not None and split[1]["input_ids"].shape[1] > 1
        if prompt and prompts_enabled():
            cache, batch = split[0], split[1]["input_ids"].shape[0]
            self.states.make(cache, batch)
            step = self._prompt_package_for(self.shape_of(kwargs), *split)
            if step is None:
                out = self.eager(*args, **kwargs)
                self.states.keep(cache, batch)
                return out
            out = _output(step, split)
            _after_prompt(cache)
            return out
        step = None if split is None or prompt else self._package_for(self.shape_of(kwargs), *split)
        if step is None:  # no package serves it: the fallback's compiled step, unless no compile is asked for
            return (self.fallback if self.may_export() else self.eager)(*args, **kwargs)
        return _output(step, split)

    def _package_for(self, shape: tuple, cache, tensors: dict, plain: dict) -> _Loaded | None:
        """The package of this step's shape and arguments' layout, loaded or exported the first time
        (`_step`); None where there is none (tried again once exports are allowed)."""
        which = (shape, stored_steps._inputs_layout(tensors), tuple(sorted(plain.items())))
        if which in self.steps:
            return self.steps[which]
        if which in self.absent and not self.may_export():
            return None
        step = self._step(shape, cache, tensors, plain)
        if step is None and not self.may_export():  # not stored, and no compile asked for
            self.absent.add(which)
        else:
            self.steps[which] = step
        return step

    def _path(self, shape: tuple, cache, tensors: dict, plain: dict) -> Path:
        inputs = stored_steps.key(self.model, {**tensors, **plain, "past_key_values": cache},
                                  f"packaged {FORMAT} {self.options}")
        return stored_steps.folder() / _name(self.fingerprint(), shape[0], shape[1], inputs[:16])

    def _step(self, shape: tuple, cache, tensors: dict, plain: dict) -> _Loaded | None:
        """The step's package: loaded where stored, else (or where it does not load) exported where
        `may_export`; None where there is none."""
        with stored_steps.inductor_files():
            path = self._path(shape, cache, tensors, plain)
        if path.is_file():
            step = self._load(path, cache, self.loaded, shape)
            if step is not None or not self.may_export():
                return step
        elif not self.may_export():
            return None
        start = time.perf_counter()
        try:
            export_step(self.model, cache, tensors, plain, path, self.inductor)
        except Exception as error:  # a graph break, an op export cannot take: the fallback's step
            LOGGER.warning("ggml-kernels: exporting %s's decode step failed (%s: %s); compiling it instead",
                           type(self.model).__name__, type(error).__name__, " ".join(str(error).split())[:300])
            return None
        self.exported[shape] = time.perf_counter() - start
        return self._load(path, cache, self.loaded, shape)

    def _prompt_package_for(self, shape: tuple, cache, tensors: dict, plain: dict) -> _Loaded | None:
        """The package serving this prompt's length (`_prompt_step`); None where there is none: a cache
        not ready (`_ready_for_prompt`), inputs it cannot take, a prompt as long as the cache or longer
        than `MAX_PROMPT_TOKENS`, not stored while no export is allowed, or an export that failed (each
        tried once)."""
        tokens = tensors["input_ids"].shape[1]
        if not shape[1] or tokens >= shape[1] or tokens > MAX_PROMPT_TOKENS or not _ready_for_prompt(cache):
            return None
        layout = _prompt_layout(tensors, tokens)
        if layout is None:
            return None
        which = (shape, layout, tuple(sorted(plain.items())))
        served = self.prompts.setdefault(which, [])
        step = next((step for first, last, step in served if first <= tokens <= last), None)
        if step is not None or (which, tokens) in self.prompt_failed:
            return step
        if (which, tokens) in self.prompt_absent and not self.may_export():
            return None
        found = self._prompt_step(shape, cache, tensors, plain, layout)
        if found is None:
            (self.prompt_failed if self.may_export() else self.prompt_absent).add((which, tokens))
            return None
        served.append(found)
        return found[2]

    def _prompt_step(self, shape: tuple, cache, tensors: dict, plain: dict, layout: str) -> tuple | None:
        """(first, last, package) for a prompt of this length: a stored package whose lengths hold it,
        loaded; else, where `may_export`, one exported (`export_prompt`) and stored; None otherwise."""
        (batch, positions), tokens = shape, tensors["input_ids"].shape[1]
        with stored_steps.inductor_files():
            key = stored_steps.key(self.model, {"prompt": layout, **plain, "past_key_values": cache},
                                   f"packaged {FORMAT} {self.options}")[:16]
            fingerprint_ = self.fingerprint()
        for path in stored_steps.folder().glob(_prompt_name(fingerprint_, batch, positions, "*", key)):
            span = _prompt_tokens(path.name)
            if span and span[0] <= tokens <= span[1]:
                step = self._load(path, cache, self.prompt_loaded, (batch, positions, *span))
                if step is not None:
                    return (*span, step)
        if not self.may_export():
            return None
        start = time.perf_counter()
        try:
            program = export_prompt(self.model, cache, tensors, plain)
            span = _token_range(program, positions)
            path = stored_steps.folder() / _prompt_name(fingerprint_, batch, positions, f"{span[0]}-{span[1]}", key)
            package(program, path, self.inductor)
        except Exception as error:  # a graph break, an op export cannot take: the eager forward
            LOGGER.warning("ggml-kernels: exporting %s's forward of a %d-token prompt failed (%s: %s); it runs eagerly",
                           type(self.model).__name__, tokens, type(error).__name__, " ".join(str(error).split())[:300])
            return None
        self.prompt_exported[(batch, positions, *span)] = time.perf_counter() - start
        LOGGER.info("ggml-kernels: packaged %s's forward of %d-%d-token prompts in %.1f s", type(self.model).__name__,
                    *span, self.prompt_exported[(batch, positions, *span)])
        step = self._load(path, cache, self.prompt_loaded, (batch, positions, *span))
        return None if step is None else (*span, step)

    def _load(self, path: Path, cache, times: dict, name: tuple) -> _Loaded | None:
        """The package at `path`, given the model's weights, its load's seconds kept in `times[name]`;
        None (and a warning) where it does not load."""
        start = time.perf_counter()
        try:
            runner = _load_package(path)
            missing = set(runner.get_constant_fqns()) - self._model_constants().keys() - _cache_tensors(cache).keys()
            if missing:
                raise ValueError(f"the package wants tensors the model and its cache lack: {sorted(missing)[:5]}")
            step = _Loaded(runner, self._model_constants())
        except Exception as error:  # damaged, or from another setup
            LOGGER.warning("ggml-kernels: could not load the step package %s (%s: %s)", path,
                           type(error).__name__, error)
            return None
        times[name] = time.perf_counter() - start
        return step

    def stored_positions(self, batch: int) -> list[int]:
        """The cache lengths of the packages kept for this model's steps of `batch` rows, ascending."""
        pattern = re.compile(re.escape(self.fingerprint()) + rf"-{batch}x(\d+)-")
        found = (pattern.match(path.name) for path in stored_steps.folder().glob(_name(self.fingerprint(), batch, "*")))
        return sorted({int(match.group(1)) for match in found if match})

    def _model_constants(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            self._weights = {f"model.{name}": t for name, t in
                             [*self.model.named_parameters(), *self.model.named_buffers()]}
        return self._weights

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

Packages live in the stored steps' folder (`stored_steps.folder()`), named by the model's fingerprint
(`fingerprint`: `stored_steps.key` of the model without inputs: config, parameter layout, modules'
plain attributes, software, CPU, threads), the step's shape and the hash of its inputs' layout, so
that a generate() can tell whether its step is stored before it starts (`stored_positions`, which
compiled decode's "auto" reads). Off where torch is older than `MIN_TORCH` or
GGML_KERNELS_PACKAGED_STEPS is 0: under torch 2.13 a package's steps wrote the static cache's filled
length (`cumulative_length`, a 0-d buffer the step adds one to) on their first call only, so every
later step wrote its keys to the same row and the tokens parted from the eager ones after a few
steps (tiny llama, SmolLM2).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from . import compat, stored_steps

compat.needs(
    ("transformers.modeling_outputs", "CausalLMOutputWithPast", None),
    ("torch._inductor", "aoti_compile_and_package", ("exported_program",)),
    ("torch._inductor", "aoti_load_package", ("path",)),
)

LOGGER = logging.getLogger("ggml_kernels_integration")
ENV = "GGML_KERNELS_PACKAGED_STEPS"
MIN_TORCH = (2, 15)
FORMAT = 1  # of what a package's name covers and what it holds: a change exports anew
SUFFIX = ".pt2"


def enabled() -> bool:
    """torch has AOTInductor packages whose weights are given at load (>= `MIN_TORCH`) and they are
    not switched off."""
    if os.environ.get(ENV) == "0":
        return False
    return stored_steps.torch_at_least(MIN_TORCH) and hasattr(torch._inductor, "aoti_load_package")


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


def _cache_marks(cache) -> tuple:
    """What tells another set of cache tensors cheaply: the ids of its first and last layers' tensors."""
    last = len(cache.layers) - 1
    return tuple(map(id, (*_layer_tensors(0, cache.layers[0]).values(), *_layer_tensors(last, cache.layers[last]).values())))


class _Step(torch.nn.Module):
    """A decode step as `torch.export` takes it: the model over `cache`, whose tensors are buffers,
    with the step's plain arguments (`constants`) fixed; the tensor arguments are the inputs."""

    def __init__(self, model, cache, constants: dict):
        super().__init__()
        self.model, self.cache, self.constants = model, cache, constants
        for name, value in _cache_tensors(cache).items():
            self.register_buffer(name, value, persistent=False)

    def forward(self, **tensors: torch.Tensor) -> torch.Tensor:
        return self.model(past_key_values=self.cache, **tensors, **self.constants).logits


def export_step(model, cache, tensors: dict, constants: dict, path: Path, inductor: dict | None) -> None:
    """Export the decode step of `model` over `cache` called with `tensors` and `constants` and compile
    it into the package `path` (written whole or not at all), without its weights, inductor's
    `inductor` options on top."""
    program = torch.export.export(_Step(model, cache, constants), (), dict(tensors), strict=True)
    configs = {"aot_inductor.package_constants_in_so": False, **(inductor or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        written = Path(scratch) / path.name
        with stored_steps.inductor_files():
            torch._inductor.aoti_compile_and_package(program, package_path=str(written), inductor_configs=configs)
        os.replace(written, path)


class _Loaded:
    """A loaded package and what it was last given: the model's weights once, a generation's cache
    tensors whenever another cache comes."""

    __slots__ = ("runner", "cache", "marks")

    def __init__(self, runner, weights: dict[str, torch.Tensor]):
        self.runner, self.cache, self.marks = runner, None, None
        wanted = set(runner.get_constant_fqns())
        runner.load_constants({k: v for k, v in weights.items() if k in wanted}, check_full_update=False,
                              user_managed=True)

    def run(self, cache, tensors: dict) -> torch.Tensor:
        marks = _cache_marks(cache)
        if cache is not self.cache or marks != self.marks:
            self.runner.load_constants(_cache_tensors(cache), check_full_update=False, user_managed=True)
            self.cache, self.marks = cache, marks
        return self.runner(**tensors)


_PLAIN = (bool, int, float, str, type(None))


def _split(kwargs: dict) -> tuple | None:
    """A decode step's arguments as (cache, tensors, plain values) where a package can serve them: a
    cache with layers, tensors among them (input_ids (batch, 1)), every other value plain, nothing
    asked beyond the logits; else None."""
    cache, ids = kwargs.get("past_key_values"), kwargs.get("input_ids")
    if not getattr(cache, "layers", None) or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
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
        self._fingerprint = None
        self._weights = None

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            with stored_steps.inductor_files():  # `key` reads inductor's options, whose probe compiles C++
                self._fingerprint = fingerprint(self.model, self.options)
        return self._fingerprint

    def __call__(self, *args, **kwargs):
        split = None if args else _split(kwargs)
        step = None if split is None else self._package_for(self.shape_of(kwargs), *split)
        if step is None:  # no package serves it: the fallback's compiled step, unless no compile is asked for
            return (self.fallback if self.may_export() else self.eager)(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        cache, tensors, _ = split
        return CausalLMOutputWithPast(logits=step.run(cache, tensors), past_key_values=cache)

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
            step = self._load(shape, path, cache)
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
        return self._load(shape, path, cache)

    def _load(self, shape: tuple, path: Path, cache) -> _Loaded | None:
        """The package at `path`, given the model's weights; None (and a warning) where it does not load."""
        start = time.perf_counter()
        try:
            with stored_steps.inductor_files():
                runner = torch._inductor.aoti_load_package(str(path))
            missing = set(runner.get_constant_fqns()) - self._model_constants().keys() - _cache_tensors(cache).keys()
            if missing:
                raise ValueError(f"the package wants tensors the model and its cache lack: {sorted(missing)[:5]}")
            step = _Loaded(runner, self._model_constants())
        except Exception as error:  # damaged, or from another setup
            LOGGER.warning("ggml-kernels: could not load the decode step package %s (%s: %s)", path,
                           type(error).__name__, error)
            return None
        self.loaded[shape] = time.perf_counter() - start
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

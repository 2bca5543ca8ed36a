"""Compiled decode steps kept on disk, so that a later process loads a step instead of compiling it.

A compiled decode step costs 7-18 s per model and shape, paid again in every new process (dynamo
traces the model anew; inductor's on-disk cache only spares the code generation). torch 2.15's
ahead-of-time compile (`torch._dynamo.aot_compile`) captures the whole step, guards, bytecode and
inductor's code, with the model's weights as inputs, and serializes it: a later process with the
same model, shape and software loads it in 1.3-1.4 s (SmolLM2, the 0.8B shape; AMD EPYC zen4, 2
cores) and decodes the same tokens as the process that stored it.

`StoredSteps` stands in for the `torch.compile` of the model's forward in `compiled_decode`: for each
step shape it loads the stored step (`key`: the model's config, parameter layout, modules' plain
attributes and hooks, the step's input layout, grad mode, torch / transformers / Python versions,
the op libraries of our packages, the CPU), or compiles one ahead of time and stores it; anything
that goes wrong (a file that does not load, a compile that fails, a guard that fails) runs the
`torch.compile` instead. Off where torch is older than `MIN_TORCH` (2.13's and 2.14's loaders fail on
the guards they saved: a meta tensor of dtype `_Missing`) or GGML_KERNELS_COMPILED_STEPS is 0; that
variable names the folder, by default `<ggml-kernels cache>/compiled-steps`. inductor keeps the
steps' generated code and C++ libraries in its `inductor` folder (`inductor_files`), not in its own
cache under /tmp, which a reboot cleans: loading a step whose libraries are gone compiles them anew
(10.1 s instead of 1.3 s, SmolLM2).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

LOGGER = logging.getLogger("ggml_kernels_integration")
ENV = "GGML_KERNELS_COMPILED_STEPS"
MIN_TORCH = (2, 15)
FORMAT = 1  # of what `key` covers and how a step is stored: a change stores anew
# the op libraries a step's graph calls: their names carry each build's hash (`_ggml_norm_cpu_1afa67c`)
_OUR_OP_LIBRARIES = re.compile(r"^_(ggml_|topk)")
# dynamo's names for the modules a step's bytecode reads: `___module_<name>_<id>_c<n>` (id: this process's)
_MODULE_GLOBAL = re.compile(r"^___module_(.+)_\d+_c\d+$")


def torch_at_least(version: tuple[int, int]) -> bool:
    """torch's (major, minor) is `version` or later."""
    return tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2]) >= version


def enabled() -> bool:
    """torch has the ahead-of-time compile that loads back (>= `MIN_TORCH`) and the store is not off."""
    if os.environ.get(ENV) == "0":
        return False
    return torch_at_least(MIN_TORCH) and hasattr(torch._dynamo, "aot_compile")


def folder() -> Path:
    configured = os.environ.get(ENV)
    if configured:
        return Path(configured)
    cache = os.environ.get("GGML_KERNELS_CACHE") or Path.home() / ".cache" / "ggml-kernels"
    return Path(cache) / "compiled-steps"


def _layout(value) -> object:
    """What a step's guards may check of one input: tensors by dtype, shape and strides, caches by
    their layers' tensors, plain values as they are."""
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), list(value.shape), list(value.stride()), value.is_inference()]
    layers = getattr(value, "layers", None)
    if layers is not None:
        return [type(value).__name__] + [
            [type(layer).__name__] + [_layout(t) for t in vars(layer).values() if isinstance(t, torch.Tensor)]
            for layer in layers
        ]
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return type(value).__name__


_PLAIN = (bool, int, float, str, type(None), tuple)


def _modules(model) -> list:
    """Each module's plain attributes (a head count, a scaling, `training`) and hooks: what the step
    reads as constants, so what tells two models of one config apart (`compiled_decode.keep_guard`
    leaves dynamo no guard on them)."""
    return [
        [name, type(m).__qualname__, len(m._forward_hooks), len(m._forward_pre_hooks),
         sorted((k, repr(v)) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PLAIN))]
        for name, m in model.named_modules()
    ]


def key(model, kwargs: dict, options: str) -> str:
    """A name for the step of `model` called with `kwargs`: equal wherever a stored step may serve."""
    import transformers

    described = {
        "format": FORMAT,
        "model": type(model).__qualname__,
        "config": model.config.to_json_string(use_diff=False),
        "parameters": [[name, str(p.dtype), list(p.shape), list(p.stride())] for name, p in model.named_parameters()],
        "buffers": [[name, str(b.dtype), list(b.shape)] for name, b in model.named_buffers()],
        "modules": _modules(model),
        "inputs": {name: _layout(value) for name, value in sorted(kwargs.items())},
        "grad": [torch.is_grad_enabled(), torch.is_inference_mode_enabled()],
        "software": [torch.__version__, transformers.__version__, sys.version, options],
        "ops": sorted(name for name in dir(torch.ops) if _OUR_OP_LIBRARIES.match(name)),
        # inductor writes the thread count into its C++ (`#pragma omp parallel num_threads(n)`)
        "cpu": [platform.machine(), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


# the generation (`one_generation`) the running decode steps belong to, None outside one
_generation = contextvars.ContextVar("ggml_kernels_generation", default=None)


@contextlib.contextmanager
def one_generation():
    """The decode steps of one generation (a `generate()` call, a benchmark's decode loop). A stored
    step's guards (its weights' and inputs' dtypes, shapes and strides: 0.5-0.8 ms of a ~9 ms SmolLM2
    step) are checked on its first step of the generation and again only where the inputs' layout
    (`_inputs_layout`) differs from the step checked last: nothing else they cover changes between
    two decode steps of one generation (the model is not edited while it generates)."""
    token = _generation.set(object())
    try:
        yield
    finally:
        _generation.reset(token)


def _inputs_layout(value) -> object:
    """A step's inputs (`kwargs`), cheaply: tensors by dtype, shape, strides and grad, plain values as
    they are, dicts, lists and tuples by their items (Qwen3.5's masks come as a dict per layer type),
    other objects (the cache) by identity. `_layout` describes them for `key`, across processes (a
    cache by its layers' tensors); this compares two steps of one process, every step."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.shape, value.stride(), value.requires_grad
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, dict):
        return tuple((name, _inputs_layout(item)) for name, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_inputs_layout(item) for item in value)
    return id(value)


def _model_globals(model) -> dict:
    return dict(sys.modules[type(model).forward.__module__].__dict__)


def compile_step(model, kwargs: dict, guard_filter, inductor: dict | None):
    """The step of `model.forward(**kwargs)` compiled ahead of time (dynamo's full graph, inductor with
    `inductor`'s options), its guards filtered by `guard_filter` and to those that can be stored."""
    from torch._dynamo.aot_compile import ModelInput, aot_compile_module
    from torch._dynamo.guards import CheckFunctionManager
    from torch._dynamo.hooks import Hooks

    unstorable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

    def storable(entries):
        keep = guard_filter(entries) if guard_filter is not None else [True] * len(entries)
        return [k and not (e.is_global or e.guard_type in unstorable) for k, e in zip(keep, entries, strict=True)]

    grad = torch.inference_mode() if torch.is_inference_mode_enabled() else torch.set_grad_enabled(torch.is_grad_enabled())
    backend = torch._TorchCompileInductorWrapper("default", inductor, False)
    compiled = aot_compile_module(model, [ModelInput(args=(), kwargs=kwargs, contexts=[grad])],
                                  hooks=Hooks(guard_filter_fn=storable), backend=backend)
    return compiled.compiled_results[0]


def save(step, path: Path) -> None:
    """Write `step` (an `AOTCompiledFunction`) to `path` whole or not at all."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    data = AOTCompiledFunction.serialize(step).serialized_data
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
        f.write(data)
    os.replace(f.name, path)


def load(model, path: Path):
    """The stored step at `path` for `model`, its bytecode's globals the model module's (and the
    modules dynamo names by this process's ids, which the file asks for by the storing one's)."""
    from torch._dynamo import convert_frame
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext, compile_context

    data = path.read_bytes()
    f_globals = _model_globals(model)
    for _ in range(8):
        try:
            with compile_context(CompileContext(convert_frame.get_compile_id({}))), get_metrics_context():
                return AOTCompiledFunction.deserialize(data, f_globals=f_globals)
        except RuntimeError as error:
            names = re.findall(r"'(___[^']+)'", str(error))
            modules = [_MODULE_GLOBAL.match(name) for name in names]
            if not names or not all(modules):
                raise
            for name, match in zip(names, modules, strict=True):
                f_globals[name] = importlib.import_module(match.group(1).replace("_dot_", "."))
    raise RuntimeError(f"{path}: the stored step kept asking for globals")


def inductor_files():
    """A context in which inductor keeps its files (generated code, its C++ kernels' libraries) in
    the store's `inductor` folder: a stored step names those libraries by hash and loads them from
    inductor's cache, which by default lies in /tmp, cleaned at a reboot (the module docstring says
    what that costs). inductor's own cache where torch has no `temporary_cache_dir` (a private
    helper of torch 2.15)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError:
        return contextlib.nullcontext()
    return temporary_cache_dir(str(folder() / "inductor"))


def options_id(inductor: dict | None) -> str:
    """inductor's options as text for `key` (a custom pass by its `uuid`)."""
    return json.dumps({name: value.uuid() if hasattr(value, "uuid") else repr(value)
                       for name, value in sorted((inductor or {}).items())})


class StoredSteps:
    """Stands in for `fallback` (the `torch.compile` of the model's forward): each step shape's step
    loaded from the store or compiled ahead of time and stored; `fallback` where that fails. `shape_of`
    gives a call's shape cheaply (the store's `key` reads the whole model: once per shape)."""

    def __init__(self, model, fallback, shape_of, guard_filter, inductor: dict | None):
        self.model, self.fallback, self.shape_of = model, fallback, shape_of
        self.guard_filter, self.inductor = guard_filter, inductor
        self.steps: dict[tuple, object] = {}  # shape -> AOTCompiledFunction, or None: the fallback
        self.loaded: dict[tuple, float] = {}  # shape -> seconds its stored step took to load
        self.checked = None  # (generation, shape, inputs' layout) of the last step whose guards passed
        self.guard_checks = 0

    def __call__(self, *args, **kwargs):
        if args:
            return self.fallback(*args, **kwargs)
        shape = (self.shape_of(kwargs), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if shape not in self.steps:
            self.steps[shape] = self._step(shape, kwargs)
        step = self.steps[shape]
        if step is None or not self._guards_pass(step, shape, kwargs):
            return self.fallback(**kwargs)
        return step(self.model, **kwargs)

    def _guards_pass(self, step, shape: tuple, kwargs: dict) -> bool:
        """`step`'s guards on this call, or once per generation and inputs' layout (`one_generation`)."""
        generation = _generation.get()
        seen = None if generation is None else (generation, shape, _inputs_layout(kwargs))
        if seen is not None and seen == self.checked:
            return True
        self.guard_checks += 1
        if not step.guard_check(self.model, **kwargs):
            return False
        self.checked = seen
        return True

    def _step(self, shape: tuple, kwargs: dict):
        with inductor_files():  # the options' vector-ISA probe (`decode_graph.vector_isa`) compiles C++ too
            path = folder() / f"{key(self.model, kwargs, options_id(self.inductor))}.step"
        if path.is_file():
            start = time.perf_counter()
            try:
                with inductor_files():
                    step = load(self.model, path)
            except Exception as error:  # a file from another setup, damaged, or unreadable: compile anew
                LOGGER.warning("ggml-kernels: could not load the stored decode step %s (%s: %s); compiling it",
                               path, type(error).__name__, error)
            else:
                self.loaded[shape] = time.perf_counter() - start
                step.disable_guard_check()  # `_guards_pass` checks them
                return step
        try:
            with inductor_files():
                step = compile_step(self.model, kwargs, self.guard_filter, self.inductor)
        except Exception as error:
            LOGGER.warning("ggml-kernels: compiling the decode step ahead of time failed (%s: %s); "
                           "torch.compile instead", type(error).__name__, error)
            return None
        try:
            save(step, path)
        except Exception as error:
            LOGGER.warning("ggml-kernels: could not store the decode step in %s (%s: %s)", path,
                           type(error).__name__, error)
        step.disable_guard_check()
        return step

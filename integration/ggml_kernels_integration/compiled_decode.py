"""`generate()`'s decode steps as one compiled graph over a static cache, on the CPU.

What a decode step costs beyond the kernels is Python: transformers' module calls, the cache's
bookkeeping, our glue. transformers removes it on GPUs by compiling the model's forward
(`torch.compile`, `generation_config.compile_config`) over a `StaticCache`, whose buffers keep one
shape for the whole generation; on the CPU it never does so unless asked. Every op of our packages is
a `torch.library` custom op with a fake implementation, so dynamo traces a whole step in one graph
(no graph break on SmolLM2, Qwen3.5 dense or MoE: `torch._dynamo.explain`) and inductor fuses the
torch code between our ops.

With `enable(compile_decode=True)`, `generate()` of a model loaded packed, on the CPU, where the
caller chose no cache, cache implementation, compile config or assistant of their own, runs with
`cache_implementation="static"` and `COMPILE_CONFIG` (transformers still runs the prefill eagerly).
The default, "auto", does so only where the compile pays for itself (`repays_a_compile`): a
generate() asking for `AUTO_MIN_NEW_TOKENS` new tokens or more, and every generate() of a model that
has compiled a step already; and where the step costs no compile (`stored_fit`): a generate() whose
step is stored as a package (`packaged_steps`), which then takes a stored package's
cache length and compiles nothing.
The graph is compiled once per model and shape (batch size, cache length), each model's graphs its
own (`decode_step`: not shared through dynamo's per-function cache), and a full `enable()` after
`disable()` compiles anew. dynamo's guards on the model's module attributes are left out
(`keep_guard`): checked before every step, they cost 0.6-1.4 ms (4-8 % of a SmolLM2 step); its
weights' tensor guards stay (a stored step checks its guards once per generate():
`stored_steps.one_generation`). transformers sizes a static cache for the longest generation asked
so far, so each longer call (a chat's next turn) would compile again; the cache length is rounded up
to a power of two of at least `MIN_CACHE_POSITIONS` (`cache_positions`), so a model compiles once
per doubling. The seconds of each compile are kept per model, logged, and shown by `summary(model)`. A
compile that fails (dynamo or inductor raises before the graph runs, so nothing was written into the
cache) falls back to the eager forward for that step and the model's later generations, with one
warning; so does a model whose step needs a graph break (`fullgraph`).
With prompts packaged too (`packaged_steps`), such a generate() asks transformers
for its prompt in one prefill chunk (`prompt_in_one_chunk`: `prefill_chunk_size`, whose chunks go
through the compiled call), and the prompt's forward runs its package (stored, or exported where
compiling is allowed) or eagerly.
Inside a compiled step `projection_groups`' shared calls step aside (`torch.compiler.is_compiling()`:
they keep outputs between calls) and `decode_graph` groups the same products on the graph, which
changes no bit; `kv_cache` is not involved (a static cache).
A static cache needed one fix to be exact, in ggml-attn's `flash_attn_forward`: a prefill into it
comes without a mask, which transformers means as SDPA's top-left causal (the cache's empty
positions unseen); ggml-attn read it bottom-right.

Numerics: inductor fuses the float32 torch code between our ops and rounds its own way (vectorized
exp, sin, cos; its own reduction order): bit-identical on the tiny test models, while on the real
ones the 8-bit activation rounding turns last-bit differences into whole steps. Against llama.cpp
(teacher-forced on its greedy tokens, 47 decode steps) compiled steps are as close as eager ones:
0.8B-shaped Q4_K_M mean KL 1.18e-3 against 1.20e-3 eager (top-1 0.979 / 0.957), SmolLM2 2.72e-3
against 2.80e-3 (top-1 1.0 both), compiled and eager 0.9e-3 / 1.3e-3 apart. Making inductor leave every
transcendental op to ATen (its `fallback_by_default`) did not make the steps bit-identical: its
decompositions (SiLU into exp and a division, rope's cos before the concatenation) call other ATen
kernels than the eager model does.

Why "auto" and not always (measurements: integration/README.md, "Compiled decode steps"): a compile
costs 7-8 s per model and shape with inductor's on-disk cache warm (dynamo's tracing is most of it,
paid in every new process), 17-18 s for a graph inductor has not seen (34-94 s on busier days), and
a compiled step saves 2.8-3.9 ms (SmolLM2, the 0.8B shape), so it repays itself after 1,800-6,500
tokens, not in a chat turn's few hundred. Lighter backends gain nothing: `backend="eager"`
(dynamo only) 1.05x, `"aot_eager"` 0.77x (its functional graph copies the static cache around each write).
Each step is exported and compiled by AOTInductor into a package and stored
(`packaged_steps`: 28-34 s once on SmolLM2 and the 0.8B shape): a later process loads it in ~10 ms
and runs it without dynamo or guards (SmolLM2 generate() 1.36-1.41x eager), and "auto" decodes every
generate() whose step is stored that way (`store.store_steps` stores a model's steps and prompt
packages up front). Steps that cannot be exported are compiled ahead of time by
dynamo and stored (`stored_steps`, torch 2.15 on: loaded in ~1.3-1.4 s, which "auto" does not count on); the
`torch.compile` above is the last resort.
"""

from __future__ import annotations

import contextvars
import logging
import time
import warnings
import weakref

import torch

from . import compat, decode_graph, packaged_steps, stored_steps

# generate()'s static cache and compile config, its compiled forward
compat.needs(
    ("transformers", "GenerationMixin.generate", ("self",)),
    ("transformers", "PreTrainedModel.get_compiled_call", ("self", "compile_config")),
    ("transformers", "CompileConfig", None),
    ("transformers", "StaticCache", None),
    ("transformers", "GenerationMixin._prepare_static_cache",
     ("self", "cache_implementation", "batch_size", "max_cache_len")),
)


LOGGER = logging.getLogger("ggml_kernels_integration")
DEFAULT = "auto"  # compiled where the generate() is long enough to repay the compile (module docstring)
# "auto": a generate() compiles only if it asks for at least this many new tokens (over its batch), or
# the model has compiled a step already; a compile costs 7-18 s and saves 2.8-3.9 ms a token (module docstring)
AUTO_MIN_NEW_TOKENS = 4096
# transformers' CompileConfig fields: one graph per shape (a decode step's shapes never change with a
# static cache) and per step (fullgraph: no frame compiled apart, see `keep_guard`), inductor's
# default mode ("reduce-overhead" means CUDA graphs, which a CPU has not)
COMPILE_CONFIG = {"fullgraph": True, "dynamic": False, "backend": "inductor", "mode": "default"}
RECORD_ATTR = "_ggml_kernels_compiled_decode"
OURS_ATTR = "_ggml_kernels_decode"  # marks the CompileConfig of `compile_config()`
# the shortest static cache a compiled generate() gets (positions; longer ones are powers of two)
MIN_CACHE_POSITIONS = 256
# mode: enable()'s compile_decode; installs: full enable()s so far (a step compiled under others is not
# reused); quant: the ggml-quantization kernel of the enable() in force (`decode_graph`)
_state = {"mode": DEFAULT, "installs": 0, "quant": None}
# in a generate() that `applies`: the cache lengths it may take (`cache_positions`), () for any
_sizing = contextvars.ContextVar("ggml_kernels_compiled_generate", default=None)
# whether a step shape with no stored package may be compiled now (False: a generate() that "auto" let
# decode compiled only because its step was stored, see `plan`)
_may_compile = contextvars.ContextVar("ggml_kernels_may_compile", default=True)
# what the caller may have chosen: any of these in generate()'s arguments or the model's generation
# config leaves the cache and compilation to them
_CALLER_CHOICES = ("past_key_values", "cache_implementation", "compile_config", "disable_compile", "assistant_model",
                   "prompt_lookup_num_tokens")


def check_option(value) -> bool | str:
    """`enable()`'s `compile_decode` value: True, False or "auto"; anything else is a clear error."""
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f'compile_decode must be True, False or "auto", got {value!r}')


def set_mode(mode: bool | str) -> None:
    _state["mode"] = check_option(mode)


def mode() -> bool | str:
    return _state["mode"]


class Record:
    """A model's compiled decode: compile seconds per shape, and why it fell back to eager, if it did."""

    __slots__ = ("compiles", "failure", "step", "installs", "stored", "packaged")

    def __init__(self) -> None:
        self.compiles: dict[tuple, float] = {}  # (batch, cache length) -> seconds of the first step
        self.failure: str | None = None
        self.step = None  # the `guarded` compiled call of `compile_config()` (`decode_step`)
        self.installs = -1  # _state["installs"] when `step` was made
        self.stored = None  # the `stored_steps.StoredSteps` behind `step`, where steps are stored
        self.packaged = None  # the `packaged_steps.PackagedSteps` in front of it, where steps are packaged

    def loaded_shapes(self) -> set[tuple]:
        """The (batch, cache length) shapes whose step was loaded from the store, not compiled here."""
        stored = {shape for shape, *_ in self.stored.loaded} if self.stored is not None else set()
        packaged = set(self.packaged.loaded) - set(self.packaged.exported) if self.packaged is not None else set()
        return stored | packaged

    def compiled_here(self) -> bool:
        """Whether a decode step of the model was compiled in this process (not only loaded from a
        stored package or run eagerly for want of one)."""
        packaged = self.packaged
        absent = {shape for shape, *_ in packaged.absent} if packaged is not None else set()
        return any(packaged is None or shape in packaged.exported
                   or (shape not in packaged.loaded and shape not in absent) for shape in self.compiles)

    def compiling_seconds(self) -> tuple[float, float]:
        """(prompts, decode steps): the seconds this process spent compiling or exporting them, which a
        rate should leave out (a step loaded from the store counts nothing)."""
        loaded = self.loaded_shapes()
        steps = sum(s for shape, s in self.compiles.items() if shape not in loaded)
        prompts = sum(self.packaged.prompt_exported.values()) if self.packaged is not None else 0.0
        return prompts, steps

    def describe(self) -> str:
        if self.failure:
            return f"compiled decode failed, eager instead ({self.failure})"
        shapes = ", ".join(f"batch {b} x {n} positions: {s:.1f} s" for (b, n), s in self.compiles.items())
        loaded = len(self.loaded_shapes())
        stored = f"; {loaded} loaded from {stored_steps.folder()}" if loaded else ""
        return f"compiled decode steps ({shapes}{stored}){self._prompts()}" if shapes else ""

    def _prompts(self) -> str:
        """What the packaged prompts' forwards did, if anything: the lengths served, loaded or exported."""
        if self.packaged is None:
            return ""
        exported = self.packaged.prompt_exported
        loaded = {name: s for name, s in self.packaged.prompt_loaded.items() if name not in exported}
        parts = [f"loaded for {_spans(loaded)} tokens"] if loaded else []
        if exported:
            parts.append(f"exported for {_spans(exported)} tokens in {sum(exported.values()):.1f} s")
        return f"; prompt packages {' and '.join(parts)}" if parts else ""


def _spans(times: dict) -> str:
    """The prompt lengths of packages keyed (batch, positions, first, last), as "2-8, 9-31"."""
    return ", ".join(f"{first}-{last}" for _, _, first, last in sorted(times))


def record(model) -> Record | None:
    """The model's `Record`, None where no step of it was compiled or tried."""
    return model.__dict__.get(RECORD_ATTR)


def _record_of(model) -> Record:
    rec = model.__dict__.get(RECORD_ATTR)
    if rec is None:
        rec = model.__dict__[RECORD_ATTR] = Record()
    return rec


def _is_packed_cpu_model(model) -> bool:
    from transformers.integrations.gguf.utils import GgufLinear

    return model.device.type == "cpu" and any(type(m) is GgufLinear for m in model.modules())


def applies(model, args: tuple, kwargs: dict) -> bool:
    """Whether `model.generate(*args, **kwargs)` should decode compiled (`plan`)."""
    return plan(model, args, kwargs) is not None


def plan(model, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """How `model.generate(*args, **kwargs)` decodes: None for eagerly; compiled where switched on, on
    a packed CPU model that has not failed to compile, with nothing the caller chose about caches or
    compiling. Then the static cache lengths it may take: () for any (`cache_positions`), compiling
    what is not stored; under "auto" that where `repays_a_compile`, else the lengths of the stored
    packages that fit the generation (`stored_fit`; none: None), and nothing is compiled."""
    if _state["mode"] is False:
        return None
    rec = record(model)
    if rec is not None and rec.failure:
        return None
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if any(kwargs.get(name) is not None for name in _CALLER_CHOICES):
        return None
    if config is not None and (config.cache_implementation is not None or config.compile_config is not None):
        return None
    if not _is_packed_cpu_model(model):
        return None
    if _state["mode"] is True or repays_a_compile(rec, config, args, kwargs):
        return ()
    fit = stored_fit(model, config, args, kwargs)
    if not fit:
        say_how_to_store(model)
    return fit or None


_told = weakref.WeakSet()  # the models `say_how_to_store` has spoken of


def how_to_store(name: str, how: str) -> str:
    """What a model named `name` that decoded eagerly under "auto" for want of a stored step is told
    (`how`: the switch that stores one)."""
    return (f"{name} decoded eagerly, no compiled step of it is stored; store its steps once with {how} (its "
            "decode step and short prompts exported as packages, 25-70 s each, once per model, cache length and "
            'thread count), which later processes load in milliseconds and compile_decode="auto" runs')


def say_how_to_store(model) -> None:
    """Once per model: under "auto", a generate() that runs eagerly for want of a stored step says
    how to store one (packages on: `packaged_steps.enabled`)."""
    if not packaged_steps.enabled() or model in _told:
        return
    _told.add(model)
    LOGGER.info("ggml-kernels: %s", how_to_store(type(model).__name__, "ggml_kernels_integration.store_steps(model)"))


def _batch_and_new_tokens(config, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
    """(batch, prompt length, new tokens) a generate() asks for, where its arguments say."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is None:
        length = kwargs.get("max_length", getattr(config, "max_length", None))
        new = None if length is None else length - ids.shape[1]
    return None if new is None else (ids.shape[0], ids.shape[1], new)


def prompt_in_one_chunk(model, args: tuple, kwargs: dict) -> dict:
    """generate()'s `prefill_chunk_size` that sends the whole prompt through the compiled call in one
    chunk, where prompts are packaged (`packaged_steps.prompts_enabled`), the caller chose no chunks
    and the prompt is no longer than a package serves; {} otherwise (the prompt's forward eager, as
    transformers runs it)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if not packaged_steps.prompts_enabled() or kwargs.get("prefill_chunk_size") is not None \
            or getattr(config, "prefill_chunk_size", None) is not None:
        return {}
    asked = _batch_and_new_tokens(config, args, kwargs)
    if asked is None or not 1 <= asked[1] <= packaged_steps.MAX_PROMPT_TOKENS:
        return {}  # a longer prompt's eager forward is as fast (`MAX_PROMPT_TOKENS`)
    return {"prefill_chunk_size": asked[1]}


def repays_a_compile(rec: Record | None, config, args: tuple, kwargs: dict) -> bool:
    """Under "auto": the model compiled a decode step already (the cost is paid), or this generate()
    asks for at least `AUTO_MIN_NEW_TOKENS` new tokens over its batch."""
    if rec is not None and rec.compiled_here():
        return True
    asked = _batch_and_new_tokens(config, args, kwargs)
    return asked is not None and asked[0] * asked[2] >= AUTO_MIN_NEW_TOKENS


def stored_fit(model, config, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The cache lengths of the model's stored step packages (`packaged_steps`) for this generate()'s
    batch that hold its prompt and new tokens: a compiled decode that costs no compile."""
    asked = _batch_and_new_tokens(config, args, kwargs)
    if asked is None or not packaged_steps.enabled() or not packaged_steps.any_stored():
        return ()
    decode_step(model)
    batch, prompt, new = asked
    return tuple(n for n in _record_of(model).packaged.stored_positions(batch) if n >= cache_positions(prompt + new))


def cache_positions(needed: int, choices: tuple[int, ...] = ()) -> int:
    """The static cache length a compiled generate() needing `needed` positions gets: the next power
    of two, at least `MIN_CACHE_POSITIONS`, or the shortest of `choices` that long (a stored step's).
    ggml-attn skips the masked positions of a longer cache."""
    length = max(MIN_CACHE_POSITIONS, 1 << max(0, int(needed) - 1).bit_length())
    return min((n for n in choices if n >= length), default=length)


def compile_config():
    """transformers' `CompileConfig` of `COMPILE_CONFIG`, allowed on the CPU."""
    from transformers import CompileConfig

    config = CompileConfig(**COMPILE_CONFIG)
    config._compile_all_devices = True  # transformers' switch for compiling on other devices than GPUs
    setattr(config, OURS_ATTR, True)
    return config


def keep_guard(entries) -> list[bool]:
    """dynamo's `guard_filter_fn` for a decode step: every guard but those on the model's modules'
    attributes (hook dicts empty, attribute types, constants and closures: ~8,000 on SmolLM2's 30
    layers, checked before every step: the check took 2.1-2.4 ms of a SmolLM2 step on the EPYC,
    1.0-1.6 ms with these left out). The tensor guards of its weights (dtype, shape, strides) stay, so
    a graph never runs on weights it was not compiled for. What the dropped guards would notice is
    the model's modules edited after its first compiled step; `enable()` after `disable()` compiles
    anew (`decode_step`), anything else (a hook added, a module swapped) needs `reset(model)`. The
    graph is the model's own (`isolate_recompiles`) and whole (`fullgraph`), so no other model's
    entries are tried on it."""
    return [e.guard_type == "TENSOR_MATCH" or not e.orig_guard.source.is_unspecialized_nn_module() for e in entries]


def compile_model(model, config: dict, guard_filter=keep_guard, inductor: dict | None = None):
    """torch.compile of `model.__call__` with `config` (`COMPILE_CONFIG`'s fields), in a region of its
    own (`isolate_recompiles`), with `guard_filter` (None: all of dynamo's guards) and inductor's
    options `inductor` (none: its defaults)."""
    config = dict(config)
    mode = config.pop("mode", None)
    if mode not in (None, "default"):
        raise ValueError(f"compiled decode takes inductor's default mode, not {mode!r}")
    options = dict(inductor or {})
    if guard_filter is not None:
        options["guard_filter_fn"] = guard_filter
    options = options or None
    return torch.compile(model.__call__, **config, options=options, isolate_recompiles=True)


def decode_step(model):
    """The model's compiled decode step (`guarded`), made again after a later `enable()`."""
    rec = _record_of(model)
    if rec.step is None or rec.installs != _state["installs"]:
        rec.compiles.clear()
        options = inductor_options()
        compiled = _OnFirstCall(lambda: compile_model(model, COMPILE_CONFIG, inductor=options))
        rec.stored = rec.packaged = None
        if stored_steps.enabled() and COMPILE_CONFIG["backend"] == "inductor":  # the store's own compile
            compiled = rec.stored = stored_steps.StoredSteps(model, compiled, _shape, keep_guard, options)
        if packaged_steps.enabled() and COMPILE_CONFIG["backend"] == "inductor":
            compiled = rec.packaged = packaged_steps.PackagedSteps(model, compiled, model.__call__, _may_compile.get,
                                                                   _shape, options)
        rec.step, rec.installs = guarded(model, compiled, model.__call__), _state["installs"]
    return rec.step


class _OnFirstCall:
    """A callable made by `make()` on its first call: `torch.compile` takes ~0.3 s to set up (dynamo's
    imports), which a generate() whose steps all run stored packages never needs."""

    __slots__ = ("make", "made")

    def __init__(self, make):
        self.make, self.made = make, None

    def __call__(self, *args, **kwargs):
        if self.made is None:
            self.made = self.make()
        return self.made(*args, **kwargs)


def inductor_options() -> dict | None:
    """inductor's options for a decode step under the enable() in force (`decode_graph`)."""
    return decode_graph.inductor_options(_state["quant"]) if _state["quant"] is not None else None


def reset(model) -> None:
    """Forget the model's compiled decode step (and a failed compile): its next compiled generate()
    compiles again. Needed after editing the model's modules once a step ran compiled (`keep_guard`)."""
    model.__dict__.pop(RECORD_ATTR, None)


def _shape(kwargs: dict) -> tuple:
    """(batch, cache positions) of a decode step's arguments: what a new graph is compiled for."""
    ids = kwargs.get("input_ids")
    layers = getattr(kwargs.get("past_key_values"), "layers", ())
    batch = ids.shape[0] if isinstance(ids, torch.Tensor) else None
    return batch, max((getattr(layer, "max_cache_len", 0) or 0 for layer in layers), default=None)


def is_prompt(kwargs: dict) -> bool:
    """Whether a forward's arguments are a prompt's: input_ids of more than one token per row."""
    ids = kwargs.get("input_ids")
    return isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 1


def _is_compile_error(error: BaseException) -> bool:
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return isinstance(error, (TorchDynamoException, InductorError))


def guarded(model, compiled, eager):
    """`compiled(**kwargs)` (a `torch.compile` of `eager`), timed the first time for each shape, or
    `eager(**kwargs)` once compiling failed: one warning, and the failure kept in the model's record."""
    rec = _record_of(model)

    def call(*args, **kwargs):
        if rec.failure:
            return eager(*args, **kwargs)
        if compiled is rec.packaged and is_prompt(kwargs) and packaged_steps.prompts_enabled():
            return compiled(*args, **kwargs)  # its package, or the eager forward: timed by `PackagedSteps`
        shape = _shape(kwargs)
        first = shape not in rec.compiles
        if first:  # the wait is tens of seconds: say so before it starts
            LOGGER.info("ggml-kernels: compiling %s's decode step for batch %s, %s cache positions (once per "
                        "model and shape)", type(model).__name__, shape[0], shape[1])
        start = time.perf_counter()
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:
            if not _is_compile_error(e):
                raise
            rec.failure = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"  # dynamo's names the cause
            warnings.warn(f"ggml-kernels: compiling {type(model).__name__}'s decode step failed, decoding eagerly "
                          f"instead: {rec.failure}", RuntimeWarning, stacklevel=2)
            return eager(*args, **kwargs)
        if first:
            rec.compiles[shape] = time.perf_counter() - start
            how = "loaded the stored" if shape in rec.loaded_shapes() else "compiled"
            LOGGER.info("ggml-kernels: %s %s's decode step for batch %s, %s cache positions in %.2f s", how,
                        type(model).__name__, shape[0], shape[1], rec.compiles[shape])
        return out

    return call


def compiled_call(model):
    """The compiled forward `generate()` decodes `model` with (transformers' `get_compiled_call` of
    `compile_config()`, which `install` makes `decode_step`), for callers that drive the decode loop
    themselves on a `StaticCache` of `cache_positions` (bench.StaticCompiledRunner): one compile per
    shape with generate()'s own, recorded in the same `Record`."""
    return model.get_compiled_call(compile_config())


def install(patches, quant) -> None:
    """Through `patches` (a `PatchSet`): `generate()` takes a static cache of `cache_positions` and
    `compile_config()` where `applies`; transformers' compiled call of a packed CPU model is
    `decode_step` for that config (its graph rewritten by `decode_graph` for `quant`, the
    ggml-quantization kernel), and `guarded` for a caller's own."""
    from transformers import GenerationMixin, PreTrainedModel

    _state["installs"] += 1
    _state["quant"] = quant

    def make_generate(original):
        def generate(self, *args, **kwargs):
            lengths = plan(self, args, kwargs)
            if lengths is None:
                return original(self, *args, **kwargs)
            kwargs = {**kwargs, "cache_implementation": "static", "compile_config": compile_config(),
                      **prompt_in_one_chunk(self, args, kwargs)}
            tokens = _sizing.set(lengths), _may_compile.set(not lengths)
            try:
                with stored_steps.one_generation():
                    return original(self, *args, **kwargs)
            finally:
                _sizing.reset(tokens[0])
                _may_compile.reset(tokens[1])

        generate.__doc__ = original.__doc__
        return generate

    def make_prepare_static_cache(original):
        def _prepare_static_cache(self, cache_implementation, batch_size, max_cache_len, *args, **kwargs):
            lengths = _sizing.get()
            if lengths is not None:
                max_cache_len = cache_positions(max_cache_len, lengths)
            return original(self, cache_implementation, batch_size, max_cache_len, *args, **kwargs)

        return _prepare_static_cache

    def make_compiled_call(original):
        def get_compiled_call(self, config):
            if getattr(config, OURS_ATTR, False) and _is_packed_cpu_model(self):
                return decode_step(self)
            compiled = original(self, config)
            if not _is_packed_cpu_model(self):
                return compiled
            cached = self.__dict__.get("_ggml_kernels_guarded")
            if cached is None or cached[0] is not compiled:
                cached = self.__dict__["_ggml_kernels_guarded"] = (compiled, guarded(self, compiled, self.__call__))
            return cached[1]

        return get_compiled_call

    patches.wrap(GenerationMixin, "generate", make_generate)
    patches.wrap(GenerationMixin, "_prepare_static_cache", make_prepare_static_cache)
    patches.wrap(PreTrainedModel, "get_compiled_call", make_compiled_call)

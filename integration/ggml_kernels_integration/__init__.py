"""Run transformers' GGUF models on ggml-kernels: `enable()`, then load as usual.

    import ggml_kernels_integration as gk
    gk.enable()
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=name)

`enable()` is thin, it rewrites no model code, and `disable()` undoes it:
- points the Hub ids transformers asks for at our local builds (LOCAL_KERNELS), and resolves them
  as CPU builds even on a CUDA build of torch, and where transformers does not take the installed
  kernels (5.23 wants kernels >= 0.18.2) opens its GGUF path to them all the same (`kernels_gate`);
- maps the layer kernels (RMSNormZeroCentered, RMSNorm, Qwen3_5GatedDeltaNet, SoftmaxTopKRouter, and
  the Llama family's rotary_pos_emb function) for the CPU too (transformers maps them for "mps" only);
- keeps `llama` files (SmolLM2, ...) packed too: transformers sends them to its older loader, which
  dequantizes every weight (see `archs`);
- on the CPU routes what transformers keeps for itself there through our kernels: embeddings of
  packed tables (get_rows) and prefill matmuls on packed weights (mul_mat), so no weight is ever
  unpacked to a dense copy; on a CPU with bfloat16 dot products, prefill matmuls of 32-64 rows and
  more on block-32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) dequantize a chunk at a time with ggml and
  multiply in bfloat16, 2-5x faster than ggml's dot products for those types (see `dense_prefill`;
  `enable(dense_prefill=False)` keeps ggml's path);
- lets CPU key/value caches grow in place instead of being re-copied every step (see `kv_cache`);
- reads a GGUF's config without a numpy object per vocabulary entry (see `lean_metadata`);
- runs a layer's sibling projections (q/k/v, gate/up, ...) as one kernel call in decode steps (see
  `projection_groups`), and hands the memory the load freed back to the system;
- holds the linears of the types ggml-quantization measured faster so on this CPU (its `cpu`: Q4_0
  and Q4_K on Intel CPUs, Q4_0 on AMD's) in ggml-cpu's repacked layout, as llama.cpp does, for its
  repacked kernels in decode steps and short prompts; `enable(repack_weights=True)` repacks every type it can (Q4_0 / Q4_K /
  IQ4_NL / MXFP4) on any CPU, `False` none (see `repacking`);
- runs `generate()`'s decode steps on the CPU as one compiled graph over a static cache
  (`compiled_decode`) where the compile repays itself (long generations; `compile_decode=True`: always)
  or costs nothing: steps stored as packages by an earlier process, which `store_steps(model)` stores
  up front for every prompt up to 128 tokens (`store`);
- after each packed load, says once what runs on our kernels and what does not, and why (`report`),
  instead of kernels' warning per layer.

`enable(backend="metal-emu")` sends every kernel call to the emulated-Metal builds instead
(`packages/<name>/build-metal-emu`: upstream's Metal host code and kernels, run on the CPU on CPU
tensors): transformers runs the model through the Metal path of every package, for verification on a
machine without a Mac (slow); `metal_dispatches()` then lists the Metal kernels that ran.
`enable(backend="mps-emu")` does the same on the MPS device layer's Linux twin
(`packages/<name>/build-mps-emu`: the layer a Mac runs on torch's MPS stream, here over a fake Metal
framework and MPS stream executing on the emulated device); `locate.BACKENDS` lists the backends.
On an Apple-silicon Mac, `enable(backend="mps")` takes the packages' darwin variants
(`packages/<name>/build/torch<XY>-metal-aarch64-darwin`) and the model runs on torch's "mps" device.

It is all or nothing: every change goes through one undo log (`patching.PatchSet`), so a failure
midway leaves transformers as it was, and `disable()` restores every attribute it changed; models
loaded while enabled go on computing on transformers' own forwards (`kept_kernels`). It checks
first that transformers and kernels are versions it was tested with and that every internal it
relies on is where it expects (`compat`). Builds are found in `GGML_KERNELS_BUILDS`, kernels'
`LOCAL_KERNELS`, or this checkout (`locate`).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch

from . import (
    archs,
    compat,
    compiled_decode,
    dense_prefill,
    kept_kernels,
    kernels_gate,
    kv_cache,
    lean_metadata,
    locate,
    projection_groups,
    repacking,
    report,
)
from .compat import InternalsChangedError, UnsupportedVersionError
from .locate import builds
from .patching import PatchSet
from .store import store_steps
from .validate import GgufFileError, GgufSummary, check_gguf

__all__ = [
    "GgufFileError",
    "GgufSummary",
    "InternalsChangedError",
    "UnsupportedVersionError",
    "builds",
    "check_gguf",
    "disable",
    "enable",
    "backend",
    "is_enabled",
    "metal_dispatches",
    "original",
    "reset_metal_dispatches",
    "store_steps",
    "summary",
]

_dense_prefill_module = dense_prefill  # `enable`'s keyword has the module's name
_options = {"repack_weights": "auto", "huge_pages": True}  # enable()'s load-time options; the last call's values hold

REPACK_CHOICES = (True, False, "auto")  # enable()'s repack_weights

# kernel name transformers asks for -> (Hub id, layer class in that package)
LAYER_KERNELS = {
    "RMSNormZeroCentered": ("ggml-org/ggml-norm", "RMSNormZeroCentered"),
    "RMSNorm": ("ggml-org/ggml-norm", "RMSNorm"),
    "Qwen3_5GatedDeltaNet": ("ggml-org/ggml-gated-delta-net", "Qwen3_5GatedDeltaNet"),
    "SoftmaxTopKRouter": ("transformers-community/topk", "SoftmaxTopKRouter"),
    # the function kernel of the Llama family's apply_rotary_pos_emb
    "rotary_pos_emb": ("ggml-org/ggml-attn", "RotaryPosEmb"),
}

_active: dict = {}  # "patches": the PatchSet of the enable() in force


def is_enabled() -> bool:
    return "patches" in _active


def enable(*, backend: str = "cpu", dense_prefill: bool = True, repack_weights: bool | str = "auto",
           huge_pages: bool = True, allow_untested_versions: bool = False, report_loads: bool = True,
           compile_decode: bool | str = compiled_decode.DEFAULT) -> None:
    """Make transformers' GGUF path run on ggml-kernels. See the module docstring.

    backend: "cpu" (ggml-cpu, the default), "metal-emu" (upstream's Metal backend on the emulated
        device: every package's build-metal-emu build) or "mps-emu" (the MPS device layer's Linux
        twin: every package's build-mps-emu build) or "mps" (an Apple-silicon Mac with macOS >= 26:
        every package's darwin variant, on torch's MPS device; elsewhere a RuntimeError). On the
        Metal backends all five packages are required, and dense_prefill and repack_weights,
        ggml-cpu paths, stay off.
    dense_prefill: ggml-quantization's `mul_mat` chooses each prefill matmul's path: on block-32
        weights its dense one (ggml's dequantize and a bfloat16 GEMM) where it is faster; False asks
        it for ggml's exact path for every prefill matmul (8-bit activations, as llama.cpp). The last
        call's value holds.
    repack_weights: GGUF models loaded from now on hold linears in ggml-cpu's repacked layout
        (`repacking`): ggml's repacked kernels run decode steps and 2-47-token prompts, while
        prompts of 48 tokens and more pay for unpacking each slice. "auto" (the default) repacks the
        types ggml-quantization measured faster so on this CPU (`faster_repacked_types()`: Q4_0 and
        Q4_K on Intel CPUs, Q4_0 on AMD's, whose plain Q4_K kernels decode as fast), True every type
        it can (Q4_0 / Q4_K / IQ4_NL / MXFP4), False none. The last call's value holds.
    huge_pages: on the CPU backend, GGUF models loaded from now on hold their packed weights in one
        mapping on transparent huge pages where Linux offers them (ggml-quantization's `huge_pages`):
        a decode step streams them 1.2-1.4x faster than from 4 KiB pages. The last call's value holds.
    compile_decode: on the CPU backend, `generate()` of a packed model decodes with a static cache and
        its forward compiled by torch.compile, once per model and shape: True always, False never,
        "auto" (the default) where the compile repays itself: a generate() asking for
        `compiled_decode.AUTO_MIN_NEW_TOKENS` new tokens or more, and every later one of that model
        (see `compiled_decode` for what it saves and what a compile costs). The last call's value holds.
    allow_untested_versions: run with transformers / kernels outside the tested range (`compat.TESTED`).
    report_loads: after each packed GGUF load, log (logger "ggml_kernels_integration", INFO, on
        stderr unless the application configured logging) what runs on our kernels.

    Calling it again while enabled only updates `dense_prefill`, `repack_weights`, `huge_pages` and
    `compile_decode`
    (another backend needs `disable()` first). Raises `UnsupportedVersionError`, `InternalsChangedError`, `ValueError`
    or `RuntimeError` (no build found) before changing anything; any other failure undoes what was
    changed."""
    on_metal = locate.backend_of(backend).metal
    compile_decode = compiled_decode.check_option(compile_decode)
    locate.check_host(backend)
    if repack_weights not in REPACK_CHOICES:
        raise ValueError(f"repack_weights must be one of {REPACK_CHOICES}, not {repack_weights!r}")
    if on_metal and repack_weights is True:
        raise ValueError("repack_weights holds weights in ggml-cpu's layout: it needs backend='cpu'")
    if is_enabled() and backend != _active["backend"]:
        raise RuntimeError(f"enabled with backend {_active['backend']!r}: call disable() before enabling {backend!r}")
    _options["repack_weights"] = repack_weights if repack_weights == "auto" else bool(repack_weights)
    _options["huge_pages"] = bool(huge_pages) and not on_metal
    if is_enabled():
        _dense_prefill_module.set_enabled(dense_prefill and not on_metal)
        compiled_decode.set_mode(False if on_metal else compile_decode)
        return
    if not allow_untested_versions:
        compat.check_versions()
    compat.check_internals()
    ours = locate.builds(backend)
    missing = tuple(repo_id for repo_id in locate.required(backend) if repo_id not in ours)
    if missing:
        raise RuntimeError(locate.not_found_message(backend, missing))
    patches = PatchSet()
    try:
        _install(patches, ours, report_loads, backend)
    except BaseException:
        patches.restore()
        raise
    _dense_prefill_module.set_enabled(dense_prefill and not on_metal)
    compiled_decode.set_mode(False if on_metal else compile_decode)
    _active.update(patches=patches, backend=backend, builds=ours)
    kept_kernels.release()  # models loaded before a disable() run on the patched classes again


def disable() -> None:
    """Undo `enable()`: every attribute, table entry and environment variable it changed is restored.
    Models loaded while enabled keep the layer kernels grafted onto their modules, and their packed
    modules run transformers' own forwards, on the ggml-quantization build they were loaded with
    (transformers' process-wide kernel lookup is back as it was, and finds none on the CPU: see
    `kept_kernels`)."""
    patches = _active.pop("patches", None)
    _active.clear()
    if patches is not None:
        patches.restore()
        kept_kernels.keep()
    _dense_prefill_module.set_enabled(True)
    compiled_decode.set_mode(compiled_decode.DEFAULT)


def backend() -> str | None:
    """The backend of the enable() in force (a key of `locate.BACKENDS`), None when not enabled."""
    return _active.get("backend")


def _loaded_packages() -> list:
    """The package modules of the enable() in force (kernels imports each build once)."""
    import kernels

    if not is_enabled():
        raise RuntimeError("ggml_kernels_integration is not enabled")
    return [kernels.get_kernel(repo_id, version=1, **locate.backend_kwargs()) for repo_id in _active["builds"]]


def _check_metal(caller: str) -> None:
    if backend() is None or not locate.BACKENDS[backend()].emulated:
        metal = " or ".join(repr(name) for name, entry in locate.BACKENDS.items() if entry.emulated)
        raise RuntimeError(f"{caller}() needs enable(backend={metal}), enabled: {backend()!r}")


def metal_dispatches() -> dict[str, int]:
    """With `enable(backend="metal-emu")` or "mps-emu": {Metal kernel name: threadgroups dispatched},
    summed over every package, since the packages were loaded or `reset_metal_dispatches()` last ran.
    Raises RuntimeError on the CPU backend (no Metal dispatches to show)."""
    _check_metal("metal_dispatches")
    total: dict[str, int] = {}
    for module in _loaded_packages():
        for kernel, threadgroups in module.metal_dispatches().items():
            total[kernel] = total.get(kernel, 0) + threadgroups
    return dict(sorted(total.items()))


def reset_metal_dispatches() -> None:
    """Forget the Metal dispatches of every package so far (see `metal_dispatches`)."""
    _check_metal("reset_metal_dispatches")
    for module in _loaded_packages():
        module.reset_metal_dispatches()


def original(owner, name: str):
    """What `owner.name` was before `enable()` replaced it (for A/B measurements of one feature)."""
    if not is_enabled():
        raise RuntimeError("ggml_kernels_integration is not enabled")
    return _active["patches"].original(owner, name)


def summary(model) -> report.Summary:
    """What `model` runs on: our kernels (by package) and transformers' own code (with the reason)."""
    return report.summary(model, LAYER_KERNELS)


def _install(patches: PatchSet, ours: dict, report_loads: bool, backend: str) -> None:
    import kernels
    from transformers.integrations.gguf import kernels as gguf_kernels

    _point_hub_ids_at(patches, ours)
    kernels_gate.install(patches, ours)  # transformers 5.23 with kernels 0.17: its GGUF path uses them
    patches.set_attr(gguf_kernels, "_gguf_kernel", None)  # forget a lookup made before enable()
    _map_layer_kernels(patches, ours, backend)
    archs.register(patches)  # llama files (SmolLM2, ...) kept packed too
    quant = kernels.get_kernel(locate.QUANTIZATION, version=1, **locate.backend_kwargs())
    _copy_tensors_out_of_the_file(patches, quant)
    write = None
    if locate.ATTENTION in ours:
        attn = kernels.get_kernel(locate.ATTENTION, version=1, **locate.backend_kwargs())
        write = attn.ops.kv_write.default if hasattr(attn, "kv_write") else None
    kv_cache.install(patches, write)  # decode steps append to the key/value cache in place
    lean_metadata.install(patches)  # config reads without a numpy view per vocabulary entry
    _check_files_before_transformers_reads_them(patches)
    _route_cpu_reads_through_kernels(patches, quant)
    projection_groups.patch_forward(patches, quant)
    compiled_decode.install(patches, quant)
    patches.on_restore(functools.partial(repacking.unpack_all, quant), "repacked weights back to the GGUF layout")
    steps = [functools.partial(_repack_if_asked, quant=quant), functools.partial(_finish_on_huge_pages, quant=quant),
             functools.partial(projection_groups.install, quant=quant, patches=patches),
             functools.partial(kept_kernels.track, quant=quant), _return_freed_memory]
    if report_loads:
        steps.append(_log_summary)
        _show_reports(patches)
    _after_each_gguf_load(patches, *steps)


# transformers' own lookup, not kernels' `get_kernel` as hub_kernels imports it: that import is
# skipped where transformers does not take the installed kernels (5.23 with kernels 0.17)
compat.needs(
    ("transformers.integrations.hub_kernels", "get_kernel", ("kernel_name", "revision", "version")),
    ("kernels", "get_kernel", ("repo_id",)),
)


def _point_hub_ids_at(patches: PatchSet, ours: dict) -> None:
    """LOCAL_KERNELS names our builds for the Hub ids transformers asks for, and transformers' lookup
    of those ids goes straight to kernels: on a CUDA build of torch they resolve as the CPU builds
    they are, and where transformers does not take the installed kernels (see `kernels_gate`) they
    resolve all the same."""
    import kernels
    from transformers.integrations import hub_kernels

    mapping = ":".join(f"{repo}={path}" for repo, path in ours.items())
    existing = os.environ.get("LOCAL_KERNELS")
    patches.set_env("LOCAL_KERNELS", ":".join(p for p in (existing, mapping) if p))

    def make(original_get_kernel):
        def get_kernel(kernel_name, revision=None, version=None, allow_all_kernels=False):
            if kernel_name not in ours:
                return original_get_kernel(kernel_name, revision, version, allow_all_kernels)
            return kernels.get_kernel(kernel_name, revision=revision, version=version, **locate.backend_kwargs())

        return get_kernel

    patches.wrap(hub_kernels, "get_kernel", make)


compat.needs(
    ("transformers.integrations.gguf.kernels", "get_ggml_layer_mapping", ()),
    ("kernels", "LocalLayerRepository.__init__", ("self", "repo_path", "layer_name")),
    ("kernels", "Mode.INFERENCE", None),
)


def _map_layer_kernels(patches: PatchSet, ours: dict, backend: str) -> None:
    """Layer kernels for the devices we build for, from the build folder itself (no Hub call, no
    backend guess). transformers drops a layer whose every entry does not load, and its "mps" entries
    ask the Hub for a version, so a layer we build replaces transformers' entry instead of joining it."""
    from kernels import LocalLayerRepository, Mode
    from transformers.integrations.gguf import kernels as gguf_kernels

    def make(original_mapping):
        def layer_mapping() -> dict:
            out = original_mapping()
            for layer, (repo_id, layer_class) in LAYER_KERNELS.items():
                if repo_id in ours:
                    repo = LocalLayerRepository(repo_path=locate.variant_dir(ours[repo_id], backend), layer_name=layer_class)
                    out[layer] = {locate.BACKENDS[backend].device: {Mode.INFERENCE: repo}}
            return out

        return layer_mapping

    patches.wrap(gguf_kernels, "get_ggml_layer_mapping", make)


compat.needs(
    ("transformers.integrations.gguf.kernels", "get_gguf_kernel", ()),
    ("transformers.integrations.gguf.kernels", "kernel_can_read", ("tensor",)),
    ("transformers.integrations.gguf.utils", "GgufLinear._unpack_matmul", ("self", "flat")),
)


def _route_cpu_reads_through_kernels(patches: PatchSet, quant) -> None:
    """On the CPU transformers unpacks embeddings and prefill weights with its own torch code
    (kernel_can_read is False there): our get_rows / mul_mat read the packed blocks directly."""
    from transformers.integrations.gguf import kernels as gguf_kernels
    from transformers.integrations.gguf import utils as gguf_utils

    def make_can_read(original_can_read):
        def kernel_can_read(tensor) -> bool:
            return gguf_kernels.get_gguf_kernel() is not False and (tensor.device.type == "cpu" or original_can_read(tensor))

        return kernel_can_read

    def make_unpack(original_unpack):
        def unpack_matmul(self, flat: torch.Tensor) -> torch.Tensor:
            if self.weight.device.type != "cpu":
                return original_unpack(self, flat)
            out = _dense_prefill_module.mul_mat(quant, self.weight, flat, self.ggml_type, self.out_features)
            return out.to(flat.dtype)

        return unpack_matmul

    patches.wrap(gguf_kernels, "kernel_can_read", make_can_read)
    patches.wrap(gguf_utils.GgufLinear, "_unpack_matmul", make_unpack)


def _repack_if_asked(model, quant) -> None:
    types = repacking.chosen_types(quant, _options["repack_weights"])
    if types:
        repacking.install(model, quant, types)


def packed_parameters(model) -> list[torch.nn.Parameter]:
    """The model's packed weights: its uint8 CPU parameters, each once (a tied one is held by two
    modules)."""
    found: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.dtype == torch.uint8 and param.device.type == "cpu":
                found.setdefault(id(param), param)
    return list(found.values())


# model -> the huge-page arena its GGUF load copies packed tensors into (`_copy_tensors_out_of_the_file`)
_load_arenas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ARENA_ATTR = "_ggml_kernels_arena"  # a LazyGgufTensor's arena, set where its load begins


def _huge_pages(quant):
    """ggml-quantization's `huge_pages` where `enable(huge_pages=True)` and the system offers them."""
    module = getattr(quant, "huge_pages", None)
    return module if _options["huge_pages"] and module is not None and module.available() else None


def _finish_on_huge_pages(model, quant) -> None:
    """After a load: the packed weights not on huge pages yet (those the loader converted from its
    copies, row orders and splits, and those repacked) take the room of the copies they came from,
    mostly of their size; what stays unused is given back. The next load opens an arena of its own."""
    arena = _load_arenas.pop(model, None)
    huge_pages = _huge_pages(quant)
    if huge_pages is None:
        return
    arena = arena or huge_pages.Arena()
    outside = [p for p in packed_parameters(model) if not arena.holds(p)]
    in_use = [*model.parameters(), *model.buffers()]
    with torch.no_grad():
        for param, copy in zip(outside, arena.copy_into_unused(in_use, [p.data for p in outside]), strict=True):
            param.data = copy
    arena.release_unused([*model.parameters(), *model.buffers()])


def _log_summary(model) -> None:
    report.LOGGER.info(report.describe(summary(model)))


def _show_reports(patches: PatchSet) -> None:
    """Our logger says INFO on stderr, unless the application gave it (or the root logger) a handler."""
    logger = report.LOGGER
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = logger.level, logger.propagate

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate

    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    patches.on_restore(undo, "ggml_kernels_integration logger")


compat.needs(
    ("transformers.quantizers.quantizer_gguf", "GgufHfQuantizer._process_model_after_weight_loading", ("self", "model")),
)


def _after_each_gguf_load(patches: PatchSet, *steps) -> None:
    """Run `step(model)` for each step once transformers has loaded a GGUF model's weights; kernels'
    per-layer "No kernel mapping" warnings of that load are held back (`report` says it once)."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    def make(original):
        def after_loading(self, model, **kwargs):
            with report.quiet_kernelize():
                model = original(self, model, **kwargs)
            if self.supported and not self.quantization_config.dequantize:
                for step in steps:
                    step(model)
            return model

        return after_loading

    patches.wrap(GgufHfQuantizer, "_process_model_after_weight_loading", make)


def _return_freed_memory(model=None) -> None:
    """Hand the heap memory the load freed back to the system (glibc's malloc_trim).

    Loading copies every tensor out of the file through temporaries; glibc keeps what they freed
    for reuse, and on a Qwen3.5-0.8B-shaped file that was ~45 MiB resident for the rest of the
    process (and under the peak of the first prefill). No-op where the C library has no malloc_trim."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


compat.needs(  # where config, tokenizer and quantizer import the header reader from
    ("transformers.integrations.gguf", "read_gguf_metadata", ("gguf_path",)),
    ("transformers.integrations.gguf.reader", "read_gguf_metadata", ("gguf_path",)),
    ("transformers.quantizers.quantizer_gguf", "read_gguf_metadata", ("gguf_path",)),
)


def _check_files_before_transformers_reads_them(patches: PatchSet) -> None:
    """A damaged or unsupported file fails on its first header read (the config's), in one clear
    sentence, before a model is built (see `validate`)."""
    import transformers.integrations.gguf as gguf_package
    from transformers.integrations.gguf import reader
    from transformers.quantizers import quantizer_gguf

    original = reader.read_gguf_metadata
    checked: set = set()

    def read_gguf_metadata(gguf_path, *args, **kwargs):
        stat = os.stat(gguf_path) if os.path.isfile(gguf_path) else None
        key = (os.path.realpath(gguf_path), stat and stat.st_size, stat and stat.st_mtime_ns)
        if key not in checked:
            check_gguf(gguf_path)
            checked.add(key)
        return original(gguf_path, *args, **kwargs)

    for module in (reader, gguf_package, quantizer_gguf):  # config / tokenizer import it from the package
        patches.set_attr(module, "read_gguf_metadata", read_gguf_metadata)


compat.needs(
    ("transformers.integrations.gguf.reader", "LazyGgufTensor.__getitem__", ("self",)),
    ("transformers.quantizers.quantizer_gguf", "GgufHfQuantizer.get_state_dict", ("self", "checkpoint_file", "model")),
)


def _copy_tensors_out_of_the_file(patches: PatchSet, quant) -> None:
    """transformers copies each tensor out of the memory-mapped file, and the mapped pages it read
    stay resident until the whole load ends: the peak was the file twice. Drop them as it goes. And
    where huge pages are on (`_huge_pages`), each packed tensor's copy goes to the load's arena
    (`huge_pages.Arena`) at once: moved after the load, the weights would be held twice for a while
    (transformers keeps its copies until the load returns; +340 MiB at the peak on the 0.8B shape)."""
    import ctypes
    import mmap

    from transformers.integrations.gguf import reader
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    original = reader.LazyGgufTensor.__getitem__

    def getitem(self, key):
        tensor = original(self, key)  # a copy: the mapping is not referenced any more
        start = self.data.ctypes.data
        first, end = start // page * page, start + self.data.nbytes
        # the mapping is read-only and file-backed: dropped pages are read again from the file if
        # anything touches them (a page shared with the next tensor, say)
        libc.madvise(first, end - first, mmap.MADV_DONTNEED)
        huge_pages = _huge_pages(quant)
        if huge_pages is not None and isinstance(tensor, torch.Tensor) and tensor.dtype == torch.uint8 \
                and tensor.device.type == "cpu":
            arena = getattr(self, _ARENA_ATTR, None)
            tensor = tensor if arena is None else arena.copy(tensor)
        return tensor

    patches.set_attr(reader.LazyGgufTensor, "__getitem__", getitem)

    def make_get_state_dict(original_get_state_dict):
        def get_state_dict(self, checkpoint_file, model):
            tensors = original_get_state_dict(self, checkpoint_file, model)
            huge_pages = _huge_pages(quant)
            if huge_pages is not None and isinstance(tensors, dict):
                arena = _load_arenas.setdefault(model, huge_pages.Arena())  # this load's own
                for tensor in tensors.values():
                    if isinstance(tensor, reader.LazyGgufTensor):
                        setattr(tensor, _ARENA_ATTR, arena)
            return tensors

        return get_state_dict

    patches.wrap(GgufHfQuantizer, "get_state_dict", make_get_state_dict)

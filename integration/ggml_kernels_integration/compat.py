"""What the integration needs of transformers, kernels and gguf-py, checked before anything is patched.

`enable()` rebinds internals of transformers 5.22 and 5.23 (there is no public hook for what it does),
so it refuses versions outside the range it was tested with (`check_versions`; `allow_untested=True`
lets people try), and checks that every internal it touches is still there with the parameters it
calls (`check_internals`): an upgrade then fails in one place, naming what moved. Every internal
listed is there in both tested transformers versions.
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# distribution -> the versions the integration is tested with (noxfile.py pins the lower ends)
TESTED = {"transformers": ">=5.22.2,<5.24", "kernels": ">=0.17.2,<0.18"}

# (module, attribute path, the leading parameter names we call it with, or None for a non-callable)
INTERNALS: list[tuple[str, str, tuple[str, ...] | None]] = [
    # kernel lookup: our Hub ids resolve to the CPU build on a CUDA torch. transformers' own lookup, not
    # kernels' `get_kernel` as hub_kernels imports it: that import is skipped where transformers does not
    # take the installed kernels (5.23 with kernels 0.17), see `kernels_gate`
    ("transformers.integrations.hub_kernels", "get_kernel", ("kernel_name", "revision", "version")),
    ("kernels", "get_kernel", ("repo_id",)),
    # transformers' kernels gate, and what `kernels_gate` opens where it is closed: the layer kernels
    # grafted with kernels' own API, the attention registered as transformers registers it
    ("transformers.utils.import_utils", "is_kernels_available", ()),
    ("transformers.integrations.gguf.kernels", "is_kernels_available", ()),
    ("transformers.integrations.gguf.kernels", "kernelize_ggml_layers", ("model",)),
    ("kernels", "kernelize", ("model",)),
    ("kernels", "use_kernel_mapping", ("mapping",)),
    ("kernels", "register_kernel_mapping", ("mapping",)),
    ("transformers.integrations.hub_kernels", "load_and_register_attn_kernel",
     ("attn_implementation", "attention_wrapper", "allow_all_kernels")),
    ("transformers", "AttentionInterface.register.__func__", ("cls", "key", "value")),  # a classmethod
    ("transformers", "AttentionMaskInterface.register.__func__", ("cls", "key", "value")),
    ("transformers.masking_utils", "sdpa_mask", None),
    # the packed GGUF path: kernel lookup, layer mapping, packed linears
    ("transformers.integrations.gguf.kernels", "_gguf_kernel", None),
    ("transformers.integrations.gguf.kernels", "MAX_GEMV_ROWS", None),
    ("transformers.integrations.gguf.kernels", "get_gguf_kernel", ()),
    ("transformers.integrations.gguf.kernels", "get_ggml_layer_mapping", ()),
    ("transformers.integrations.gguf.kernels", "kernel_can_read", ("tensor",)),
    # the kernel functions the packed modules' forwards call by name (`kept_kernels` binds them per model)
    ("transformers.integrations.gguf.kernels", "mul_mat_vec", ("weight", "x", "ggml_type", "out_features")),
    ("transformers.integrations.gguf.kernels", "mul_mat_id", ("blocks", "x", "ids", "ggml_type", "out_features")),
    ("transformers.integrations.gguf.utils", "GgufLinear.forward", ("self", "x")),
    ("transformers.integrations.gguf.utils", "GgufLinear._unpack_matmul", ("self", "flat")),
    ("transformers.integrations.gguf.utils", "GgufLinear.__init__", ("self", "in_features", "out_features", "ggml_type")),
    # llama files kept packed: transformers' own table, renamings and row permutation
    ("transformers.integrations.gguf.gguf_conversion_mapping", "GGUF_ARCHS", None),
    ("transformers.integrations.gguf.gguf_conversion_mapping", "DENSE_DECODER_RENAMINGS", None),
    ("transformers.integrations.gguf.gguf_conversion_mapping", "PermuteRows", None),
    ("transformers.core_model_loading", "WeightConverter", None),
    ("transformers.core_model_loading", "WeightRenaming", None),
    # reading files: the header check before transformers reads one, mapped pages dropped per tensor
    ("transformers.integrations.gguf", "read_gguf_metadata", ("gguf_path",)),
    ("transformers.integrations.gguf.reader", "read_gguf_metadata", ("gguf_path",)),
    ("transformers.integrations.gguf.reader", "LazyGgufTensor.__getitem__", ("self",)),
    ("transformers.quantizers.quantizer_gguf", "read_gguf_metadata", ("gguf_path",)),
    ("transformers.quantizers.quantizer_gguf", "GgufHfQuantizer._process_model_after_weight_loading", ("self", "model")),
    ("transformers.modeling_gguf_pytorch_utils", "load_gguf_checkpoint", ("gguf_checkpoint_path", "return_tensors")),
    ("gguf", "GGUFReader._get_field_parts", ("self", "orig_offs", "raw_type")),
    ("gguf", "GGUFReader._get", ("self", "offset", "dtype", "count")),
    # the key/value cache grown in place
    ("transformers.cache_utils", "DynamicLayer.update", ("self", "key_states", "value_states")),
    ("transformers.cache_utils", "DynamicLayer.lazy_initialization", ("self", "key_states", "value_states")),
    # compiled decode steps: generate()'s static cache and compile config, its compiled forward
    ("transformers", "GenerationMixin.generate", ("self",)),
    ("transformers", "PreTrainedModel.get_compiled_call", ("self", "compile_config")),
    ("transformers", "CompileConfig", None),
    ("transformers", "StaticCache", None),
    ("transformers", "AttentionInterface._global_mapping", None),  # ggml-attn registered top-left causal
    # layer kernels from our build folders; kernels' per-layer "No kernel mapping" warning, summarised
    ("kernels", "LocalLayerRepository.__init__", ("self", "repo_path", "layer_name")),
    ("kernels", "Mode.INFERENCE", None),
    ("kernels.layer.layer", "kernelize_layer", ("module",)),
]

ALLOW_UNTESTED_HINT = "pass enable(allow_untested_versions=True) to try anyway"


class UnsupportedVersionError(RuntimeError):
    """transformers or kernels is outside the tested range."""


class InternalsChangedError(RuntimeError):
    """An internal the integration patches or calls moved or changed its parameters."""


def installed_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in TESTED}


def untested_versions(versions: dict[str, str] | None = None) -> list[str]:
    """One line per distribution outside its tested range."""
    versions = versions if versions is not None else installed_versions()
    return [
        f"{name} {version} (tested: {TESTED[name]})"
        for name, version in versions.items()
        if Version(version) not in SpecifierSet(TESTED[name])
    ]


def check_versions(versions: dict[str, str] | None = None) -> None:
    versions = versions if versions is not None else installed_versions()
    if untested_versions(versions):
        found = ", ".join(f"{n} {v}" for n, v in versions.items())
        tested = ", ".join(f"{n} {s}" for n, s in TESTED.items())
        raise UnsupportedVersionError(
            f"ggml_kernels_integration is tested with {tested}; this environment has {found}. "
            f"It patches internals of these libraries that change between releases; {ALLOW_UNTESTED_HINT}."
        )


def transformers_uses_kernels() -> bool:
    """Whether transformers took the installed kernels at import (5.23 takes only kernels >= 0.18.2, which
    the package index does not serve; with 0.17.2 it switches its kernels integration off)."""
    from transformers.utils.import_utils import is_kernels_available

    return is_kernels_available()


def resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def moved_internals() -> list[str]:
    """One line per internal that is missing or whose leading parameters differ from `INTERNALS`."""
    problems = []
    for module, path, params in INTERNALS:
        try:
            obj = resolve(module, path)
        except (ImportError, AttributeError) as error:
            problems.append(f"{module}.{path}: missing ({error})")
            continue
        if params is None:
            continue
        try:
            found = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            problems.append(f"{module}.{path}: not a function any more ({type(obj).__name__})")
            continue
        if found[: len(params)] != params:
            problems.append(f"{module}.{path}: parameters {found}, expected to start with {params}")
    return problems


def check_internals() -> None:
    problems = moved_internals()
    if problems:
        raise InternalsChangedError(
            "ggml_kernels_integration relies on internals that moved in this transformers / kernels / "
            "gguf version:\n  " + "\n  ".join(problems)
        )

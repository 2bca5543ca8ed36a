"""Models loaded while enabled keep computing after `disable()`, on transformers' own forwards.

transformers' packed modules (`GgufLinear`, `GgufExperts`) call their GGUF kernel through one
process-wide lookup (`transformers.integrations.gguf.kernels._gguf_kernel`) that transformers
resolves once and never resets: its code takes a model with packed weights to mean a resolved
kernel. `disable()` puts that lookup back as it was before `enable()` (unresolved, or False: no
kernel, as on a CPU without our builds), so a model loaded packed while enabled would fail on its
first product ("'bool' object has no attribute 'mul_mat_vec'"), and nothing else can compute on
its packed weights in a decode step.

So `track(model, quant)` (a step after each packed load) remembers which ggml-quantization build
(`quant`) a model was loaded with, and `keep()` (run by `disable()`) gives each packed module of the
tracked models still alive its class's own forward, the very code transformers runs, with the
kernel functions it calls by name (`KERNEL_FUNCTIONS`) read from that build instead of the
process-wide lookup. Nothing process-wide stays changed: a model loaded after `disable()` is
transformers' alone. `release()` (run by `enable()`) takes those forwards off again, so the
modules run on the patched classes like any other.
"""

from __future__ import annotations

import types
import weakref

from . import compat

# the kernel functions the packed modules' forwards call by name, bound per model here
compat.needs(
    ("transformers.integrations.gguf.kernels", "_gguf_kernel", None),
    ("transformers.integrations.gguf.kernels", "mul_mat_vec", ("weight", "x", "ggml_type", "out_features")),
    ("transformers.integrations.gguf.kernels", "mul_mat_id", ("blocks", "x", "ids", "ggml_type", "out_features")),
)


# the kernel functions of transformers.integrations.gguf.kernels that the packed modules' forwards
# call by name (each reads the process-wide `_gguf_kernel`); the package has them with the same
# parameters, and transformers' `GgufKernel` hands its calls straight to them
KERNEL_FUNCTIONS = ("mul_mat_vec", "mul_mat_id")

_tracked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ggml-quantization build
_kept: weakref.WeakSet = weakref.WeakSet()  # modules holding a forward from `keep()`
_MARK = "_ggml_kernels_kept_kernel"  # set on the forwards `keep()` makes


def track(model, quant) -> None:
    """Remember that `model` was loaded packed on `quant` (the ggml-quantization module)."""
    _tracked[model] = quant


def _calls_the_kernel(cls) -> bool:
    forward = cls.__dict__.get("forward")
    return isinstance(forward, types.FunctionType) and any(name in forward.__code__.co_names for name in KERNEL_FUNCTIONS)


def _with_kernel(forward: types.FunctionType, quant) -> types.FunctionType:
    """`forward`'s own code, reading `KERNEL_FUNCTIONS` from `quant` and every other global as before."""
    scope = dict(forward.__globals__)
    scope.update({name: getattr(quant, name) for name in KERNEL_FUNCTIONS})
    kept = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    kept.__kwdefaults__ = forward.__kwdefaults__
    kept.__qualname__ = forward.__qualname__
    setattr(kept, _MARK, True)
    return kept


def keep() -> int:
    """Bind the packed modules of every tracked model still alive to its build; returns how many."""
    forwards: dict = {}  # (class, build) -> its forward bound to the build
    for model, quant in list(_tracked.items()):
        for module in model.modules():
            cls = type(module)
            if cls.__module__ != "transformers.integrations.gguf.utils" or not _calls_the_kernel(cls):
                continue
            key = (cls, id(quant))
            if key not in forwards:
                forwards[key] = _with_kernel(cls.__dict__["forward"], quant)
            module.forward = types.MethodType(forwards[key], module)
            _kept.add(module)
    return len(_kept)


def release() -> None:
    """Take `keep()`'s forwards off (not one set since): the modules run their classes' forward again."""
    for module in list(_kept):
        forward = module.__dict__.get("forward")
        if getattr(forward, "__func__", None) is not None and getattr(forward.__func__, _MARK, False):
            del module.__dict__["forward"]
    _kept.clear()

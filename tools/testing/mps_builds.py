"""The "mps" build kind: a package's darwin variant on a Mac, driven by tests written for CPU tensors.

On a Mac (`nox -s mac`), a package's Metal build is its darwin variant,
packages/<name>/build/torch<XY>-metal-aarch64-darwin/, whose ops take MPS tensors. The package
tests hold CPU tensors and compare them with the references; `OnDevice` lets them run unchanged:
every op call gets its tensor arguments copied to the device (tensors that share a storage sharing
the copy, at the same offsets and strides, as the MPS backend binds storages at offsets), and
afterwards every argument storage copied back (what an op wrote in place reaches the caller's CPU
tensor) and every tensor result copied to the CPU.

Which build kinds the package tests run is chosen with GGML_KERNELS_TEST_BUILDS (comma separated,
e.g. `mps` on a Mac, `metal-emu,mps-emu` on Linux; unset: every kind the tests list).
Not run on a Mac yet (docs/metal.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tools import REPO

KIND = "mps"
BUILDS_ENV = "GGML_KERNELS_TEST_BUILDS"
# functions of a module that are no op (they take no tensors to move): called as they are
NOT_OPS = frozenset({"info"})


def selected_kinds(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """`kinds` narrowed to those GGML_KERNELS_TEST_BUILDS names, in its order, "mps" among them only
    when named; unset or empty: `kinds` unchanged. A name that is neither is a ValueError."""
    wanted = [k.strip() for k in os.environ.get(BUILDS_ENV, "").split(",") if k.strip()]
    if not wanted:
        return kinds
    unknown = [k for k in wanted if k not in kinds and k != KIND]
    if unknown:
        raise ValueError(f"{BUILDS_ENV} names unknown build kinds {unknown}: known are {', '.join((*kinds, KIND))}")
    return tuple(dict.fromkeys(wanted))


def darwin_variant() -> str:
    """torch<XY>-metal-aarch64-darwin for the running torch (the integration's rule, locate.BACKENDS["mps"])."""
    from tools.testing.kernel_testing import integration_locate

    return integration_locate().BACKENDS["mps"].variant()


def load_mps(package: str) -> OnDevice:
    """The package's darwin variant for the running torch through kernels.get_local_kernel, its ops
    taking the tests' CPU tensors (OnDevice on "mps"). A missing variant fails (a failed build must
    not pass as skipped tests)."""
    import kernels

    folder = REPO / "packages" / package / "build"
    if not (folder / darwin_variant() / "metadata.json").is_file():
        raise RuntimeError(f"{package} has no {darwin_variant()} variant: run `nox -s mac` (builds it) on a Mac")
    if not torch.backends.mps.is_available():
        raise RuntimeError("torch reports no MPS device: the mps build kind runs on an Apple-silicon Mac only")
    return OnDevice(kernels.get_local_kernel(Path(folder), backend="metal"), "mps")


class OnDevice:
    """A package module whose op calls take CPU tensors and run on `device` (see the module's text).
    Attributes that are no function (submodules, classes, constants) and names starting with "_"
    are the module's own."""

    def __init__(self, module, device: str | torch.device):
        self._module = module
        self._device = torch.device(device)

    def __getattr__(self, name: str):
        found = getattr(self._module, name)
        if name.startswith("_") or name in NOT_OPS or not callable(found) or isinstance(found, type) or hasattr(found, "__path__"):
            return found

        def call(*args, **kwargs):
            return on_device(self._device, found, *args, **kwargs)

        call.__name__ = name
        return call

    def __dir__(self):
        return dir(self._module)

    def __repr__(self):
        return f"OnDevice({self._module!r}, {str(self._device)!r})"


def on_device(device: torch.device, fn, *args, **kwargs):
    """fn on copies of the arguments' storages on `device`; written storages copied back, tensor
    results returned on the CPU."""
    storages: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
    moved_args, moved_kwargs = _to_device(args, device, storages), _to_device(kwargs, device, storages)
    result = fn(*moved_args, **moved_kwargs)
    for host, copy in storages.values():
        host.copy_(copy)
    return _to_cpu(result)


def _to_device(value, device: torch.device, storages: dict):
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        host = value.untyped_storage()
        key = host.data_ptr() if host.nbytes() else id(value)  # empty storages share no memory
        if key not in storages:
            copy = torch.empty(host.nbytes(), dtype=torch.uint8, device=device)
            copy.copy_(torch.empty(0, dtype=torch.uint8).set_(host))
            storages[key] = (host, copy.untyped_storage())
        copy = storages[key][1]
        return torch.empty(0, dtype=value.dtype, device=device).set_(copy, value.storage_offset(), value.size(), value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, storages) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device, storages) for k, v in value.items()}
    return value


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.to("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value

"""Helpers for tests of the Metal builds of the packages: loading them as users would, running an op
under both lane schedules of the emulator, and checking the MPS device layer's Linux twin against
the emulated build.

The Metal build kinds made here (tools/build/build.py), all on CPU tensors:
- "metal-emu" (packages/<name>/build-metal-emu/): upstream's Metal host code and kernels on the
  emulated device;
- "mps-emu" (packages/<name>/build-mps-emu/): the MPS device layer over metal-cpp and the fake Metal
  framework, whose committed dispatches run on the emulator. load_metal() gives it as a proxy whose
  every call also runs on build-metal-emu and must give the same bits and dispatch the same kernels.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tools import REPO

# kind -> the build folder of a package (packages/<name>/<folder>/<variant>/)
METAL_BUILDS = {"metal-emu": "build-metal-emu", "mps-emu": "build-mps-emu"}
# what a module exports about its own dispatches: run on the build asked for only
INSTRUMENTATION = frozenset({"metal_dispatches", "reset_metal_dispatches", "info"})


def load(package: str, folder: str):
    """One build of a package through kernels.get_local_kernel; a missing build fails the test (a
    failed build must not pass as skipped tests)."""
    import kernels

    path = REPO / "packages" / package / folder
    if not any(path.glob("torch*-cpu-*")):
        pytest.fail(f"{package} has no {folder} build: run `nox -s build`")
    return kernels.get_local_kernel(Path(path), backend="cpu")


def build_fixture(name: str, package: str, folder: str):
    """A module-scoped fixture `name` holding one build of a package."""
    return pytest.fixture(scope="module", name=name)(lambda: load(package, folder))


def load_metal(package: str, kind: str):
    """A package's Metal build of `kind` (a key of METAL_BUILDS). "mps-emu" comes as a TwinChecked
    proxy: each of its op calls is checked against build-metal-emu."""
    if kind not in METAL_BUILDS:
        raise ValueError(f"no Metal build kind {kind!r} (only {', '.join(METAL_BUILDS)})")
    module = load(package, METAL_BUILDS[kind])
    if kind == "mps-emu":
        return TwinChecked(module, load(package, METAL_BUILDS["metal-emu"]))
    return module


def metal_fixture(name: str, package: str, kinds: tuple[str, ...] = tuple(METAL_BUILDS)):
    """A module-scoped fixture `name` parametrized over the Metal build kinds (ids "metal-emu",
    "mps-emu"): every test using it runs on each build, the twin checked against metal-emu."""

    def fixture(request):
        return load_metal(package, request.param)

    return pytest.fixture(scope="module", name=name, params=list(kinds), ids=list(kinds))(fixture)


class TwinChecked:
    """build-mps-emu's module (attributes, submodules, _metal_emu: the twin's own) whose every
    public function call (its `ops` namespace's too) also runs on build-metal-emu with copies of
    the arguments: results and
    arguments an op writes must be bit-identical, the kernels dispatched the same (names and
    threadgroups), an error the same type."""

    def __init__(self, twin, emulated, runtimes=None):
        self._twin = twin
        self._emulated = emulated
        # the modules' instrumentation (_metal_emu), kept when this wraps their `ops` namespace
        self._runtimes = runtimes or (twin._metal_emu, emulated._metal_emu)

    def __getattr__(self, name: str):
        ours = getattr(self._twin, name)
        if isinstance(ours, torch._ops._OpNamespace):  # module.ops.<op>(...): checked as well
            return TwinChecked(ours, getattr(self._emulated, name), self._runtimes)
        if name.startswith("_") or name in INSTRUMENTATION or not _is_function(ours):
            return ours
        return functools.partial(_checked_call, name, ours, getattr(self._emulated, name), *self._runtimes)

    def __dir__(self):
        return dir(self._twin)

    def __repr__(self):
        return f"TwinChecked({self._twin!r})"


def _is_function(obj) -> bool:
    return callable(obj) and not isinstance(obj, type) and not hasattr(obj, "__path__")


def _copies(value, storages: dict | None = None):
    """The arguments again, each tensor over a copy of its storage at the same offset and strides,
    tensors that shared a storage sharing the copy (an op may write into them; the layer binds
    storages at offsets)."""
    storages = {} if storages is None else storages
    if isinstance(value, torch.Tensor) and value.device.type == "meta":  # no memory to share
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        copy = storages.setdefault(storage.data_ptr(), storage.clone())
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            copy, value.storage_offset(), value.size(), value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_copies(v, storages) for v in value)
    if isinstance(value, dict):
        return {k: _copies(v, storages) for k, v in value.items()}
    return value


def _leaves(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for k in sorted(value, key=str) for x in _leaves(value[k])]
    return [value]


def _same(ours, theirs, what: str) -> None:
    a, b = _leaves(ours), _leaves(theirs)
    assert len(a) == len(b), f"{what}: {len(a)} values on the twin, {len(b)} on metal-emu"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, f"{what}[{i}]"
            assert x.device == y.device, f"{what}[{i}]: on {x.device} on the twin, {y.device} on metal-emu"
            if x.device.type != "meta":  # fake (meta) calls give shapes and dtypes only
                assert torch.equal(bits(x), bits(y)), f"{what}[{i}]: the twin's bits differ from metal-emu's"
        else:
            assert x == y, f"{what}[{i}]: {x!r} on the twin, {y!r} on metal-emu"


def _dispatched_during(runtime, fn):
    """(fn()'s result or exception, {kernel: threadgroups} it dispatched)."""
    before = runtime.metal_dispatches()
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - compared with the other build's, then raised
        result, error = None, e
    after = runtime.metal_dispatches()
    grown = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    return result, error, grown


def _checked_call(name, ours, theirs, our_runtime, their_runtime, *args, **kwargs):
    storages: dict = {}
    their_args, their_kwargs = _copies(args, storages), _copies(kwargs, storages)
    result, error, kernels = _dispatched_during(our_runtime, lambda: ours(*args, **kwargs))
    expected, their_error, their_kernels = _dispatched_during(their_runtime, lambda: theirs(*their_args, **their_kwargs))
    if error is not None or their_error is not None:
        assert type(error) is type(their_error), f"{name}: {error!r} on the twin, {their_error!r} on metal-emu"
        raise error
    _same(result, expected, f"{name} result")
    _same((args, kwargs), (their_args, their_kwargs), f"{name} arguments")
    assert kernels == their_kernels, f"{name}: the twin dispatched {kernels}, metal-emu {their_kernels}"
    return result


def both_schedules(module, fn, *args, overruns: frozenset[str] = frozenset(), **kwargs):
    """fn(*args, **kwargs) under the forward and the reverse lane schedule: bit-identical results,
    and the kernels dispatched ({name: threadgroups}, one schedule's). No dispatch may write past
    its threadgroup memory but those of kernels whose names start with one of `overruns`
    (upstream findings)."""
    runtime = module._metal_emu
    results = []
    try:
        for reverse in (False, True):
            runtime.set_lane_schedule(reverse)
            runtime.reset_metal_dispatches()
            results.append(fn(*args, **kwargs))
            records = runtime.metal_dispatch_records()
            if not reverse:
                dispatched = runtime.metal_dispatches()
            overran = {r["kernel"] for r in records if r["threadgroup_overrun"] and not r["kernel"].startswith(tuple(overruns))}
            assert not overran, f"kernels wrote past their threadgroup memory: {overran}"
    finally:
        runtime.set_lane_schedule(False)
    first, second = (r if isinstance(r, (list, tuple)) else [r] for r in results)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(bits(a), bits(b))
    return results[0], dispatched


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (NaN payloads included), whatever its strides (flat: a dense tensor may keep any
    stride on a dim of size 1, which a byte view refuses)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t

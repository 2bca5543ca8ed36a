"""Helpers for tests of the emulated-Metal builds (packages/<name>/build-metal-emu/): loading them
as users would, and running an op under both lane schedules of the emulator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tools import REPO


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
    """t's bytes (NaN payloads included), whatever its strides."""
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t

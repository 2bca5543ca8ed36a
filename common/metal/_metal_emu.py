"""The emulated-Metal builds' instrumentation: which kernels upstream's Metal host code dispatched,
and the emulator's lane schedule. tools/build/build.py copies this file into build-metal-emu/ and
build-mps-emu/ builds only (never into a CPU build, never onto the Hub), beside the ops it wraps
(common/metal/metal_emu_ops.cpp, common/metal/mps_emu/mps_emu_ops.cpp: the same names); a
package's __init__ re-exports `metal_dispatches` / `reset_metal_dispatches` from it where it is
present."""

from __future__ import annotations

import json

from ._ggml_runtime import BACKEND
from ._ops import ops


def metal_dispatches() -> dict[str, int]:
    """{kernel name: threadgroups dispatched} since the build was loaded or reset_metal_dispatches()
    last ran, as upstream's host code encoded them (e.g. {"kernel_mul_mv_ext_q4_K_f32_r1_4": 12})."""
    return json.loads(ops.metal_threadgroups_json())


def metal_dispatch_records() -> list[dict]:
    """Every dispatch since the last reset (the first 20000): kernel, pipeline, function constants,
    grid, threads per threadgroup, threadgroup memory, bindings, and the bytes the kernel wrote past
    its threadgroup memory on the emulator (threadgroup_overrun)."""
    records = json.loads(ops.metal_dispatches_json())
    if BACKEND == "mps-emu":
        # the device layer logs what it encoded; the fake framework ran it on its emulator, and
        # says per kernel (its emulator is shared by every build in the process) what overran
        overruns = json.loads(ops.metal_threadgroup_overruns_json())
        for r in records:
            r["threadgroup_overrun"] = overruns.get(r["kernel"], 0)
    return records


def reset_metal_dispatches() -> None:
    """Start metal_dispatches() from zero."""
    ops.metal_reset_dispatches()


def set_lane_schedule(reverse: bool, lane_zero_convergence: bool = True) -> None:
    """The order in which the lanes of a SIMD group run between two rendezvous points (forward or
    reverse). Kernels that are correct on a GPU give bit-identical results in both; tests run each
    op under both. lane_zero_convergence=False drops the rendezvous the emulator puts around
    `if (tiisg == 0)` branches (a GPU's lock-step gives them for free), to show the kernels that
    rely on it."""
    ops.metal_set_lane_schedule(int(bool(reverse)) | (0 if lane_zero_convergence else 2))

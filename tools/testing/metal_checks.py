"""Checks every package's Metal tests share: what an emulated build carries and what its CPU build
(the one the Hub gets) must not."""

from __future__ import annotations

import ctypes
from pathlib import Path

# the emulator's instrumentation: the Python API and the ops (common/metal/metal_emu_ops.cpp)
INSTRUMENTATION = {"metal_dispatches", "reset_metal_dispatches"}
EMULATOR_OPS = ["metal_threadgroups_json", "metal_dispatches_json", "metal_reset_dispatches", "metal_set_lane_schedule"]


def assert_emulated_build_has_no_ggml_cpu(metal_emu, cpu) -> None:
    """build-metal-emu's runtime holds ggml-base and upstream's Metal backend only: no op could fall
    back to ggml's CPU backend unnoticed."""
    info = metal_emu.info()
    assert info["backend"] == "metal-emu" and info["cpu_variant"] == ""
    assert Path(info["runtime"]).name == "libggml-kernels-metal-emu.so"
    assert "build-metal-emu" in info["runtime"]
    lib = ctypes.CDLL(info["runtime"], mode=ctypes.RTLD_LOCAL)
    assert hasattr(lib, "ggml_backend_metal_init")
    assert not hasattr(lib, "ggml_graph_compute") and not hasattr(lib, "ggml_backend_cpu_reg")
    assert cpu.info()["backend"] == "cpu"


def assert_instrumentation_only_in_emulated_build(metal_emu, cpu) -> None:
    """The emulator's dispatch log and lane schedules are the emulated build's: the CPU build has
    none of them, in its API, its modules or its extension."""
    assert INSTRUMENTATION <= set(metal_emu.__all__) and all(hasattr(metal_emu, n) for n in INSTRUMENTATION)
    assert hasattr(metal_emu, "_metal_emu") and hasattr(metal_emu._metal_emu, "set_lane_schedule")
    assert not INSTRUMENTATION & set(cpu.__all__) and not any(hasattr(cpu, n) for n in INSTRUMENTATION)
    assert not hasattr(cpu, "_metal_emu")
    extension = getattr(cpu._ops, cpu._ops.ops.name)
    assert [n for n in dir(extension) if n.startswith("metal_")] == []
    assert all(hasattr(metal_emu._ops.ops, n) for n in EMULATOR_OPS)
    assert not any(hasattr(cpu._ops.ops, n) for n in EMULATOR_OPS)

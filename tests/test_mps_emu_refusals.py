"""The fake Metal framework's refusals, reached through a package build from Python.

tests/test_mps_emu_fake.py checks each refusal on the framework alone; here one is provoked through
ggml-quantization's build-mps-emu/ (upstream's host code, the MPS backend and device layer, the fake
framework) as users call it. The fake's test hook GGML_KERNELS_FAKE_METAL_THREADGROUP_MEMORY
(common/metal/mps_emu/fake_mps.h) lowers the threadgroup memory it lets a kernel use while the
device still reports 32 KiB, so upstream's host code encodes its matrix-matrix kernel as usual and
the fake refuses its setThreadgroupMemoryLength, as a GPU with less threadgroup memory would. The
op must raise a RuntimeError naming the refusal (no crash, no hang), and once the hook is lifted the
same call must work again in the same process, giving build-metal-emu's bits.
"""

from __future__ import annotations

import json

import pytest
import torch

from tools.testing.metal_builds import METAL_BUILDS, load

HOOK = "GGML_KERNELS_FAKE_METAL_THREADGROUP_MEMORY"  # fake_mps.h: kThreadgroupMemoryLimitEnv
OUT_FEATURES = 64


@pytest.fixture(scope="module")
def twin():
    return load("ggml-quantization", METAL_BUILDS["mps-emu"])


@pytest.fixture(scope="module")
def case():
    """A Q4_0 weight (quantized by the CPU build) and 16 activation rows: upstream takes its
    matrix-matrix kernel (kernel_mul_mm_*), which uses 8 KiB of threadgroup memory, over 8 rows."""
    cpu = load("ggml-quantization", "build")
    g = torch.Generator().manual_seed(11)
    t = int(cpu.types.GGMLType["Q4_0"])
    blocks = cpu.quantize(torch.randn(OUT_FEATURES, 256, generator=g), t)
    return blocks, torch.randn(16, 256, generator=g), t


def _mul_mat(module, case):
    blocks, x, t = case
    return module.mul_mat(blocks, x, t, OUT_FEATURES, exact=True)


def _live(module) -> dict[str, int]:
    return json.loads(module._ops.ops.fake_metal_live_objects_json())


def test_threadgroup_memory_over_the_device_limit_is_a_python_error_then_works_again(twin, case, monkeypatch):
    expected = _mul_mat(load("ggml-quantization", METAL_BUILDS["metal-emu"]), case)
    twin.reset_metal_dispatches()
    assert torch.equal(_mul_mat(twin, case), expected)
    assert any(k.startswith("kernel_mul_mm_q4_0") for k in twin.metal_dispatches()), twin.metal_dispatches()
    live = _live(twin)

    monkeypatch.setenv(HOOK, "1024")
    with pytest.raises(RuntimeError, match=r"fake Metal: -\[MTLComputeCommandEncoder setThreadgroupMemoryLength:atIndex:\]: "
                                           r"\d+ bytes, over the device's 1024-byte threadgroup memory"):
        _mul_mat(twin, case)
    monkeypatch.setenv(HOOK, "32768")  # the device's own limit: no refusal
    assert torch.equal(_mul_mat(twin, case), expected)
    monkeypatch.delenv(HOOK)
    assert torch.equal(_mul_mat(twin, case), expected)
    assert _live(twin) == live  # the refused call left no Metal object behind


@pytest.mark.parametrize("value", ["lots", "0", "-5", "32769", "8k"])
def test_a_bad_hook_value_is_refused_by_name(twin, case, monkeypatch, value):
    monkeypatch.setenv(HOOK, value)
    with pytest.raises(RuntimeError, match=f"{HOOK}={value}: not a byte count from 1 to 32768"):
        _mul_mat(twin, case)
    monkeypatch.delenv(HOOK)
    assert _mul_mat(twin, case).shape == (16, OUT_FEATURES)


def test_ops_without_threadgroup_memory_are_not_affected(twin, case, monkeypatch):
    """A single row takes the matrix-vector kernel for Q4_0, which upstream gives 0 bytes of
    threadgroup memory: the hook refuses only what goes over it."""
    blocks, x, t = case
    expected = twin.mul_mat_vec(blocks, x[:1], t, OUT_FEATURES)
    monkeypatch.setenv(HOOK, "1024")
    twin.reset_metal_dispatches()
    assert torch.equal(twin.mul_mat_vec(blocks, x[:1], t, OUT_FEATURES), expected)
    assert all(not k.startswith("kernel_mul_mm") for k in twin.metal_dispatches())

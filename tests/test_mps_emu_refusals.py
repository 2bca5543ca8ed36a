"""The fake Metal framework's refusals, reached through package builds from Python.

tests/test_mps_emu_fake.py checks each refusal on the framework alone; here one is provoked through
the build-mps-emu/ builds of ggml-quantization and ggml-attn (upstream's host code, the MPS backend
and device layer, the fake framework) as users call them. The fake's test hook
GGML_KERNELS_FAKE_METAL_THREADGROUP_MEMORY (common/metal/mps_emu/fake_mps.h) lowers the threadgroup
memory it lets a kernel use while the device still reports 32 KiB, so upstream's host code encodes
as usual and the fake refuses the setThreadgroupMemoryLength, as a GPU with less threadgroup memory
would. The op must raise a RuntimeError naming the refusal (no crash, no hang), and once the hook is
lifted the same call must work again in the same process, giving build-metal-emu's bits, with no
Metal object left behind.
"""

from __future__ import annotations

import ctypes
import json

import pytest
import torch

from tools.build import mps_runtime
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


def _flash_attn(module, _case):
    """3 query rows: upstream's vec kernel (1 KiB of threadgroup memory) and its reduce, after a
    kernel that pads the 40 keys; the refusal comes after that first dispatch was encoded."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, s, 64, generator=g) for h, s in ((4, 3), (2, 40), (2, 40)))
    return module.flash_attn(q, k, v)


def _live(module) -> dict[str, int]:
    return json.loads(module._ops.ops.fake_metal_live_objects_json())


def _fake_framework() -> ctypes.CDLL:
    """The fake framework this process runs (one per process: the copy beside the first twin build
    loaded; opening another copy would register its classes twice), for its C API."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if line.rstrip().endswith("/" + mps_runtime.LIBRARY)}
    assert len(paths) == 1, paths
    lib = ctypes.CDLL(paths.pop())  # the loaded copy: dlopen hands back its handle
    lib.gk_fake_metal_dispatches_json.restype = ctypes.c_size_t
    return lib


def _committed(lib: ctypes.CDLL) -> list[str]:
    """The kernels the fake ran (committed) since its last reset, in order."""
    size = lib.gk_fake_metal_dispatches_json(None, 0)
    text = ctypes.create_string_buffer(size + 1)
    lib.gk_fake_metal_dispatches_json(text, size + 1)
    return [d["kernel"] for d in json.loads(text.value)]


# package, its call, the hook's limit, the refused length, a kernel the call dispatches
REFUSALS = {
    "mul_mat": ("ggml-quantization", _mul_mat, 1024, 8192, "kernel_mul_mm_q4_0"),
    "flash_attn": ("ggml-attn", _flash_attn, 256, 1024, "kernel_flash_attn_ext_vec"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_threadgroup_memory_over_the_device_limit_is_a_python_error_then_works_again(name, case, monkeypatch):
    package, call, limit, length, kernel = REFUSALS[name]
    module = load(package, METAL_BUILDS["mps-emu"])
    expected = call(load(package, METAL_BUILDS["metal-emu"]), case)
    fake = _fake_framework()
    fake.gk_fake_metal_reset()
    assert torch.equal(call(module, case), expected)
    ran = _committed(fake)
    assert any(k.startswith(kernel) for k in ran), ran
    live = _live(module)

    monkeypatch.setenv(HOOK, str(limit))
    fake.gk_fake_metal_reset()
    with pytest.raises(RuntimeError, match=r"fake Metal: -\[MTLComputeCommandEncoder setThreadgroupMemoryLength:atIndex:\]: "
                                           rf"{length} bytes, over the device's {limit}-byte threadgroup memory"):
        call(module, case)
    # what was encoded before the refused dispatch ran within the refused call, on its own memory
    refused = _committed(fake)
    assert refused == ran[:len(refused)] and len(refused) < len(ran), (refused, ran)
    monkeypatch.setenv(HOOK, "32768")  # the device's own limit: no refusal
    assert torch.equal(call(module, case), expected)
    monkeypatch.delenv(HOOK)
    fake.gk_fake_metal_reset()
    assert torch.equal(call(module, case), expected)
    assert _committed(fake) == ran  # nothing of the refused call's was left to run with the next
    assert _live(module) == live  # the refused call left no Metal object behind


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

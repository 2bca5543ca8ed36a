"""Every package's build-mps-emu/ (tools/build/build.py's "mps-emu" kind): the MPS backend and device
layer of the darwin build, on the Linux twin (the fake Metal framework, whose committed dispatches run
on its own emulator; CPU tensors as the MPS storages). Loaded as users load a build; a few ops per
package through metal_builds.TwinChecked, which runs each call on build-metal-emu too: the same bits
and the same kernels dispatched are required; the fake framework's checks are on and no Metal object
outlives a call."""

from __future__ import annotations

import json

import pytest
import torch

from tools import REPO
from tools.build import build, mps_runtime, package_spec
from tools.testing.metal_builds import METAL_BUILDS, both_schedules, load, load_metal

FOLDER = METAL_BUILDS["mps-emu"]
METAL_PACKAGES = [p for p in build.packages() if package_spec.load(REPO / "packages" / p).kernels_of("metal")]
TWIN_LIBRARIES = {mps_runtime.TWIN_RUNTIME, mps_runtime.LIBRARY, mps_runtime.OBJC_RUNTIME}


@pytest.fixture(scope="module", params=METAL_PACKAGES)
def twin(request):
    return request.param, load(request.param, FOLDER)


def live_objects(module) -> dict[str, int]:
    return json.loads(module._ops.ops.fake_metal_live_objects_json())


def test_every_package_with_a_metal_entry_gets_the_twin_build():
    assert METAL_PACKAGES == build.packages()  # every package has one today
    for package in METAL_PACKAGES:
        assert "mps-emu" in build.kinds_of(package_spec.load(REPO / "packages" / package))


def test_the_build_loads_the_twin_runtime_from_beside_itself(twin):
    package, module = twin
    info = module.info()
    assert info["backend"] == "mps-emu", info
    variant = REPO / "packages" / package / FOLDER / build.torch_variant()
    assert info["runtime"] == str(variant / mps_runtime.TWIN_RUNTIME)
    assert TWIN_LIBRARIES <= {p.name for p in variant.iterdir()}
    # the framework beside it is the one tests/test_mps_emu_fake.py checks (same bytes)
    assert (variant / mps_runtime.LIBRARY).read_bytes() == (mps_runtime.out_dir() / mps_runtime.LIBRARY).read_bytes()
    assert {"metal_dispatches", "reset_metal_dispatches"} <= set(module.__all__)


def test_dispatch_log_and_instrumentation_work(twin):
    package, module = twin
    module.reset_metal_dispatches()
    assert module.metal_dispatches() == {}
    assert module._metal_emu.metal_dispatch_records() == []
    module._metal_emu.set_lane_schedule(True)
    module._metal_emu.set_lane_schedule(False)


def test_a_bad_lane_schedule_call_is_a_python_error(twin):
    _, module = twin
    with pytest.raises(TypeError):
        module._metal_emu.set_lane_schedule()


# ---- ops per package, each call checked against build-metal-emu (TwinChecked) ----

@pytest.fixture(scope="module")
def norm():
    return load_metal("ggml-norm", "mps-emu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_with_weights_and_bias(norm, dtype):
    """The weight and bias converted to float32 (and 1 + w) by torch ops into tensors the layer
    binds (an MPS build binds only torch storages)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(9, 2048, generator=g).to(dtype), torch.randn(2048, generator=g).to(dtype), torch.randn(2048, generator=g)
    y, kernels = both_schedules(norm, norm.rms_norm, x, w, 1e-6, True, b)
    assert y.dtype == dtype and any(k.startswith("kernel_rms_norm") for k in kernels), kernels

    def calls():
        norm.rms_norm(x[:, :1000], w[:1000])  # strided input
        norm.rms_norm_gated(x, x.flip(0), w)

    calls()  # the device, queue, libraries and pipelines are made once and kept (as on a Mac)
    before = live_objects(norm)
    calls()
    assert live_objects(norm) == before  # nothing leaked across the calls


@pytest.fixture(scope="module")
def quant():
    return load_metal("ggml-quantization", "mps-emu")


@pytest.mark.parametrize("rows", [1, 16])
def test_q4_k_mul_mat_vec_and_mul_mat(quant, rows):
    t = int(quant.types.GGMLType["Q4_K"])
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 512, generator=g)
    blocks = load("ggml-quantization", "build").quantize(w, t, imatrix=torch.ones(512))  # ggml-cpu's quantizers
    x = torch.randn(rows, 512, generator=g)
    y, kernels = both_schedules(quant, quant.mul_mat_vec if rows == 1 else quant.mul_mat, blocks, x, t, 64)
    assert any("q4_K" in k for k in kernels), kernels


def test_topk_routing():
    tk = load_metal("topk", "mps-emu")
    x = 3 * torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    (w, i), kernels = both_schedules(tk, tk.ops.top_k, x, 4, True, True, None, None)
    assert "kernel_topk_moe_f32" in kernels, kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_attn(dtype):
    ga = load_metal("ggml-attn", "mps-emu")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, s, 64, generator=g).to(dtype) for h, s in ((4, 3), (2, 40), (2, 40)))
    out, kernels = both_schedules(ga, ga.flash_attn, q, k, v)
    assert any(k.startswith("kernel_flash_attn_ext") for k in kernels), kernels


def test_gated_delta_net():
    gdn = load_metal("ggml-gated-delta-net", "mps-emu")
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 2, 64, generator=g) / 8 for _ in range(2))
    v = torch.randn(1, 2, 4, 64, generator=g)
    gate, beta = -torch.rand(1, 2, 4, generator=g), torch.rand(1, 2, 4, generator=g)
    state = 0.1 * torch.randn(1, 4, 64, 64, generator=g)
    (out, new_state), kernels = both_schedules(gdn, gdn.ops.gated_delta_net, q, k, v, gate, beta, state, True, None)
    assert "kernel_gated_delta_net_f32_2" in kernels, kernels


def test_an_op_error_on_the_twin_is_a_python_error_not_a_crash(norm):
    with pytest.raises(ValueError, match="weight must be 1-D"):
        norm.rms_norm(torch.randn(3, 8), torch.randn(7))

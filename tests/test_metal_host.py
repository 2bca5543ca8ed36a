"""Upstream's Metal host code on Linux (tools/build/metal_runtime.py, common/metal/): the library
builds from the pinned sources, `ggml_backend_metal_init()` is upstream's backend over our device
layer, and what it encodes for a graph (kernel, pipeline with its function constants, grid,
threadgroup memory, bindings) is upstream's choice. The dispatches are recorded, not yet executed
(the emulated device that runs the translated shaders comes next), so no test here compares values.

The expected kernel names and grids are facts of the pinned ggml (b11312)'s ggml-metal-ops.cpp:
Q4_K products take `kernel_mul_mv_*` for 1-3 rows, `kernel_mul_mv_ext_*_r1_<rows per group>` for
4-8 and `kernel_mul_mm_*` (32 x 64 output tiles, 8 KiB of threadgroup memory) above 8."""

from __future__ import annotations

import ctypes

import pytest

from tools.build import metal_runtime
from tools.testing.metal_host import Graph, MetalHost, library_path

F32, Q4_K, Q8_0, TQ1_0 = 0, 12, 8, 34  # ggml.h's enum ggml_type


@pytest.fixture(scope="module")
def host():
    if not library_path().exists():
        pytest.fail(f"{library_path()} is missing: `python -m tools.build` builds it with the ggml runtime")
    return MetalHost()


def product(host, weight_type, k, n, rows):
    return host.compute(lambda g: g.mul_mat(g.tensor(weight_type, k, n), g.tensor(F32, k, rows)))


def test_the_backend_is_upstreams_metal_backend_on_our_device(host):
    assert host.name() == "MTL0"


@pytest.mark.parametrize(
    "rows,kernel",
    [(1, "kernel_mul_mv_q4_K_f32"), (3, "kernel_mul_mv_q4_K_f32"), (4, "kernel_mul_mv_ext_q4_K_f32_r1_4"),
     (5, "kernel_mul_mv_ext_q4_K_f32_r1_5"), (8, "kernel_mul_mv_ext_q4_K_f32_r1_4"), (9, "kernel_mul_mm_q4_K_f32"),
     (12, "kernel_mul_mm_q4_K_f32")],
)
def test_q4_k_products_take_upstreams_kernel_for_their_row_count(host, rows, kernel):
    found = product(host, Q4_K, 4096, 1024, rows)
    assert found.supported
    assert [d["kernel"] for d in found.dispatches] == [kernel]
    d = found.dispatches[0]
    assert d["pipeline"].startswith(kernel)  # plus the function-constant suffix
    if kernel.startswith("kernel_mul_mm"):
        assert d["grid"] == [1, 1024 // 64, 1] and d["threads"] == [32, 4, 1]
        assert d["threadgroup_memory"] == {"0": 8192}
    else:
        assert d["threads"] == [32, 2, 1]


def test_a_dispatch_binds_the_arguments_upstream_sets(host):
    """kargs as bytes at index 0, then src0, src1 and dst at their offsets in the Metal buffer."""
    (d,) = product(host, Q8_0, 256, 64, 1).dispatches
    assert d["kernel"] == "kernel_mul_mv_q8_0_f32"
    assert "bytes" in d["buffers"]["0"]
    ids = {d["buffers"][i][0] for i in ("1", "2", "3")}
    assert len(ids) == 1 and 0 not in ids  # one buffer (the context's tensors), a real one
    assert d["buffers"]["1"][1] != d["buffers"]["2"][1] != d["buffers"]["3"][1]


def test_rms_norm_and_a_multiply_dispatch_in_graph_order(host):
    found = host.compute(lambda g: g.mul(g.rms_norm(g.tensor(F32, 1024, 3)), g.tensor(F32, 1024, 1)))
    kernels = [d["kernel"] for d in found.dispatches]
    # upstream fuses rms_norm + mul into one kernel (ggml-metal-fusion.cpp) unless fusion is off
    assert kernels in (["kernel_rms_norm_mul_f32_4"], ["kernel_rms_norm_f32_4", "kernel_bin_fuse_f32_f32_f32"]), kernels


def test_supports_op_is_upstreams(host):
    """Cut from ggml-metal-device.m at build time: no Metal kernel takes TQ1_0 weights."""
    found = product(host, TQ1_0, 256, 16, 1)
    assert not found.supported and found.dispatches == []


def test_tensor_data_are_device_addresses_not_host_pointers(host):
    """A tensor's data pointer is a device address (non-canonical on x86-64), so upstream host code
    that dereferenced it would fault, as on a private GPU buffer; transfers go through the backend."""
    lib = host.lib
    g = Graph(lib)
    t = g.tensor(F32, 8)
    buffer = lib.ggml_backend_alloc_ctx_tensors(g.ctx, host.backend)
    try:
        assert lib.ggml_get_data(t) >= 1 << 62
        data = (ctypes.c_float * 8)(*range(8))
        lib.ggml_backend_tensor_set(t, data, 0, ctypes.sizeof(data))
        back = (ctypes.c_float * 8)()
        lib.ggml_backend_tensor_get(t, back, 0, ctypes.sizeof(back))
        assert list(back) == list(range(8))
    finally:
        lib.ggml_backend_buffer_free(buffer)
        lib.ggml_free(g.ctx)


def test_the_supports_op_cut_fails_loudly_when_upstream_moves_its_markers():
    text = f"x\n{metal_runtime.SLICE_START}\n}}\n{metal_runtime.SLICE_ENTRY}\n    return false;\n}}\n"
    assert metal_runtime.slice_supports_op(text).endswith("    return false;\n}\n")
    with pytest.raises(ValueError, match="ggml-metal-device.m changed"):
        metal_runtime.slice_supports_op(text.replace(metal_runtime.SLICE_ENTRY, "bool renamed(void) {"))

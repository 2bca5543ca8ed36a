"""Upstream's Metal host code on Linux (tools/build/metal_runtime.py, common/metal/): the library
builds from the pinned sources, `ggml_backend_metal_init()` is upstream's backend over our device
layer, and what it encodes for a graph (kernel, pipeline with its function constants, grid,
threadgroup memory, bindings) is upstream's choice. Kernels of the files translated so far
(metal_translate.KERNEL_FILES) run on the emulated device and are checked against numpy; the
choice tests only log dispatches (execute=False), so they cover kernels not translated yet.

The expected kernel names and grids are facts of the pinned ggml (b11312)'s ggml-metal-ops.cpp:
Q4_K products take `kernel_mul_mv_*` for 1-3 rows, `kernel_mul_mv_ext_*_r1_<rows per group>` for
4-8 and `kernel_mul_mm_*` (32 x 64 output tiles, 8 KiB of threadgroup memory) above 8."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from tools.build import metal_runtime, upstream
from tools.testing.metal_host import Graph, MetalHost, library_path

F32, F16, Q4_K, Q8_0, I32, TQ1_0 = 0, 1, 12, 8, 26, 34  # ggml.h's enum ggml_type


@pytest.fixture(scope="module")
def host():
    if not library_path().exists():
        pytest.fail(f"{library_path()} is missing: `python -m tools.build` builds it with the ggml runtime")
    return MetalHost()


def product(host, weight_type, k, n, rows):
    return host.compute(lambda g: g.mul_mat(g.tensor(weight_type, k, n), g.tensor(F32, k, rows)), execute=False)


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
    found = host.compute(lambda g: g.mul(g.rms_norm(g.tensor(F32, 1024, 3)), g.tensor(F32, 1024, 1)), execute=False)
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


def test_the_device_api_lists_every_function_upstream_writes_in_objective_c():
    """metal_device_api.h's list (what a device layer defines; the runtime fails to link without one)
    is every function of ggml-metal-device.h / -context.h but upstream's C++ and the cut supports_op."""
    metal = upstream.ggml_tree() / "src" / "ggml-metal"
    declared = {name for h in ("ggml-metal-device.h", "ggml-metal-context.h")
                for name in re.findall(r"\b(ggml_metal_\w+)\s*\(", (metal / h).read_text())}
    upstream_cpp = set(re.findall(r"^[A-Za-z].*?\b(ggml_metal_\w+)\s*\([^;]*$",
                                  (metal / "ggml-metal-device.cpp").read_text(), re.M)) & declared
    listed = re.findall(r"X\((ggml_metal_\w+)\)", (metal_runtime.METAL_DIR / "metal_device_api.h").read_text())
    assert len(listed) == len(set(listed))
    assert set(listed) == declared - upstream_cpp - {"ggml_metal_device_supports_op"}


# ---- the emulated device: upstream's kernels translated to C++ and run, each GPU thread a fiber ----
# Values against float64 numpy: a row's sum of squares is reduced in float32 by 32-lane SIMD sums and a
# threadgroup sum (~log2(n) roundings), so 1e-6 relative to the row's scale bounds it with a margin
# (observed ~2e-7). The two lane schedules must agree bit for bit.


def rms_norm_ref(x, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)


def ran(host, build, reverse_lanes=False):
    found = host.compute(build, reverse_lanes=reverse_lanes)
    assert found.supported and found.error == "", found.error
    return found


@pytest.mark.parametrize("cols,kernel", [(1024, "kernel_rms_norm_f32_4"), (1023, "kernel_rms_norm_f32"), (40, "kernel_rms_norm_f32_4")])
def test_rms_norm_runs_upstreams_kernel_on_the_emulated_device(host, cols, kernel):
    x = np.random.default_rng(cols).standard_normal((3, cols)).astype(np.float32)

    def build(g):
        return g.rms_norm(g.input(F32, x.tobytes(), cols, 3), 1e-6)

    forward, reverse = ran(host, build), ran(host, build, reverse_lanes=True)
    assert [d["kernel"] for d in forward.dispatches] == [kernel]
    y = np.frombuffer(forward.output, np.float32).reshape(3, cols)
    np.testing.assert_allclose(y, rms_norm_ref(x, 1e-6), rtol=0, atol=1e-6 * np.abs(rms_norm_ref(x, 1e-6)).max())
    assert forward.output == reverse.output  # no reliance on lock-step lanes


def test_rms_norm_times_a_weight_runs_fused(host):
    """ggml's rms_norm then mul: upstream's fusion table makes one kernel of it, whose function
    constant (FC_norm_use_scale = false) selects the weight over a scalar scale."""
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    w = np.random.default_rng(2).standard_normal(256).astype(np.float32)
    found = ran(host, lambda g: g.mul(g.rms_norm(g.input(F32, x.tobytes(), 256, 2), 1e-5), g.input(F32, w.tobytes(), 256)))
    assert [d["kernel"] for d in found.dispatches] == ["kernel_rms_norm_mul_f32_4"]
    y = np.frombuffer(found.output, np.float32).reshape(2, 256)
    ref = rms_norm_ref(x, 1e-5) * w
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def test_l2_norm_runs_on_the_emulated_device(host):
    x = np.random.default_rng(3).standard_normal((4, 128)).astype(np.float32)
    found = ran(host, lambda g: g.l2_norm(g.input(F32, x.tobytes(), 128, 4), 1e-6))
    assert [d["kernel"] for d in found.dispatches] == ["kernel_l2_norm_f32_f32_4"]
    y = np.frombuffer(found.output, np.float32).reshape(4, 128)
    x64 = x.astype(np.float64)
    ref = x64 / np.maximum(np.sqrt((x64**2).sum(-1, keepdims=True)), 1e-6)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-6)


# Flash attention: the kernels round q (and the f16 k / v are half already) to half and keep the
# running softmax and output in float: each score is off by ~2^-11 of |q||k| and the output by as
# much of |v|'s scale: 4e-3 of the output scale bounds it.
FLASH_ATTN_TOL = 4e-3


@pytest.mark.parametrize("queries,kernel", [(1, "kernel_flash_attn_ext_vec_f16_dk64_dv64"),
                                            (32, "kernel_flash_attn_ext_f16_dk64_dv64")])
def test_flash_attention_runs_on_the_emulated_device(host, queries, kernel):
    """Decode (one query: the vec kernel) and prefill (the tiled kernel), 4 query heads over 2 KV
    heads, no mask: against numpy in float64, both lane schedules bit-equal. Without a mask the vec
    kernel still computes the mask's address, `iq2 % args.ne32` with ne32 = 0: an integer division
    by zero, undefined but harmless on a GPU; the emulator gives it a GPU's semantics (no trap, the
    result 0, emu_runtime.cpp) instead of the process dying of SIGFPE."""
    d, kv, heads, kv_heads = 64, 32, 4, 2
    rng = np.random.default_rng(queries)
    q = rng.standard_normal((heads, queries, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads, kv, d)).astype(np.float16)
    v = rng.standard_normal((kv_heads, kv, d)).astype(np.float16)
    scale = 1 / np.sqrt(d)

    def build(g):
        return g.flash_attn(g.input(F32, q.tobytes(), d, queries, heads), g.input(F16, k.tobytes(), d, kv, kv_heads),
                            g.input(F16, v.tobytes(), d, kv, kv_heads), None, scale)

    forward, reverse = ran(host, build), ran(host, build, reverse_lanes=True)
    assert kernel in [x["kernel"] for x in forward.dispatches], [x["kernel"] for x in forward.dispatches]
    y = np.frombuffer(forward.output, np.float32).reshape(queries, heads, d)
    kk, vv = (np.repeat(t.astype(np.float64), heads // kv_heads, axis=0) for t in (k, v))  # head h reads KV head h // 2
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), kk) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hqk,hkd->qhd", p / p.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(y, ref, rtol=0, atol=FLASH_ATTN_TOL * np.abs(ref).max())
    assert forward.output == reverse.output


@pytest.mark.parametrize("op", ["mul", "add", "silu"])
def test_element_wise_kernels_run_on_the_emulated_device(host, op):
    """binbcast.metal (a row broadcast over three) and unary.metal: products and sums are exact in
    float32; SiLU goes through exp (1e-6 relative)."""
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((3, 64)).astype(np.float32), rng.standard_normal((1, 64)).astype(np.float32)

    def build(g):
        x = g.input(F32, a.tobytes(), 64, 3)
        return g.silu(x) if op == "silu" else getattr(g, op)(x, g.input(F32, b.tobytes(), 64, 1))

    found = ran(host, build)
    assert [d["kernel"] for d in found.dispatches] == ["kernel_unary_f32_f32_4" if op == "silu" else "kernel_bin_fuse_f32_f32_f32_4"]
    y = np.frombuffer(found.output, np.float32).reshape(3, 64)
    if op == "silu":
        np.testing.assert_allclose(y, a / (1 + np.exp(-a.astype(np.float64))), rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(y, a * b if op == "mul" else a + b)


# Mat-vec (1-3 rows; K-quants 1-3, others 1) and mat-vec-ext (2-8 rows) on every storage type the
# translated mul_mv.metal serves, against gguf-py's dequantization (an independent oracle) and a
# float64 product: the kernels dequantize to float and accumulate in float32 over K = 512 (~sqrt(K)
# roundings of the output's scale), so 1e-5 of the output scale leaves a wide margin (observed < 4e-7).
MAT_VEC_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("type_name", MAT_VEC_TYPES)
def test_mat_vec_kernels_run_on_the_emulated_device(host, type_name, rows):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    k, n = 512, 64
    rng = np.random.default_rng(int(qtype) * 10 + rows)
    w = rng.standard_normal((n, k)).astype(np.float32)
    blocks = w.tobytes() if type_name == "F32" else host.quantize(int(qtype), w)
    dense = gguf.quants.dequantize(np.frombuffer(blocks, np.uint8).reshape(n, -1), qtype).reshape(n, k)
    x = rng.standard_normal((rows, k)).astype(np.float32)

    def build(g):
        return g.mul_mat(g.input(int(qtype), blocks, k, n), g.input(F32, x.tobytes(), k, rows))

    forward, reverse = ran(host, build), ran(host, build, reverse_lanes=True)
    (kernel,) = [d["kernel"] for d in forward.dispatches]
    assert kernel.startswith("kernel_mul_mv_"), kernel
    y = np.frombuffer(forward.output, np.float32).reshape(rows, n)
    ref = x.astype(np.float64) @ dense.T.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert forward.output == reverse.output


def ggml_name(type_name: str) -> str:
    """ggml's type name as kernel names spell it: q4_0, q4_K, bf16."""
    return type_name.lower().replace("_k", "_K")


def dense_weights(host, type_name, rows, cols, seed):
    """Random weights in `type_name` (ggml's quantizer) and their dequantization by gguf-py."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = w.tobytes() if type_name == "F32" else host.quantize(int(qtype), w)
    dense = gguf.quants.dequantize(np.frombuffer(blocks, np.uint8).reshape(rows, -1), qtype).reshape(rows, cols)
    return int(qtype), blocks, dense.astype(np.float64)


# Mat-mat (> 8 rows): upstream's kernel_mul_mm rounds both tiles to half (bfloat for BF16 weights)
# in threadgroup memory and multiplies 8x8 SIMD-group matrices. Each product of two values rounded
# to 2^-11 relative (half) is off by <= 2^-10 of it, and K random-sign products add up as sqrt(K)
# of them, as the output does: 2e-3 of the output scale bounds it (observed 3e-4); bfloat's 2^-8
# gives 1.6e-2 (observed 1.7e-3).
MAT_MAT_TOL = {"BF16": 1.6e-2}


@pytest.mark.parametrize("rows", [12, 33])
@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_mat_mat_kernels_run_on_the_emulated_device(host, type_name, rows):
    k, n = 256, 64
    qtype, blocks, dense = dense_weights(host, type_name, n, k, rows)
    x = np.random.default_rng(rows + 1).standard_normal((rows, k)).astype(np.float32)

    def build(g):
        return g.mul_mat(g.input(qtype, blocks, k, n), g.input(F32, x.tobytes(), k, rows))

    forward, reverse = ran(host, build), ran(host, build, reverse_lanes=True)
    assert [d["kernel"] for d in forward.dispatches] == [f"kernel_mul_mm_{ggml_name(type_name)}_f32"]
    y = np.frombuffer(forward.output, np.float32).reshape(rows, n)
    ref = x.astype(np.float64) @ dense.T
    np.testing.assert_allclose(y, ref, rtol=0, atol=MAT_MAT_TOL.get(type_name, 2e-3) * np.abs(ref).max())
    assert forward.output == reverse.output


@pytest.mark.parametrize("type_name,k", [("F32", 250), ("F16", 250), ("F32", 256)])
def test_mat_vec_rows_not_a_multiple_of_4(host, type_name, k):
    """ne00 % 4 != 0 takes the scalar variants (kernel_mul_mv_f32_f32, not ..._4)."""
    qtype, blocks, dense = dense_weights(host, type_name, 16, k, k)
    x = np.random.default_rng(5).standard_normal((1, k)).astype(np.float32)
    found = ran(host, lambda g: g.mul_mat(g.input(qtype, blocks, k, 16), g.input(F32, x.tobytes(), k, 1)))
    (kernel,) = [d["kernel"] for d in found.dispatches]
    assert kernel.endswith("_4") == (k % 4 == 0), kernel
    ref = x.astype(np.float64) @ dense.T
    np.testing.assert_allclose(np.frombuffer(found.output, np.float32).reshape(1, 16), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("type_name", ["F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_get_rows_dequantizes_exactly(host, type_name):
    """kernel_get_rows_<type> dequantizes a block the way gguf-py does, bit for bit."""
    qtype, blocks, dense = dense_weights(host, type_name, 32, 256, 7)
    idx = np.array([3, 0, 31, 3], np.int32)
    found = ran(host, lambda g: g.get_rows(g.input(qtype, blocks, 256, 32), g.input(I32, idx.tobytes(), 4)))
    assert [d["kernel"] for d in found.dispatches] == [f"kernel_get_rows_{ggml_name(type_name)}"]
    np.testing.assert_array_equal(np.frombuffer(found.output, np.float32).reshape(4, 256), dense[idx].astype(np.float32))


@pytest.mark.parametrize("tokens,used,kernels", [
    (4, 2, ["kernel_mul_mv_id_q4_K_f32"]),
    (40, 2, ["kernel_mul_mm_id_map0_ne20_2", "kernel_mul_mm_id_q4_K_f32"]),
])
def test_mul_mat_id_runs_on_the_emulated_device(host, tokens, used, kernels):
    """MoE: each token through the experts `ids` names; few tokens take the mat-vec id kernel, many
    the tiled one after a map of tokens per expert (half tiles: MAT_MAT's 2e-3)."""
    k, n, experts = 256, 64, 4
    qtype, blocks, dense = dense_weights(host, "Q4_K", experts * n, k, tokens)
    dense = dense.reshape(experts, n, k)
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.choice(experts, used, replace=False) for _ in range(tokens)]).astype(np.int32)
    x = rng.standard_normal((tokens, 1, k)).astype(np.float32)

    def build(g):
        return g.mul_mat_id(g.input(qtype, blocks, k, n, experts), g.input(F32, x.tobytes(), k, 1, tokens),
                            g.input(I32, ids.tobytes(), used, tokens))

    forward, reverse = ran(host, build), ran(host, build, reverse_lanes=True)
    assert [d["kernel"] for d in forward.dispatches] == kernels
    y = np.frombuffer(forward.output, np.float32).reshape(tokens, used, n)
    ref = np.einsum("tk,tunk->tun", x[:, 0].astype(np.float64), dense[ids])
    tol = 2e-3 if "mm_id" in kernels[-1] else 1e-5
    np.testing.assert_allclose(y, ref, rtol=0, atol=tol * np.abs(ref).max())
    assert forward.output == reverse.output


def test_mapped_moe_product_asks_for_kernels_upstream_does_not_define(host):
    """Upstream finding: with many tokens MUL_MAT_ID maps tokens to experts with
    kernel_mul_mm_id_map0_ne20_<experts per token>, which mul_mm.metal instantiates for 1, 2, 4, 5, 6,
    8, 10, 16 and 22 only: 3 experts per token name a kernel no .metal file defines (on a Mac, the
    pipeline fails to compile). A clear error here; ggml-quantization's mul_mat_id splits such ids
    (packages/ggml-quantization/tests/test_metal.py)."""
    k, n, experts, tokens, used = 256, 32, 4, 40, 3
    qtype, blocks, _ = dense_weights(host, "Q8_0", experts * n, k, 0)
    ids = np.stack([np.random.default_rng(i).choice(experts, used, replace=False) for i in range(tokens)]).astype(np.int32)
    x = np.zeros((tokens, 1, k), np.float32)
    found = host.compute(lambda g: g.mul_mat_id(g.input(qtype, blocks, k, n, experts), g.input(F32, x.tobytes(), k, 1, tokens),
                                                g.input(I32, ids.tobytes(), used, tokens)))
    assert found.supported
    assert "upstream's Metal library has no kernel kernel_mul_mm_id_map0_ne20_3" in found.error, found.error


def hadamard(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix over sqrt(n) (orthonormal)."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("n", [256, 2048])
def test_hadamard_product_and_a_kernel_scope_threadgroup_array(host, n):
    """A product hinted GGML_HINT_SRC0_IS_HADAMARD runs as a fast Walsh-Hadamard transform
    (misc.metal): 256 within SIMD groups, 2048 through `threadgroup float shmem[N]` declared inside
    the kernel, which must be the threadgroup's one array (a per-thread copy would scramble it).
    log2(n) butterfly stages in float32: 1e-5 absolute on unit-scale outputs (observed 1.6e-6)."""
    h = hadamard(n).astype(np.float32)
    x = np.random.default_rng(n).standard_normal((2, n)).astype(np.float32)

    def build(g):
        return g.mul_mat_hadamard(g.input(F32, h.tobytes(), n, n), g.input(F32, x.tobytes(), n, 2))

    forward, reverse = ran(host, build), ran(host, build, reverse_lanes=True)
    assert [d["kernel"] for d in forward.dispatches] == [f"kernel_fwht_f32_{n}"]
    y = np.frombuffer(forward.output, np.float32).reshape(2, n)
    np.testing.assert_allclose(y, x.astype(np.float64) @ h.T.astype(np.float64), rtol=0, atol=1e-5)
    assert forward.output == reverse.output

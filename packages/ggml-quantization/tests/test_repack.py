"""Weights in ggml-cpu's repacked layout (`repack`, type id + REPACKED) against the same weights
plain and against the reference.

Tolerances:
- dequantize / get_rows of a repacked weight: exact (the inverse of ggml's repack is checked bit for
  bit against ggml itself when it is learned; the rows then decode as the plain ones).
- products: the repacked gemm / gemv quantize the activations as the plain path does (Q8_0 / Q8_K)
  and sum the same integer products per block; only the float32 order of the per-block sums differs
  (~1e-6 of the output scale; 1e-5 allows K up to a few thousand). Against the reference's emulation,
  MATMUL_RTOL as for every product (test_ops.py).
"""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import assert_fake_refuses_as_cpu, on_meta, run_fresh

from .test_ops import MATMUL_RTOL, rel_err

ORDER_RTOL = 1e-5
# the layouts ggml-cpu has on x86 (Q2_K only with AVX-512); a type this CPU lacks is skipped
CANDIDATES = {"Q4_0": 2, "Q4_K": 12, "IQ4_NL": 20, "MXFP4": 39, "Q2_K": 10}


def weight(gq, t: int, rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + t)
    return gq.quantize(torch.randn(rows, cols, generator=g), t)


def cols_for(gq, t: int) -> int:
    return 3 * gq.type_info(t).block_size if gq.type_info(t).block_size == 256 else 320


@pytest.fixture(params=sorted(CANDIDATES), ids=str)
def t(request, gq):
    tid = CANDIDATES[request.param]
    if tid not in gq.repacked_types():
        pytest.skip(f"this CPU's ggml does not repack {request.param}")
    return tid


def test_repacked_types_on_this_cpu(gq):
    """Every x86 CPU with AVX2 repacks Q4_0, Q4_K, IQ4_NL and MXFP4 (AVX-512 adds Q2_K); the x64
    runtime (no AVX2) repacks nothing."""
    if gq.info()["cpu_variant"] == "x64":
        assert gq.repacked_types() == frozenset()
    else:
        assert {2, 12, 20, 39} <= gq.repacked_types() <= set(CANDIDATES.values())


def test_faster_repacked_types_follow_the_cpu_vendor(gq, tmp_path):
    """The rule of `cpu`: Q4_0 and Q4_K on Intel CPUs, Q4_0 on AMD's (measured faster repacked there),
    nothing on CPUs not measured; the first processor's fields count."""
    cpu = gq.cpu
    for vendor, expected in (("GenuineIntel", {2, 12}), ("AuthenticAMD", {2}), ("HygonGenuine", set())):
        path = tmp_path / f"cpuinfo-{vendor}"
        path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2\n\n"
                        "processor\t: 1\nvendor_id\t: Other\n")
        info = cpu.read_cpuinfo(str(path))
        assert info["vendor_id"] == vendor and cpu.flags(info) == {"fpu", "avx2"}
        assert cpu.faster_repacked_types(info) == expected, vendor
    assert cpu.read_cpuinfo(str(tmp_path / "missing")) == {}
    assert cpu.faster_repacked_types({}) == frozenset()


def test_faster_repacked_types_here(gq):
    """This CPU's answer: the rule's types that this CPU's ggml repacks."""
    faster = gq.faster_repacked_types()
    assert faster == gq.cpu.faster_repacked_types() & gq.repacked_types()
    assert faster <= {2, 12}


def test_repack_changes_layout_and_dequantize_undoes_it(gq, t):
    cols = cols_for(gq, t)
    w = weight(gq, t, 24, cols)
    r = gq.repack(w, t)
    assert r.shape == w.shape and r.dtype == torch.uint8 and not torch.equal(r, w)
    rt = gq.repacked_type(t)
    assert torch.equal(gq.dequantize(r, rt, 24, cols), gq.dequantize(w, t, 24, cols))
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(gq.dequantize(r, rt, 24, cols, dtype), gq.dequantize(w, t, 24, cols, dtype))


def test_get_rows_of_repacked(gq, t):
    cols = cols_for(gq, t)
    w = weight(gq, t, 32, cols, seed=1)
    idx = torch.tensor([31, 0, 7, 8, 8, 17])
    for index in (idx, idx.int()):
        out = gq.get_rows(gq.repack(w, t), index, gq.repacked_type(t), cols)
        assert torch.equal(out, gq.get_rows(w, idx, t, cols))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16, 47, 48, 64])
def test_products_of_repacked(gq, t, m):
    """Rows 1-3 run ggml's repacked gemv, 4+ its gemm (with gemv for the rest), 48+ the plain kernels
    on slices unpacked first (exact then). ggml's kernels throughout (`exact=True`: from 32 rows a Q4_0
    weight, repacked or not, takes mul_mat's dense path otherwise, test_dense_prefill.py)."""
    cols, rows = cols_for(gq, t), 40
    w = weight(gq, t, rows, cols, seed=2)
    r, rt = gq.repack(w, t), gq.repacked_type(t)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    plain = gq.mul_mat(w, x, t, rows, exact=True)
    repacked = gq.mul_mat(r, x, rt, rows, exact=True)
    for out in (repacked, gq.mul_mat_vec(r, x, rt, rows)):
        assert rel_err(out, plain) < ORDER_RTOL
    assert rel_err(repacked, gq.reference.mul_mat_emulated(w, x, t, rows)) < MATMUL_RTOL
    if m >= 48:
        assert torch.equal(repacked, plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_repacked_half_inputs_and_leading_dims(gq, dtype):
    w = weight(gq, 12, 16, 256)
    x = torch.randn(2, 3, 256).to(dtype)
    out = gq.mul_mat(gq.repack(w, 12), x, gq.repacked_type(12), 16)
    assert out.shape == (2, 3, 16) and out.dtype == torch.float32
    assert rel_err(out, gq.mul_mat(w, x, 12, 16)) < ORDER_RTOL


@pytest.mark.parametrize("m", [1, 4])
def test_group_mixes_repacked_and_plain(gq, m):
    """A layer's siblings as a Q4_K_M file has them: Q4_K repacked next to a Q6_K kept plain."""
    q4k, q6k = weight(gq, 12, 64, 512), weight(gq, 14, 24, 512)
    x = torch.randn(m, 512)
    outs = gq.mul_mat_group([gq.repack(q4k, 12), q6k], x, [gq.repacked_type(12), 14], [64, 24])
    assert rel_err(outs[0], gq.mul_mat(q4k, x, 12, 64)) < ORDER_RTOL
    assert torch.equal(outs[1], gq.mul_mat(q6k, x, 14, 24))


def test_threads_do_not_change_repacked_results(gq):
    w = weight(gq, 12, 2048, 1024)
    r, x = gq.repack(w, 12), torch.randn(4, 1024)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gq.mul_mat(r, x, gq.repacked_type(12), 2048)
        torch.set_num_threads(max(2, before))
        assert torch.equal(gq.repack(w, 12), r)
        assert torch.equal(gq.mul_mat(r, x, gq.repacked_type(12), 2048), one)
    finally:
        torch.set_num_threads(before)


def test_repack_refusals(gq):
    w = weight(gq, 12, 12, 256)
    with pytest.raises(ValueError, match="groups of 8; blocks has 12"):
        gq.repack(w, 12)
    with pytest.raises(ValueError, match="has no repacked layout for Q6_K"):
        gq.repack(weight(gq, 14, 8, 256), 14)
    with pytest.raises(ValueError, match="names a repacked Q6_K weight"):
        gq.mul_mat(weight(gq, 14, 8, 256), torch.randn(1, 256), 14 + gq.REPACKED, 8)
    with pytest.raises(ValueError, match="repacked weights hold a multiple of 8"):
        gq.mul_mat(w, torch.randn(1, 256), gq.repacked_type(12), 12)
    with pytest.raises(ValueError, match="plain GGUF layout"):
        gq.mul_mat_id(w.view(1, 12, 144)[:, :8], torch.randn(1, 256), torch.zeros(1, 1, dtype=torch.int32),
                      gq.repacked_type(12), 8)
    with pytest.raises(ValueError, match="unknown or unsupported ggml type id"):
        gq.quantize(torch.randn(8, 256), gq.repacked_type(12))


FAKE_CASES = {
    "repack rows": lambda gq: (gq.ops.repack, torch.zeros(12, 144, dtype=torch.uint8), 12),
    "repack partial block": lambda gq: (gq.ops.repack, torch.zeros(8, 100, dtype=torch.uint8), 12),
    "mul_mat repacked rows": lambda gq: (gq.ops.mul_mat, torch.zeros(12, 144, dtype=torch.uint8),
                                         torch.zeros(1, 256), 12 + 1024, 12),
    "dequantize repacked rows": lambda gq: (gq.ops.dequantize, torch.zeros(12, 144, dtype=torch.uint8),
                                            12 + 1024, 12, 256, torch.float32),
    "get_rows repacked rows": lambda gq: (gq.ops.get_rows, torch.zeros(12, 144, dtype=torch.uint8),
                                         torch.zeros(1, dtype=torch.int64), 12 + 1024, 256, torch.float32),
    "mul_mat_id repacked": lambda gq: (gq.ops.mul_mat_id, torch.zeros(2, 8, 144, dtype=torch.uint8),
                                       torch.zeros(1, 256), torch.zeros(1, 1, dtype=torch.int32), 12 + 1024, 8),
}


@pytest.mark.parametrize("case", sorted(FAKE_CASES))
def test_fake_refuses_what_the_kernel_refuses(gq, case):
    fn, *args = FAKE_CASES[case](gq)
    assert_fake_refuses_as_cpu(fn, *args)


def test_fake_accepts_repacked(gq):
    w = on_meta(torch.zeros(16, 144, dtype=torch.uint8))
    assert gq.ops.repack(w, 12).shape == (16, 144)
    assert gq.ops.mul_mat(w, on_meta(torch.zeros(3, 256)), 12 + 1024, 16).shape == (3, 16)


def test_no_layout_without_avx2():
    """The x64 runtime (no AVX2) repacks nothing, and says so when asked to."""
    res = run_fresh("ggml-org/ggml-quantization", """
        import torch
        w = k.quantize(torch.randn(8, 256), 12)
        try:
            k.repack(w, 12)
            error = None
        except ValueError as e:
            error = str(e)
        res = {"types": sorted(k.repacked_types()), "error": error}
    """, level="x64")
    assert res["types"] == [] and "(x64) has no repacked layout for Q4_K" in res["error"]


def test_unrepack_gives_the_gguf_bytes_back(gq, t):
    w = weight(gq, t, 16, cols_for(gq, t), seed=3)
    assert torch.equal(gq.unrepack(gq.repack(w, t), t), w)
    with pytest.raises(ValueError, match="repacked weights hold a multiple of 8"):
        gq.unrepack(w[:12], t)


def test_metal_builds_repack_nothing_by_default(metal):
    assert metal.faster_repacked_types() == frozenset()

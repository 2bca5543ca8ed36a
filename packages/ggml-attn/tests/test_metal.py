"""ggml-attn on Metal: each Metal build (tools/testing/builds.py: metal-emu, mps-emu; loaded as users
would) against the CPU build and the float64 reference, each call under both lane schedules of the
emulator (metal_builds.both_schedules: bit-identical results required).

Upstream's Metal flash-attention kernels keep Q (and the products' partial sums) in half
precision in threadgroup memory, so a logit s = scale * q.k is off by up to 2^-10 of
scale * |q|.|k|, and softmax passes a logit error e on to the output as at most e * max|v|; the
P*V sum adds 2^-10 of max|v|. Tolerance, per output element:
    2^-10 * (scale * max_ij |q_i|.|k_j| + 1) * max|v|  (+ the output's own rounding: 2^-8 of max|v|
    for bfloat16, 2^-11 for float16),
against the reference; twice that against the CPU build (ggml-cpu rounds differently).
"""

from __future__ import annotations

import re

import pytest
import torch

from tools.testing import metal_checks
from tools.testing.builds import slow_on
from tools.testing.kernel_testing import on_meta
from tools.testing.metal_builds import both_schedules

# Writes past the threadgroup memory the host set (into the emulator's guard zone): upstream's vec
# kernel zeroes its output scratch with every lane (`so4[qq*DV4 + i*NL] = 0` for i < DV4/NL, lanes
# 0-31) although only the first NL lanes own a column there: with NE > 1 lanes per key (NL < 32) the
# last lanes write up to (32 - NL) float4 past the scratch, past the end of threadgroup memory for
# the last SIMD group. Harmless zeros on the emulator; undefined on a GPU. Here: head dim 96 (NE = 4
# by default) and 64 with the NE = 4 pipelines upstream's tuning picks for long float16 caches.
VEC_OVERRUNS = frozenset(f"kernel_flash_attn_ext_vec_{t}_dk{d}_dv{d}" for t in ("f32", "f16", "bf16") for d in (64, 96))


def attention_inputs(b, hq, hkv, sq, skv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g).to(dtype) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))


def tolerance(q, k, v, scale=None):
    scale = scale or q.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]
    kk = k.double().abs().repeat_interleave(group, dim=1)
    logit_bound = scale * (q.double().abs() @ kk.transpose(-1, -2)).max().item()
    vmax = v.double().abs().max().item()
    out_rounding = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(q.dtype, 0.0)
    return 2.0**-10 * (logit_bound + 1) * vmax + out_rounding * vmax


def check_attention(metal, ga, q, k, v, overruns=VEC_OVERRUNS, **kw):
    """The Metal result against the reference and the CPU build; returns the kernels dispatched."""
    out, kernels = both_schedules(metal, metal.flash_attn, q, k, v, overruns=overruns, **kw)
    ref = metal.reference.flash_attn(q.double(), k.double(), v.double(), compute_dtype=torch.float64, **kw)
    tol = tolerance(q, k, v, kw.get("scale"))
    assert out.dtype == q.dtype and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"max error {err:.2e} > {tol:.2e}"
    assert (out.double() - ga.flash_attn(q, k, v, **kw).double()).abs().max().item() <= 2 * tol
    return kernels


def test_emulated_build_loads_and_carries_no_ggml_cpu(metal_emu, ga):
    metal_checks.assert_emulated_build_has_no_ggml_cpu(metal_emu, ga)


DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def head_dim_case(d: int, dtype: torch.dtype, sq: int):
    """(d, dtype, sq) with its tier: head dim 256 in half / bfloat beyond one query is the heaviest
    (5-18 s a call here): slow on every kind; on mps-emu (twice the calls) head dim 64 is the fast subset."""
    heavy = d == 256 and dtype != torch.float32 and sq > 1
    marks = [pytest.mark.slow] if heavy else [slow_on("mps-emu")] if d > 64 else []
    return pytest.param(d, dtype, sq, marks=marks, id=f"{d}-{DTYPE_NAMES[dtype]}-{sq}")


@pytest.mark.parametrize(
    ("d", "dtype", "sq"),
    [head_dim_case(d, dtype, sq) for d in (64, 128, 256) for dtype in DTYPE_NAMES for sq in (1, 5, 32)])
def test_flash_attn_head_dims_dtypes_vec_and_tiled(metal, ga, d, dtype, sq):
    """Qwen3.5 (256), Llama (64, 128) and Gemma (256) head dims, K/V in the caller's dtype, GQA 1 /
    4 / 8; upstream takes its vec kernels below 20 queries and the tiled simdgroup-matrix kernels
    from 20 on. 40 keys: not a multiple of either kernel's block (32 / 64), so the padded last
    block runs too."""
    gqa = {64: 1, 128: 4, 256: 8}[d]
    q, k, v = attention_inputs(2, 2 * gqa, 2, sq, 40, d, dtype, seed=d + sq)
    kernels = check_attention(metal, ga, q, k, v)
    name = DTYPE_NAMES[dtype]
    family = f"kernel_flash_attn_ext_vec_{name}_dk{d}_dv{d}" if sq < 20 else f"kernel_flash_attn_ext_{name}_dk{d}_dv{d}"
    assert any(kernel.startswith(family) for kernel in kernels), kernels
    assert "kernel_flash_attn_ext_pad" in kernels


@pytest.mark.parametrize(
    ("sq", "skv", "block"),
    [(1, 31, 32), (1, 32, 32), (1, 33, 32), (24, 63, 64), (24, 64, 64), (24, 65, 64)],
)
def test_flash_attn_kv_lengths_around_blocks(metal, ga, sq, skv, block):
    """The padded last block of keys (kernel_flash_attn_ext_pad) exactly when Skv % block != 0."""
    q, k, v = attention_inputs(1, 4, 2, sq, skv, 64, torch.float32, seed=skv)
    kernels = check_attention(metal, ga, q, k, v)
    assert ("kernel_flash_attn_ext_pad" in kernels) == (skv % block != 0), kernels


def test_flash_attn_tuning_buckets_and_simdgroups(metal, ga):
    """Upstream's tuning (ggml-metal-tuning.cpp) changes the vec kernel's keys per lane (NE) for a
    float16 cache with head dim 64 from 1024 keys on (ne2 -> ne4 pipelines), and its host code
    doubles the SIMD groups per threadgroup beyond 2048 keys (threads 32 x 1 -> 32 x 2), whose
    results the kernel then merges across SIMD groups."""
    pipelines = {}
    for skv in (1023, 1024):
        q, k, v = attention_inputs(1, 2, 1, 1, skv, 64, torch.float16, seed=skv)
        check_attention(metal, ga, q, k, v)
        records = metal._metal_emu.metal_dispatch_records()
        pipelines[skv] = {r["pipeline"] for r in records if r["kernel"].startswith("kernel_flash_attn_ext_vec_f16")}
    assert pipelines[1023] != pipelines[1024], pipelines
    threads = {}
    for skv in (2048, 2049):
        q, k, v = attention_inputs(1, 1, 1, 1, skv, 128, torch.float32, seed=skv)
        check_attention(metal, ga, q, k, v)
        records = metal._metal_emu.metal_dispatch_records()
        threads[skv] = {tuple(r["threads"]) for r in records if r["kernel"] == "kernel_flash_attn_ext_vec_f32_dk128_dv128"}
    assert threads == {2048: {(32, 1, 1)}, 2049: {(32, 2, 1)}}, threads


@pytest.mark.parametrize("sq", [1, 4, 24])
def test_flash_attn_masks_softcap_and_sinks(metal, ga, sq):
    """Causal (bottom-right), a bool padding mask with left padding (a query whose keys are all
    masked gets zeros), an additive per-head mask, softcap and sinks, on the vec (1, 4 queries)
    and tiled (24) kernels."""
    b, hq, hkv, skv, d = 2, 4, 2, 37, 64
    q, k, v = attention_inputs(b, hq, hkv, sq, skv, d, torch.float32, seed=sq)
    check_attention(metal, ga, q, k, v, causal=True)
    padding = torch.ones(b, 1, sq, skv, dtype=torch.bool)
    padding[1, :, :, :5] = False  # the second sequence is left-padded by 5 keys
    padding[1, :, 0, :] = False  # and its first query row sees nothing
    check_attention(metal, ga, q, k, v, mask=padding)
    assert metal.flash_attn(q, k, v, mask=padding)[1, :, 0].eq(0).all()
    g = torch.Generator().manual_seed(sq)
    additive = torch.randn(b, hq, sq, skv, generator=g)
    check_attention(metal, ga, q, k, v, mask=additive, softcap=30.0)
    check_attention(metal, ga, q, k, v, causal=True, sinks=torch.randn(hq, generator=g))


def test_flash_attn_relies_on_lock_step_lane_zero_write(metal_emu):
    """Upstream's vec kernel with one key per lane (NE == 1: head dims 128 and 256) ends its loop
    over the keys with lane 0 storing the softmax sums S and M over the first floats of `ss`
    (`if (tiisg == 0) { ss[2*qq + 0] = S; ss[2*qq + 1] = M; }`), which the other lanes have just
    read as probabilities in their P*V step, with no barrier or SIMD collective between. On a GPU
    the lanes run in lock-step, so every read comes first. Run lane by lane without the
    convergence points the emulator puts around lane-0 branches, the forward schedule lets lane 0
    write first and the result is wrong while the reverse schedule's is right: the two schedules
    disagree, which is how the emulator finds such reliance. With the convergence points (the
    default) both are right and bit-identical. build-metal-emu alone: the mps-emu twin's calls are
    checked against it under the default schedule, which this test turns off."""
    q, k, v = attention_inputs(1, 1, 1, 1, 32, 128, torch.float32)
    ref = metal_emu.reference.flash_attn(q.double(), k.double(), v.double())
    runtime = metal_emu._metal_emu
    try:
        runtime.set_lane_schedule(False, lane_zero_convergence=False)
        forward = metal_emu.flash_attn(q, k, v)
        runtime.set_lane_schedule(True, lane_zero_convergence=False)
        reverse = metal_emu.flash_attn(q, k, v)
    finally:
        runtime.set_lane_schedule(False)
    tol = tolerance(q, k, v)
    assert (reverse.double() - ref).abs().max() <= tol
    assert (forward.double() - ref).abs().max() > 10 * tol
    out, _ = both_schedules(metal_emu, metal_emu.flash_attn, q, k, v)
    assert (out.double() - ref).abs().max() <= tol


def test_flash_attn_vec_kernel_writes_past_threadgroup_memory(metal, ga):
    """VEC_OVERRUNS: head dim 96 takes 4 lanes per key (NE = 4, 8 lanes per row): the emulator's
    guard zone catches the zeroing past the output scratch; the result is right."""
    q, k, v = attention_inputs(1, 2, 1, 1, 40, 96, torch.float32)
    check_attention(metal, ga, q, k, v)
    overruns = {
        r["kernel"]: r["threadgroup_overrun"] for r in metal._metal_emu.metal_dispatch_records() if r["threadgroup_overrun"]
    }
    assert overruns == {"kernel_flash_attn_ext_vec_f32_dk96_dv96": 256}, overruns


def test_flash_attn_head_dims_without_metal_kernels_raise(metal, ga):
    q, k, v = attention_inputs(1, 2, 1, 1, 8, 100, torch.float32)
    assert ga.flash_attn(q, k, v).shape == (1, 2, 1, 100)
    assert not metal.supports_flash_attn(100) and metal.supports_flash_attn(256) and ga.supports_flash_attn(100)
    with pytest.raises(NotImplementedError, match=r"ggml-metal has no kernel for FLASH_ATTN_EXT"):
        metal.flash_attn(q, k, v)
    q, k, v = attention_inputs(1, 2, 1, 1, 8, 64, torch.float32)
    with pytest.raises(NotImplementedError, match=r"FLASH_ATTN_EXT"):
        metal.flash_attn(q, k, torch.randn(1, 1, 8, 128))  # value head dim above the key's


def test_head_dim_pairs_without_a_metal_kernel_are_refused_up_front(metal, ga):
    """Upstream's supports_op lets any value head dim up to the key's through, but its kernels exist for
    the pairs of METAL_HEAD_DIM_PAIRS only: key 128 with value 64 got past it and failed late, a
    RuntimeError naming the missing pipeline. Every other pair is a NotImplementedError naming both
    dims before anything is dispatched (the fake refuses it too), and supports_flash_attn takes both."""
    pairs = set(metal.METAL_HEAD_DIM_PAIRS)
    assert metal.METAL_HEAD_DIMS == tuple(sorted({d for d, _ in pairs}))
    assert not metal.supports_flash_attn(128, value_head_dim=64) and ga.supports_flash_attn(128, value_head_dim=64)
    assert metal.supports_flash_attn(192, torch.bfloat16, value_head_dim=128) and metal.supports_flash_attn(128)
    q, k, _ = attention_inputs(1, 2, 1, 1, 8, 128, torch.float32)
    v = torch.randn(1, 1, 8, 64)
    assert ga.flash_attn(q, k, v).shape == (1, 2, 1, 64)
    message = (r"ggml-metal has no kernel for FLASH_ATTN_EXT with key head dim 128 and value head dim 64; its kernels "
               r"take the key/value head dims 32/32, 40/40, .*, 576/512 \(supports_flash_attn says which\), the CPU "
               r"build any up to 1024")
    metal.reset_metal_dispatches()
    with pytest.raises(NotImplementedError, match=message):
        metal.flash_attn(q, k, v)
    with pytest.raises(NotImplementedError, match=message):  # the fake (torch.compile, the meta device)
        metal.flash_attn(*(on_meta(t) for t in (q, k, v)))
    refused = [(d, dv) for d in metal.METAL_HEAD_DIMS for dv in metal.METAL_HEAD_DIMS if dv <= d and (d, dv) not in pairs]
    assert len(refused) == 89
    for d, dv in refused:
        assert not metal.supports_flash_attn(d, value_head_dim=dv)
        with pytest.raises(NotImplementedError, match=f"key head dim {d} and value head dim {dv};"):
            metal.flash_attn(torch.randn(1, 1, 1, d), torch.randn(1, 1, 2, d), torch.randn(1, 1, 2, dv))
    assert metal.metal_dispatches() == {}


@pytest.mark.parametrize("sq", [1, 24])
def test_query_held_in_half_and_an_infinite_sink_give_nan_on_metal_only(metal, ga, sq):
    """Pinned as documented (the package README and card): upstream's Metal kernels hold Q in half, so
    a float32 query element above 65504 (half's largest) is inf there and that query's output row NaN;
    a +inf sink makes every row of its head NaN on Metal, where the CPU build gives zeros (the sink
    takes the whole weight). 65504 itself, a large finite sink and a -inf sink are right on both."""
    q, k, v = attention_inputs(1, 2, 1, sq, 8, 64, torch.float32, seed=sq)
    big = q.clone()
    big[0, 1, 0, 5] = 7e4
    out, cpu = metal.flash_attn(big, k, v), ga.flash_attn(big, k, v)
    nan_rows = torch.zeros(1, 2, sq, dtype=torch.bool)
    nan_rows[0, 1, 0] = True
    assert torch.isfinite(cpu).all() and torch.equal(out.isnan().all(-1), nan_rows) and not out.isnan().any(-1)[~nan_rows].any()
    big[0, 1, 0, 5] = 65504.0
    check_attention(metal, ga, big, k, v)
    out, cpu = (m.flash_attn(q, k, v, sinks=torch.tensor([0.0, float("inf")])) for m in (metal, ga))
    assert out[0, 1].isnan().all() and torch.isfinite(out[0, 0]).all()
    assert torch.equal(cpu[0, 1], torch.zeros_like(cpu[0, 1])) and torch.isfinite(cpu).all()
    for sink in (1e4, float("-inf")):
        check_attention(metal, ga, q, k, v, sinks=torch.tensor([0.0, sink]))


@pytest.mark.parametrize("d, dv, sq", [(96, 64, 1), (192, 128, 24)])
def test_head_dim_pairs_with_a_smaller_value_head_dim(metal, ga, d, dv, sq):
    """The pairs upstream has kernels for with a value head dim below the key's run (vec below 20
    queries, tiled from 20 on). Key head dim 96 takes 4 lanes per key in the vec kernel: its output
    scratch zeroing overruns as VEC_OVERRUNS says."""
    q, k, _ = attention_inputs(1, 2, 1, sq, 40, d, torch.float32, seed=d)
    v = torch.randn(1, 1, 40, dv, generator=torch.Generator().manual_seed(dv))
    kernels = check_attention(metal, ga, q, k, v, overruns=VEC_OVERRUNS | {"kernel_flash_attn_ext_vec_f32_dk96_dv64"})
    assert any(f"_dk{d}_dv{dv}" in kernel for kernel in kernels), kernels


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.flash_attn(torch.randn(1, 2, 1, 64), torch.randn(1, 1, 4, 64).half(), torch.randn(1, 1, 4, 64)),
        lambda m: m.flash_attn(torch.randn(1, 3, 1, 64), torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64)),
        lambda m: m.flash_attn(torch.randn(1, 2, 1, 64), torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64), mask=torch.ones(3, 4, dtype=torch.bool)),
        lambda m: m.flash_attn(torch.randn(1, 2, 1, 64), torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64), scale=1e300),
        lambda m: m.flash_attn(torch.randn(1, 2, 1, 64), torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64), softcap=1e39),
        lambda m: m.kv_write(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8), 3),
        lambda m: m.apply_rotary(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 3, 7), torch.randn(1, 3, 7)),
    ],
)
def test_bad_input_raises_as_the_cpu_build_does(metal, ga, call):
    with pytest.raises(Exception) as cpu_error:
        call(ga)
    with pytest.raises(type(cpu_error.value), match=re.escape(str(cpu_error.value))):
        call(metal)


def test_rotary_is_bit_equal_to_the_cpu_build(metal, ga):
    """transformers' rotate_half rotation as ggml's MUL / SUB / ADD / CONCAT kernels: the same
    float32 roundings as the CPU loop, so bit-equal; q strided as transformers hands it over."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 5, 4, 64, generator=g).transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D)
    k = torch.randn(2, 2, 5, 64, generator=g)
    cos, sin = torch.randn(1, 5, 64, generator=g), torch.randn(1, 5, 64, generator=g)
    (rq, rk), kernels = both_schedules(metal, metal.apply_rotary, q, k, cos, sin)
    cq, ck = ga.apply_rotary(q, k, cos, sin)
    assert torch.equal(rq, cq) and torch.equal(rk, ck)
    assert "kernel_concat_f32" in kernels and any(name.startswith("kernel_bin") for name in kernels), kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_write_is_upstreams_set_rows(metal, ga, dtype):
    """The rows land where the CPU build puts them, the rest of the cache untouched, through
    kernel_set_rows (bfloat16 rows via float32, exactly); a non-contiguous cache (a narrow of a
    bigger buffer) too."""
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 3, 10, 64, generator=g).to(dtype), torch.randn(2, 3, 10, 32, generator=g).to(dtype)
    k, v = torch.randn(2, 3, 2, 64, generator=g).to(dtype), torch.randn(2, 3, 2, 32, generator=g).to(dtype)
    mk, mv, ck, cv = keys.clone(), values.clone(), keys.clone(), values.clone()
    _, kernels = both_schedules(metal, lambda: metal.kv_write(mk, mv, k, v, 4) or [torch.zeros(1)])
    ga.kv_write(ck, cv, k, v, 4)
    assert torch.equal(mk, ck) and torch.equal(mv, cv)
    assert any(name.startswith("kernel_set_rows") for name in kernels), kernels
    big = torch.zeros(2, 3, 12, 64, dtype=dtype)
    window, cpu_window = big[:, :, :10], big.clone()[:, :, :10]
    metal.kv_write(window, mv.clone(), k, v, 7)
    ga.kv_write(cpu_window, cv.clone(), k, v, 7)
    assert torch.equal(window, cpu_window) and big[:, :, 10:].eq(0).all()

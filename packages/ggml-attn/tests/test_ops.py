"""ggml-attn against the float64 reference (reference.py) and torch's SDPA.

Tolerances: with float32 q/k/v, ggml accumulates in float32 with an online softmax; the difference
to float64 attention is float32 rounding over Skv terms, ~1e-6 of the output scale (2e-5 allows for
caches of 16k keys). With float16/bfloat16 inputs ggml rounds q to the K dtype for the dot
products and the output is rounded to that dtype; with an f16 V it also accumulates the weighted
values in f16 (as llama.cpp does with its f16 cache), an error growing like sqrt(Skv) f16 ulps:
f16 1e-2 of the output scale for 700 keys (3.6e-3 measured), bf16 1.6e-2 (two bf16 ulps).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tools.testing.kernel_testing import run_fresh

TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 1.6e-2}


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def qkv(b, hq, hkv, sq, skv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=g).to(dtype), torch.randn(b, hkv, skv, d, generator=g).to(dtype),
            torch.randn(b, hkv, skv, d, generator=g).to(dtype))


SHAPES = [  # b, hq, hkv, sq, skv, d
    (1, 8, 2, 1, 37, 64),  # decode, GQA 4
    (3, 4, 2, 1, 50, 256),  # batched decode
    (1, 2, 1, 1, 700, 128),  # decode on a long cache: ggml's split-KV path
    (2, 8, 2, 130, 130, 128),  # prefill past one 64-row tile
    (1, 4, 4, 5, 600, 64),  # a few queries against a longer cache
    (1, 6, 3, 64, 64, 80),  # exactly one tile, odd head count per group
    (2, 2, 2, 17, 40, 40),  # odd sizes
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_reference(ga, shape, causal):
    q, k, v = qkv(*shape)
    out = ga.flash_attn(q, k, v, causal=causal)
    assert out.shape == (shape[0], shape[1], shape[3], shape[5]) and out.dtype == torch.float32
    assert rel_err(out, ga.reference.flash_attn(q, k, v, causal=causal)) < TOL[torch.float32]


@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "x".join(map(str, s)))
def test_against_sdpa(ga, shape):
    """An oracle we did not write: torch's SDPA (math backend) with GQA and a bottom-right causal mask."""
    q, k, v = qkv(*shape)
    sq, skv = shape[3], shape[4]
    visible = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    assert rel_err(ga.flash_attn(q, k, v, causal=True), ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3]], ids=lambda s: "x".join(map(str, s)))
def test_half_dtypes(ga, shape, dtype):
    q, k, v = qkv(*shape, dtype=dtype)
    out = ga.flash_attn(q, k, v, causal=True)
    assert out.dtype == dtype
    assert rel_err(out, ga.reference.flash_attn(q, k, v, causal=True)) < TOL[dtype]


@pytest.mark.parametrize("form", ["2d", "3d", "4d", "per_head", "additive"])
def test_mask_forms(ga, form):
    b, hq, hkv, sq, skv, d = 2, 4, 2, 9, 23, 64
    q, k, v = qkv(b, hq, hkv, sq, skv, d)
    keep = torch.rand(b, hq, sq, skv, generator=torch.Generator().manual_seed(5)) > 0.3
    keep[..., -1] = True  # no empty row here (tested separately)
    mask = {"2d": keep[0, 0], "3d": keep[:, 0], "4d": keep[:, :1], "per_head": keep,
            "additive": torch.zeros(b, 1, sq, skv).masked_fill(~keep[:, :1], float("-inf"))}[form]
    out = ga.flash_attn(q, k, v, mask=mask)
    assert rel_err(out, ga.reference.flash_attn(q, k, v, mask=mask)) < TOL[torch.float32]


@pytest.mark.parametrize("sq,skv", [(70, 70), (1, 40), (1, 600), (3, 700)])
def test_fully_masked_rows_are_zero(ga, sq, skv):
    """Left padding: the padded positions of the second sequence see no key at all."""
    b, hq, hkv, d = 2, 4, 2, 64
    q, k, v = qkv(b, hq, hkv, sq, skv, d)
    mask = torch.ones(b, 1, sq, skv, dtype=torch.bool).tril(diagonal=skv - sq)
    mask[1, :, :, :5] = False
    if sq > 1:
        mask[1, :, :5, :] = False  # padded queries
    else:
        mask[1] = False  # a decode query with nothing to see
    out = ga.flash_attn(q, k, v, mask=mask)
    assert torch.isfinite(out).all()
    ref = ga.reference.flash_attn(q, k, v, mask=mask)
    assert rel_err(out, ref) < TOL[torch.float32]
    dead = ~mask.any(-1)  # (b, 1, sq)
    assert out.transpose(1, 2)[dead.squeeze(1)].abs().max().item() == 0.0


def test_per_head_mask_over_several_query_tiles():
    """A per-head mask (B, Hq > 1, Sq, Skv) with Sq >= 128 splits its query rows into slices whose
    mask rows are a copy: the copy was freed before the graph read it (thousands of NaN, or garbage).
    In a fresh process, as a use after free may crash."""
    res = run_fresh("ggml-org/ggml-attn", """
        import torch
        import torch.nn.functional as F
        torch.manual_seed(0)
        q, kk, v = torch.randn(1, 4, 256, 64), torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 64)
        m = torch.rand(1, 4, 256, 256) > 0.3
        m[..., 0] = True
        out = k.flash_attn(q, kk, v, mask=m)
        ref = k.reference.flash_attn(q, kk, v, mask=m)
        sdpa = F.scaled_dot_product_attention(q, kk, v, attn_mask=m, enable_gqa=True)
        res = {"nan": int(out.isnan().sum()), "vs_ref": float((out - ref).abs().max() / ref.abs().max()),
               "vs_sdpa": float((out - sdpa).abs().max() / sdpa.abs().max())}
    """)
    assert res["nan"] == 0
    assert res["vs_ref"] < TOL[torch.float32] and res["vs_sdpa"] < TOL[torch.float32]


def test_causal_combined_with_mask(ga):
    q, k, v = qkv(1, 4, 2, 12, 20, 64)
    mask = torch.ones(1, 1, 12, 20, dtype=torch.bool)
    mask[..., 3] = False
    out = ga.flash_attn(q, k, v, mask=mask, causal=True)
    assert rel_err(out, ga.reference.flash_attn(q, k, v, mask=mask, causal=True)) < TOL[torch.float32]


def test_scale_softcap_sinks(ga):
    q, k, v = qkv(1, 8, 2, 3, 40, 64)
    sinks = torch.randn(8)
    for kw in ({"scale": 0.3}, {"softcap": 30.0}, {"sinks": sinks}, {"scale": 0.1, "softcap": 5.0, "sinks": sinks}):
        out = ga.flash_attn(q, k, v, causal=True, **kw)
        assert rel_err(out, ga.reference.flash_attn(q, k, v, causal=True, **kw)) < TOL[torch.float32], kw


def test_non_contiguous_inputs(ga):
    """transformers hands over views (e.g. q from a transpose): strides are honoured without copies."""
    q, k, v = qkv(2, 4, 2, 10, 10, 64)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S, D) view with heads-inner strides
    out = ga.flash_attn(qt, k, v, causal=True)
    assert rel_err(out, ga.reference.flash_attn(q, k, v, causal=True)) < TOL[torch.float32]
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # innermost dim strided: copied
    assert rel_err(ga.flash_attn(q, kt, v, causal=True), ga.reference.flash_attn(q, k, v, causal=True)) < TOL[torch.float32]


@pytest.mark.parametrize("d", [8, 40, 96, 100, 192, 256, 512])
def test_head_dims(ga, d):
    assert ga.supports_flash_attn(d, torch.float32)
    q, k, v = qkv(1, 2, 1, 4, 30, d)
    assert rel_err(ga.flash_attn(q, k, v, causal=True), ga.reference.flash_attn(q, k, v, causal=True)) < TOL[torch.float32]


def test_supports_flash_attn(ga):
    assert ga.supports_flash_attn(128, torch.bfloat16)
    assert not ga.supports_flash_attn(2048, torch.float32)
    assert not ga.supports_flash_attn(64, torch.float64)


def test_flash_attn_forward_contract(ga):
    """transformers' interface: mask None = SDPA's `is_causal` (top-left; one query sees every key);
    output (B, Sq, Hq, D), None."""
    q, k, v = qkv(2, 8, 2, 5, 12, 64)
    out, weights = ga.flash_attn_forward(torch.nn.Module(), q, k, v, None, scaling=0.125)
    assert weights is None and out.shape == (2, 5, 8, 64) and out.is_contiguous()
    k2, v2 = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert rel_err(out, sdpa(q, k2, v2, is_causal=True, scale=0.125).transpose(1, 2)) < TOL[torch.float32]
    for sq in (1, 12):  # one query, and as many as keys: top-left and bottom-right agree
        q1, k1, v1 = qkv(2, 8, 2, sq, 12, 64, seed=1)
        out, _ = ga.flash_attn_forward(torch.nn.Module(), q1, k1, v1, None, scaling=0.125)
        ref = ga.reference.flash_attn(q1, k1, v1, causal=True, scale=0.125).transpose(1, 2)
        assert rel_err(out, ref) < TOL[torch.float32]
    mask = torch.ones(2, 1, 5, 12, dtype=torch.bool)
    mask[0, ..., :2] = False
    out, _ = ga.flash_attn_forward(torch.nn.Module(), q, k, v, mask, scaling=0.125)
    assert rel_err(out, ga.reference.flash_attn(q, k, v, mask=mask, scale=0.125).transpose(1, 2)) < TOL[torch.float32]


def test_flash_attn_forward_reads_the_modules_softcap(ga):
    """A module's `attn_logit_softcapping` (an instance attribute, as Gemma 2 sets it, or a class
    attribute) softcaps the logits; a module without one gets none; a `softcap` kwarg wins."""
    q, k, v = qkv(1, 4, 2, 9, 9, 64)
    q = q * 20  # logits large enough for a softcap of 2 to matter
    capped = ga.reference.flash_attn(q, k, v, causal=True, scale=0.125, softcap=2.0).transpose(1, 2)
    plain = ga.reference.flash_attn(q, k, v, causal=True, scale=0.125).transpose(1, 2)
    assert rel_err(capped, plain) > 0.05

    class Capped(torch.nn.Module):
        attn_logit_softcapping = 2.0

    instance = torch.nn.Module()
    instance.attn_logit_softcapping = 2.0
    for module in (instance, Capped()):
        out, _ = ga.flash_attn_forward(module, q, k, v, None, scaling=0.125)
        assert rel_err(out, capped) < TOL[torch.float32]
    out, _ = ga.flash_attn_forward(torch.nn.Module(), q, k, v, None, scaling=0.125)
    assert rel_err(out, plain) < TOL[torch.float32]
    out, _ = ga.flash_attn_forward(torch.nn.Module(), q, k, v, None, scaling=0.125, softcap=2.0)
    assert rel_err(out, capped) < TOL[torch.float32]


@pytest.mark.parametrize("hq, hkv, skv, d", [(9, 3, 300, 64), (8, 2, 100, 256), (4, 4, 400, 128), (8, 2, 1000, 64), (6, 2, 30, 64)])
def test_decode_heads_split_over_threads(ga, hq, hkv, skv, d):
    """One sequence's decode step with enough work splits its KV heads over the threads (one graph
    each): bit-identical to one thread (each head is the same ggml computation), right against the
    reference, on a cache view with spare capacity (strided heads) and with sinks."""
    q, k, v = qkv(1, hq, hkv, 1, skv + 50, d, seed=hq)
    k, v = k[:, :, :skv], v[:, :, :skv]  # a growing cache's view: head stride spans the capacity
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [ga.flash_attn(q, k, v, causal=True), ga.flash_attn(q, k, v, sinks=sinks)]
        torch.set_num_threads(2)
        two = [ga.flash_attn(q, k, v, causal=True), ga.flash_attn(q, k, v, sinks=sinks)]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert rel_err(two[0], ga.reference.flash_attn(q, k, v, causal=True)) < TOL[torch.float32]
    assert rel_err(two[1], ga.reference.flash_attn(q, k, v, sinks=sinks)) < TOL[torch.float32]


@pytest.mark.parametrize("skv, seen, d", [(256, 100, 64), (256, 256, 64), (1024, 600, 128), (64, 1, 256)])
@pytest.mark.parametrize("form", ["(B, 1, 1, Skv)", "(1, Skv)", "strided"])
def test_decode_on_a_static_cache_attends_the_visible_prefix(ga, skv, seen, d, form):
    """A decode step on a static cache: the boolean mask shows the `seen` positions written so far.
    The kernel attends those keys alone, unmasked: bit for bit the call on the cache's first `seen`
    positions without a mask (what a growing cache gives), within float32 summation order of ggml's
    masked path over the whole cache (the same mask as an additive float one, which never takes the
    shortcut), and right against the reference with the mask. A mask with a hole takes the general
    masked path."""
    q, k, v = qkv(1, 8, 2, 1, skv, d, seed=skv + seen)
    visible = torch.arange(skv) < seen
    mask = {"(B, 1, 1, Skv)": visible.view(1, 1, 1, skv), "(1, Skv)": visible.view(1, skv),
            "strided": torch.stack([visible, ~visible], -1)[:, 0].view(1, 1, 1, skv)}[form]
    out = ga.flash_attn(q, k, v, mask=mask)
    torch.testing.assert_close(out, ga.flash_attn(q, k[:, :, :seen], v[:, :, :seen]), rtol=0, atol=0)
    additive = torch.zeros(1, 1, 1, skv).masked_fill(~visible, float("-inf"))
    assert rel_err(out, ga.flash_attn(q, k, v, mask=additive)) < 1e-6  # split-KV may reorder the sums
    assert rel_err(out, ga.reference.flash_attn(q, k, v, mask=mask)) < TOL[torch.float32]
    holed = visible.clone()
    holed[0] = seen == 1  # the first position hidden (or, for one visible key, one more shown)
    holed[-1] = True
    assert rel_err(ga.flash_attn(q, k, v, mask=holed.view(1, skv)),
                   ga.reference.flash_attn(q, k, v, mask=holed.view(1, skv))) < TOL[torch.float32]


def test_kv_write_equals_narrow_copy(ga):
    """A cache append writes exactly what `buffer.narrow(-2, position, n).copy_(new)` writes, for
    strided new rows (a model's transposed k/v) and several rows at once, and nothing else."""
    keys, values = torch.randn(2, 3, 20, 8), torch.randn(2, 3, 20, 16)
    want_k, want_v = keys.clone(), values.clone()
    for position, n in ((0, 4), (4, 1), (5, 3)):
        k = torch.randn(2, n, 3, 8).transpose(1, 2)
        v = torch.randn(2, n, 3, 16).transpose(1, 2)
        ga.kv_write(keys, values, k, v, position)
        want_k.narrow(-2, position, n).copy_(k)
        want_v.narrow(-2, position, n).copy_(v)
        torch.testing.assert_close(keys, want_k, rtol=0, atol=0)
        torch.testing.assert_close(values, want_v, rtol=0, atol=0)
    ga.kv_write(keys, values, k[:, :, :0], v[:, :, :0], 20)  # nothing to write at the end: fine
    torch.testing.assert_close(keys, want_k, rtol=0, atol=0)


# A prefill (its query rows in slices over the threads), and a single sequence's decode over 3000
# keys: its KV heads split over the threads on Intel CPUs (bit-identical there), ggml's split of the
# keys elsewhere (other sums).
@pytest.mark.parametrize("hq, sq, skv", [(4, 200, 200), (8, 1, 3000)])
def test_thread_count_does_not_change_results(ga, hq, sq, skv):
    q, k, v = qkv(1, hq, 2, sq, skv, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ga.flash_attn(q, k, v, causal=True)
        torch.set_num_threads(2)
        two = ga.flash_attn(q, k, v, causal=True)
    finally:
        torch.set_num_threads(before)
    assert rel_err(one, two) < 1e-6  # the row split changes nothing per row; tiles may differ by an ulp
    assert rel_err(two, ga.reference.flash_attn(q, k, v, causal=True)) < TOL[torch.float32]


def test_empty(ga):
    q, k, v = qkv(1, 2, 1, 0, 5, 64)
    assert ga.flash_attn(q, k, v).shape == (1, 2, 0, 64)
    q, k, v = qkv(1, 2, 1, 3, 0, 64)
    assert ga.flash_attn(q, k, v).abs().sum() == 0


def test_torch_compile_fullgraph(ga):
    q, k, v = qkv(1, 4, 2, 6, 6, 64)
    f = torch.compile(lambda q, k, v: ga.flash_attn(q, k, v, causal=True) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(f(q, k, v), ga.flash_attn(q, k, v, causal=True) * 2, rtol=0, atol=0)


def test_kv_write_under_torch_compile(ga):
    """The in-place append traces (its schema declares the mutations) and writes the same rows."""
    def append_and_attend(keys, values, k, v, q, position: int):
        ga.kv_write(keys, values, k, v, position)
        return ga.flash_attn(q, keys[:, :, : position + 1], values[:, :, : position + 1], causal=True)

    q, k, v = qkv(1, 4, 2, 1, 1, 64)
    keys, values = torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    keys2, values2 = keys.clone(), values.clone()
    compiled = torch.compile(append_and_attend, fullgraph=True, backend="eager")
    got = compiled(keys, values, k, v, q, 3)
    want = append_and_attend(keys2, values2, k, v, q, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(keys, keys2, rtol=0, atol=0)
    torch.testing.assert_close(values, values2, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# non-finite inputs (README "Semantics"): SDPA's results, but for one case


def _one_infinite_key(b, hq, hkv, sq, skv, d, keys=1):
    """q/k/v whose logits are +inf at `keys` key(s) from j = skv // 3 for every query."""
    q, k, v = qkv(b, hq, hkv, sq, skv, d, seed=7)
    q[..., 0] = q[..., 0].abs() + 0.1
    k[:, :, skv // 3: skv // 3 + keys, 0] = float("inf")
    return q, k, v


@pytest.mark.parametrize("shape", [(1, 2, 1, 1, 40, 64), (2, 4, 2, 5, 40, 64), (1, 2, 1, 1, 700, 64), (1, 2, 1, 130, 140, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_infinite_logits(ga, shape):
    """A query whose logits hold +inf twice, or NaN, gets NaN as in SDPA and the reference. One +inf
    logit: SDPA and the reference give NaN; ggml gives NaN on its split-KV and tiled paths and that
    key's value row (the softmax's limit) on its row-by-row path, so each query row is one or the
    other (which, depends on the shapes and the threads)."""
    j = shape[4] // 3
    for keys in (1, 2):
        q, k, v = _one_infinite_key(*shape, keys=keys)
        out, ref = ga.flash_attn(q, k, v), ga.reference.flash_attn(q, k, v)
        sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert ref.isnan().all() and sdpa.isnan().all()
        if keys == 2:
            assert out.isnan().all()
            continue
        limit = v[:, :, j].repeat_interleave(shape[1] // shape[2], dim=1)[:, :, None].expand_as(out)
        assert (out.isnan().all(-1) | (out == limit).all(-1)).all()
    q, k, v = qkv(*shape)
    q[0, 0, 0, 0] = float("nan")
    out, sdpa = ga.flash_attn(q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out.isnan(), sdpa.isnan(), rtol=0, atol=0)
    assert out[0, 0, 0].isnan().all() and out.isnan().sum() == shape[5]


def test_infinite_values_as_sdpa(ga):
    """+inf / NaN in V reach the outputs that weigh them, as in SDPA and the reference."""
    q, k, v = qkv(1, 4, 2, 3, 40, 64)
    v[0, 0, 5, 3], v[0, 1, 7, 9] = float("inf"), float("nan")
    out = ga.flash_attn(q, k, v, causal=True)
    sq, skv = 3, 40
    visible = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    for want in (sdpa, ga.reference.flash_attn(q, k, v, causal=True)):
        torch.testing.assert_close(out.isnan(), want.isnan(), rtol=0, atol=0)
        torch.testing.assert_close(out.isinf(), want.isinf(), rtol=0, atol=0)
        finite = out.isfinite()
        assert rel_err(out[finite], want[finite]) < TOL[torch.float32]

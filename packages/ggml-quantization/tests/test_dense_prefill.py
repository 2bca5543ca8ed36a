"""`mul_mat`'s dense path (ggml_quantization/dense_prefill.py): block-32 weights times many rows as
ggml's dequantize and a bfloat16 GEMM, on CPUs with native bfloat16 dot products.

Tolerances:
- The dense product against x @ W.T of the dequantized weight (float64): x, W and the output are
  each rounded to bfloat16 once (relative error at most 2^-9 each; a bfloat16 x bfloat16 product is
  exact in float32) and the sum runs in float32 (K * 2^-24 relative at most, 2e-5 at K = 288). So an
  entry is off by at most ~3 * 2^-9 of the sum of |x_i w_i|; checked against 2^-7 (= 4 * 2^-9) of
  that sum, entry by entry, which leaves the second-order terms room.
- ggml's path (`exact=True`): the same bounds as test_ops.py's (MATMUL_RTOL against the reference
  that rounds activations as ggml does), and bit for bit the op itself.
- Which path ran is checked bit for bit: the two paths differ by ggml's 8-bit activation rounding,
  ~1e-2 of the output's scale, never 0.
The routing tests set NATIVE_BF16 themselves, so they hold on any CPU; the products are computed by
`dense_prefill.matmul` directly, which runs anywhere (slowly where bfloat16 is emulated).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tools.testing.kernel_testing import on_meta

BLOCK_32 = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}
MATMUL_RTOL = 2e-3  # test_ops.py's, for ggml's path against the emulated reference


@pytest.fixture
def bf16_cpu(gq, monkeypatch):
    """The routing as on a CPU with native bfloat16 dot products and no AMX, whatever this one is."""
    monkeypatch.setattr(gq.dense_prefill, "NATIVE_BF16", True)
    monkeypatch.setattr(gq.dense_prefill, "AMX_BF16", False)
    return gq


@pytest.fixture
def amx_cpu(bf16_cpu, monkeypatch):
    """The routing as on a CPU with AMX tiles."""
    monkeypatch.setattr(bf16_cpu.dense_prefill, "AMX_BF16", True)
    return bf16_cpu


K_QUANTS_ON_AMX = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def packed(gq, name: str, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = gq.quantize(torch.randn(n, k, generator=gen), name)
    return blocks, gq.dequantize(blocks, name, n, k)  # the weight the model means, float32


def rows(m: int, k: int, seed: int = 1, *lead: int) -> torch.Tensor:
    return torch.randn(*lead, m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(BLOCK_32))
@pytest.mark.parametrize("extra", [0, 13])
def test_product_of_the_dequantized_weight(gq, bf16_cpu, name, extra):
    n, k = 160, 288
    blocks, w = packed(gq, name, n, k)
    m = gq.dense_prefill.MIN_ROWS[BLOCK_32[name]] + extra
    x = rows(m, k)
    got = gq.mul_mat(blocks, x, name, n)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got, gq.dense_prefill.matmul(blocks, x, BLOCK_32[name], n))
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    assert ((got.double() - exact).abs() <= 2**-7 * magnitude).all()
    # ggml's path, asked for: its own op, 8-bit activations, farther from the float product on average
    ggml = gq.mul_mat(blocks, x, name, n, exact=True)
    assert torch.equal(ggml, gq.ops.mul_mat(blocks, x, BLOCK_32[name], n))
    ref = gq.reference.mul_mat_emulated(blocks, x, BLOCK_32[name], n)
    assert (ggml.double() - ref.double()).abs().max() < MATMUL_RTOL * ref.abs().max()
    assert (got.double() - exact).abs().mean() < (ggml.double() - exact).abs().mean()


@pytest.mark.parametrize("name", list(BLOCK_32))
def test_threshold_boundary(gq, bf16_cpu, name):
    """MIN_ROWS - 1 rows run ggml's op, MIN_ROWS rows the dense path; leading dims count as rows."""
    t, n, k = BLOCK_32[name], 40, 64
    blocks, _ = packed(gq, name, n, k, seed=t)
    at = gq.dense_prefill.MIN_ROWS[t]
    below = rows(at - 1, k)
    assert torch.equal(gq.mul_mat(blocks, below, name, n), gq.ops.mul_mat(blocks, below, t, n))
    x = rows(at, k)
    assert torch.equal(gq.mul_mat(blocks, x, name, n), gq.dense_prefill.matmul(blocks, x, t, n))
    assert not torch.equal(gq.mul_mat(blocks, x, name, n, exact=True), gq.mul_mat(blocks, x, name, n))
    lead = x.view(2, at // 2, k)
    assert torch.equal(gq.mul_mat(blocks, lead, name, n).view(at, n), gq.mul_mat(blocks, x, name, n))


@pytest.mark.parametrize("name", list(K_QUANTS_ON_AMX))
def test_k_quants_on_an_amx_cpu(gq, amx_cpu, name, monkeypatch):
    """With AMX, Q4_K / Q5_K / Q6_K from AMX_MIN_ROWS rows, within the same bound as the block-32
    types (the path does not depend on the type past ggml's dequantize); without AMX never."""
    dp = gq.dense_prefill
    t, n, k = K_QUANTS_ON_AMX[name], 48, 512
    blocks, w = packed(gq, name, n, k, seed=t)
    at = dp.AMX_MIN_ROWS[t]
    assert dp.min_rows(t) == at
    below, x = rows(at - 1, k), rows(at, k)
    assert torch.equal(gq.mul_mat(blocks, below, name, n), gq.ops.mul_mat(blocks, below, t, n))
    got = gq.mul_mat(blocks, x, name, n)
    assert torch.equal(got, dp.matmul(blocks, x, t, n))
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).abs() <= 2**-7 * (x.double().abs() @ w.double().abs().T)).all()
    if t in gq.repacked_types():  # a repacked weight by its GGUF type, dequantized through the inverse
        assert torch.equal(gq.mul_mat(gq.repack(blocks, t), x, gq.repacked_type(t), n), got)
    monkeypatch.setattr(dp, "AMX_BF16", False)
    assert dp.min_rows(t) is None and not dp.applies(blocks, x, t)


def test_amx_bf16_reads_the_cpu_flags(gq):
    dp = gq.dense_prefill
    assert dp.AMX_BF16 == ("amx_bf16" in gq.cpu.flags(gq.cpu.CPU))
    assert set(dp.AMX_MIN_ROWS).isdisjoint(dp.MIN_ROWS)


def test_where_it_applies(gq, bf16_cpu, monkeypatch):
    dp = gq.dense_prefill
    blocks, _ = packed(gq, "Q4_0", 64, 64)
    x = rows(512, 64)
    # a repacked weight by its GGUF type, where this CPU has the layout (ggml refuses the id elsewhere)
    assert dp.applies(blocks, x, gq.repacked_type("Q4_0")) == (2 in gq.repacked_types())
    for other in ("F32", "F16", "BF16", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "MXFP4"):
        assert not dp.applies(blocks, x, int(gq.GGMLType[other])), other  # ggml's own products keep up (no AMX)
    assert not dp.applies(blocks, torch.ones(512, 64, dtype=torch.int64), 2)  # refused by ggml's checks
    assert not dp.applies(blocks.view(torch.int8), x, 2)
    assert not dp.applies(blocks, on_meta(x), 2) and not dp.applies(on_meta(blocks), x, 2)
    monkeypatch.setattr(dp, "NATIVE_BF16", False)  # emulated bfloat16: ggml's path is faster
    assert not dp.applies(blocks, x, 2)
    assert torch.equal(gq.mul_mat(blocks, x, "Q4_0", 64), gq.ops.mul_mat(blocks, x, 2, 64))


def test_may_apply_decides_a_group_once(gq, bf16_cpu, monkeypatch):
    """may_apply(x) is False wherever applies is False for every type (fewer rows than the lowest
    threshold, no native bfloat16), so mul_mat_group skips the per-weight check at a decode step's rows."""
    dp = gq.dense_prefill
    first = min(dp.MIN_ROWS, key=dp.MIN_ROWS.get)  # the type with the lowest threshold
    fewest = dp.MIN_ROWS[first]
    blocks, _ = packed(gq, gq.GGMLType(first).name, 64, 64)
    assert not dp.may_apply(rows(fewest - 1, 64)) and not dp.applies(blocks, rows(fewest - 1, 64), first)
    assert dp.may_apply(rows(fewest, 64)) and dp.applies(blocks, rows(fewest, 64), first)
    monkeypatch.setattr(dp, "NATIVE_BF16", False)
    assert not dp.may_apply(rows(512, 64))


def test_repacked_weight(gq, bf16_cpu):
    t = int(gq.GGMLType.Q4_0)
    if t not in gq.repacked_types():
        pytest.skip("this CPU's ggml does not repack Q4_0")
    blocks, _ = packed(gq, "Q4_0", 48, 128, seed=3)
    x = rows(gq.dense_prefill.MIN_ROWS[t], 128)
    got = gq.mul_mat(gq.repack(blocks, t), x, gq.repacked_type(t), 48)
    assert torch.equal(got, gq.mul_mat(blocks, x, t, 48))


def test_chunks_give_the_same_product(gq, monkeypatch):
    n, k = 1000, 256
    blocks, _ = packed(gq, "Q4_1", n, k, seed=2)
    x = rows(64, k, seed=3)
    whole = gq.dense_prefill.matmul(blocks, x, 3, n)
    monkeypatch.setattr(gq.dense_prefill, "CHUNK_BYTES", 2 * k * 300)  # chunks of 384, 384 and 232 rows
    assert gq.dense_prefill.chunk_rows(n, k) == 384
    torch.testing.assert_close(gq.dense_prefill.matmul(blocks, x, 3, n), whole, rtol=0, atol=0)


def test_chunk_rows_cut_equal_chunks_of_one_to_two_chunk_bytes(gq, monkeypatch):
    dp = gq.dense_prefill
    monkeypatch.setattr(dp, "CHUNK_BYTES", 1 << 20)
    assert dp.chunk_rows(1536, 576) >= 1536  # 1.7 MiB of bfloat16: one chunk
    assert dp.chunk_rows(100, 128) >= 100
    for n, k, chunks in ((9216, 2560, 45), (3584, 1024, 7), (2560, 9216, 45), (151936, 1024, 296)):
        rows = dp.chunk_rows(n, k)
        assert rows % dp.CHUNK_ROWS_MULTIPLE == 0 and rows % 8 == 0  # whole groups of a repacked weight
        assert rows >= -(-n // chunks) and (rows - dp.CHUNK_ROWS_MULTIPLE) * chunks < n, (n, k, rows)


def test_l2_cache_bytes_reads_sysfs(gq, tmp_path):
    dp = gq.dense_prefill
    caches = [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "2048K"), ("3", "Unified", "32M")]
    for i, (level, kind, size) in enumerate(caches):
        index = tmp_path / f"index{i}"
        index.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(value + "\n")
    assert dp.l2_cache_bytes(str(tmp_path)) == 2 << 20
    (tmp_path / "index2" / "size").write_text("2M\n")
    assert dp.l2_cache_bytes(str(tmp_path)) == 2 << 20
    (tmp_path / "index2" / "size").write_text("big\n")
    assert dp.l2_cache_bytes(str(tmp_path)) is None
    assert dp.l2_cache_bytes(str(tmp_path / "missing")) is None
    assert dp.CHUNK_BYTES == (dp.l2_cache_bytes() or dp.ASSUMED_L2_BYTES)


def test_a_row_s_product_barely_depends_on_the_rows_beside_it(gq):
    """What the path guarantees a left-padded batch: torch's bfloat16 GEMM may pick another kernel for
    another row count (oneDNN on AMX CPUs does), whose float32 accumulation order differs; the output,
    rounded to bfloat16, then moves by at most one bfloat16 step (2^-7 of the value) per entry."""
    n, k = 256, 512
    blocks, w = packed(gq, "Q4_0", n, k, seed=6)
    x = rows(48, k, seed=7)
    batch = gq.dense_prefill.matmul(blocks, x, 2, n)
    magnitude = x.abs() @ w.abs().T
    for part in (slice(0, 9), slice(39, 48), slice(0, 24), slice(24, 48)):
        alone = gq.dense_prefill.matmul(blocks, x[part], 2, n)
        assert ((alone - batch[part]).abs() <= 2**-7 * batch[part].abs() + 2**-20 * magnitude[part]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations(gq, dtype):
    n, k = 96, 128
    blocks, w = packed(gq, "Q8_0", n, k, seed=4)
    x = rows(64, k, seed=5).to(dtype)
    got = gq.dense_prefill.matmul(blocks, x, 8, n)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x.bfloat16(), w.bfloat16()).float(), rtol=0, atol=0)


def test_nan_stays_in_its_row(gq):
    blocks, _ = packed(gq, "Q4_1", 32, 64)
    x = rows(40, 64)
    x[3, 5] = float("nan")
    got = gq.dense_prefill.matmul(blocks, x, 3, 32)
    assert got[3].isnan().all() and not got[torch.arange(40) != 3].isnan().any()


def test_torch_compile_traces_both_paths(gq, bf16_cpu):
    blocks, _ = packed(gq, "Q4_1", 48, 64)

    def f(x):
        return gq.mul_mat(blocks, x, "Q4_1", 48) + gq.mul_mat(blocks, x, "Q4_1", 48, exact=True)

    x = rows(40, 64)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)


def _refusal(call):
    with pytest.raises((TypeError, ValueError)) as err:
        call()
    return type(err.value), str(err.value)


def test_bad_input_refused_as_on_ggml_s_path(gq, bf16_cpu):
    """Input that passes `applies` but that ggml's op refuses gets the same exception, same words."""
    k, n = 64, 16
    blocks, _ = packed(gq, "Q8_0", n, k)
    x = rows(max(gq.dense_prefill.MIN_ROWS.values()), k)  # every type's dense path
    wide = torch.zeros(n, 2 * blocks.shape[1], dtype=torch.uint8)
    big = torch.zeros(1024, 8 * 34, dtype=torch.uint8)
    cases = {
        "out_features": (blocks, x, "Q8_0", n + 1),
        "K": (blocks, rows(len(x), 2 * k), "Q8_0", n),
        "row bytes": (blocks[:, :30].contiguous(), x, "Q8_0", n),
        "not contiguous": (wide[:, ::2], x, "Q8_0", n),
        "blocks 3-D": (blocks[None], x, "Q8_0", n),
        "repacked rows": (gq.quantize(torch.randn(12, k), "Q4_0"), x, gq.repacked_type("Q4_0"), 12),
        "no repacked Q4_1 here": (gq.quantize(torch.randn(16, k), "Q4_1"), x, gq.repacked_type("Q4_1"), 16),
        "the product": (big, torch.ones(1, 256).expand(2**24, 256), "Q8_0", 1024),
    }
    for what, (b, xx, t, nn) in cases.items():
        dense = _refusal(lambda b=b, xx=xx, t=t, nn=nn: gq.mul_mat(b, xx, t, nn))
        assert dense == _refusal(lambda b=b, xx=xx, t=t, nn=nn: gq.mul_mat(b, xx, t, nn, exact=True)), what


def test_native_bf16_dot_reads_the_cpu_flags(gq, tmp_path):
    dp = gq.dense_prefill
    for flags, native in (("fpu avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True), ("fpu avx512f avx2", False)):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert dp.native_bf16_dot(str(cpuinfo)) is native
    assert dp.native_bf16_dot(str(tmp_path / "missing")) is False
    with open("/proc/cpuinfo") as f:
        here = next(line for line in f if line.startswith("flags")).split()
    assert dp.NATIVE_BF16 == dp.native_bf16_dot() == bool(dp.BF16_DOT_FLAGS & set(here))


def test_metal_builds_keep_ggml_s_kernels(gq, metal, monkeypatch):
    monkeypatch.setattr(metal.dense_prefill, "NATIVE_BF16", True)
    blocks = gq.quantize(torch.randn(32, 64), "Q4_0")  # quantize is the CPU build's alone
    x = rows(metal.dense_prefill.MIN_ROWS[2], 64)
    assert not metal.dense_prefill.applies(blocks, x, 2)
    assert torch.equal(metal.mul_mat(blocks, x, "Q4_0", 32), metal.mul_mat(blocks, x, "Q4_0", 32, exact=True))

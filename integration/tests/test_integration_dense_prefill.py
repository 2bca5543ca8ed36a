"""Prefill matmuls on block-32 weights through ggml's dequantize and a bfloat16 GEMM
(`ggml_kernels_integration.dense_prefill`): the product is x @ W.T of the dequantized weight within
bfloat16's rounding, chunking does not change it, and the path is taken exactly where it is meant to
be (block-32 types, enough rows, a CPU with bfloat16 dot products, not switched off). Whole-model
agreement with float32 transformers and llama.cpp: integration/tests/test_integration.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ggml_kernels_integration import dense_prefill

from tools.testing.kernel_testing import load_kernel

BLOCK_32 = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}


@pytest.fixture(scope="module")
def quant():
    return load_kernel("ggml-org/ggml-quantization")


@pytest.fixture
def restore_state():
    saved = dict(dense_prefill._state), dict(dense_prefill.MIN_ROWS), dense_prefill.CHUNK_BYTES
    yield
    dense_prefill._state.update(saved[0])
    dense_prefill.MIN_ROWS.clear()
    dense_prefill.MIN_ROWS.update(saved[1])
    dense_prefill.CHUNK_BYTES = saved[2]


def packed(quant, name: str, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    blocks = quant.quantize(w, name)
    return blocks, quant.dequantize(blocks, name, n, k)  # the weight the model means, float32


@pytest.mark.parametrize("name", list(BLOCK_32))
@pytest.mark.parametrize("m", [32, 77])
def test_product_of_the_dequantized_weight(quant, name, m):
    """Within bfloat16 rounding of x, W and the output (float32 accumulation): each of the three
    carries a relative error of at most 2^-9, so an entry is off by at most ~3 * 2^-9 of the sum of
    |x_i w_i|; checked as 2^-6 of that bound, entry by entry."""
    n, k = 160, 288
    blocks, w = packed(quant, name, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    got = dense_prefill.matmul(quant, blocks, x, BLOCK_32[name], n)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    exact = (x.double() @ w.double().T)
    magnitude = x.double().abs() @ w.double().abs().T
    assert ((got.double() - exact).abs() <= 2**-6 * magnitude).all()
    # and it is not ggml's 8-bit-activation product in disguise: closer to the exact one on average
    ggml = quant.mul_mat(blocks, x, name, n)
    assert (got.double() - exact).abs().mean() < (ggml.double() - exact).abs().mean()


def test_chunks_give_the_same_product(quant, restore_state):
    n, k = 1000, 256
    blocks, _ = packed(quant, "Q4_1", n, k, seed=2)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3))
    whole = dense_prefill.matmul(quant, blocks, x, BLOCK_32["Q4_1"], n)
    dense_prefill.CHUNK_BYTES = 2 * k * 300  # 300 rows a chunk (the floor is 256): chunks of 300, 300, 300, 100
    chunked = dense_prefill.matmul(quant, blocks, x, BLOCK_32["Q4_1"], n)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)


def test_a_row_s_product_barely_depends_on_the_rows_beside_it(quant):
    """What the path guarantees a left-padded batch: torch's bfloat16 GEMM may pick another kernel for
    another row count (oneDNN on AMX CPUs does), whose float32 accumulation order differs; the output,
    rounded to bfloat16, then moves by at most one bfloat16 step (2^-7 of the value) per entry. ggml's
    own path computes every row alone and is exact here (integration/tests/test_integration.py holds both)."""
    n, k = 256, 512
    blocks, w = packed(quant, "Q4_0", n, k, seed=6)
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(7))
    batch = dense_prefill.matmul(quant, blocks, x, BLOCK_32["Q4_0"], n)
    magnitude = x.abs() @ w.abs().T
    for rows in (slice(0, 9), slice(39, 48), slice(0, 24), slice(24, 48)):
        alone = dense_prefill.matmul(quant, blocks, x[rows], BLOCK_32["Q4_0"], n)
        bound = 2**-7 * batch[rows].abs() + 2**-20 * magnitude[rows]
        assert ((alone - batch[rows]).abs() <= bound).all()


def test_bfloat16_activations(quant):
    n, k = 96, 128
    blocks, w = packed(quant, "Q8_0", n, k, seed=4)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = dense_prefill.matmul(quant, blocks, x, BLOCK_32["Q8_0"], n)
    torch.testing.assert_close(got, F.linear(x, w.bfloat16()).float(), rtol=0, atol=0)


def test_where_it_applies(quant, restore_state, monkeypatch):
    monkeypatch.setattr(dense_prefill, "native_bf16", lambda: True)
    dense_prefill.set_enabled(True)
    assert dense_prefill.applies(quant, BLOCK_32["Q4_1"], 32) and not dense_prefill.applies(quant, BLOCK_32["Q4_1"], 31)
    assert dense_prefill.applies(quant, BLOCK_32["Q8_0"], 64) and not dense_prefill.applies(quant, BLOCK_32["Q8_0"], 63)
    assert dense_prefill.applies(quant, quant.repacked_type("Q4_0"), 32)  # a repacked weight: by its GGUF type
    for k_quant in (10, 11, 12, 13, 14):  # Q2_K .. Q6_K: ggml's own products are as fast
        assert not dense_prefill.applies(quant, k_quant, 512)
    dense_prefill.set_enabled(False)
    assert not dense_prefill.applies(quant, BLOCK_32["Q4_1"], 512)
    dense_prefill.set_enabled(True)
    monkeypatch.setattr(dense_prefill, "native_bf16", lambda: False)  # emulated bfloat16: slower than ggml
    assert not dense_prefill.applies(quant, BLOCK_32["Q4_1"], 512)


def test_native_bf16_reads_the_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert dense_prefill.native_bf16() == bool({"avx512_bf16", "amx_bf16"} & set(flags))


@pytest.mark.slow  # a fresh process
def test_enable_switches_it():
    """`enable(dense_prefill=False)` keeps every prefill matmul on ggml; a later `enable()` turns the
    path back on (enable() patches transformers for the whole process: a fresh one)."""
    from tools.testing.kernel_testing import fresh_process

    proc = fresh_process(
        "import ggml_kernels_integration as gk\n"
        "from ggml_kernels_integration import dense_prefill as d\n"
        "gk.enable(dense_prefill=False); off = d._state['enabled']\n"
        "gk.enable(); on = d._state['enabled']\n"
        "print('RESULT', off, on)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("RESULT")[-1].split() == ["False", "True"]

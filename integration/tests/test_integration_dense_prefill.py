"""Prefill matmuls through `ggml_kernels_integration.dense_prefill`: ggml-quantization's mul_mat
chooses the path (its dense one, packages/ggml-quantization/tests/test_dense_prefill.py holds its
numbers and thresholds), and `enable(dense_prefill=False)` asks it for ggml's exact path. Whole-model
agreement with float32 transformers and llama.cpp on each path: integration/tests/test_integration.py."""

from __future__ import annotations

import pytest
import torch
from ggml_kernels_integration import dense_prefill

from tools.testing.kernel_testing import load_kernel


@pytest.fixture(scope="module")
def quant():
    return load_kernel("ggml-org/ggml-quantization")


@pytest.fixture
def restore_state():
    saved = dict(dense_prefill._state)
    yield
    dense_prefill._state.update(saved)


def test_the_switch_chooses_mul_mat_s_path(quant, restore_state, monkeypatch):
    """On (the default): mul_mat as it chooses, the dense path at 64 rows of Q4_1 on a bfloat16 CPU;
    off: ggml's exact path. The two differ by ggml's 8-bit activations, so bit equality tells them apart."""
    monkeypatch.setattr(quant.dense_prefill, "NATIVE_BF16", True)  # the choice as on such a CPU, on any
    n, k = 96, 256
    blocks = quant.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), "Q4_1")
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    t = int(quant.GGMLType.Q4_1)
    dense_prefill.set_enabled(True)
    chosen = dense_prefill.mul_mat(quant, blocks, x, t, n)
    assert torch.equal(chosen, quant.dense_prefill.matmul(blocks, x, t, n))
    dense_prefill.set_enabled(False)
    exact = dense_prefill.mul_mat(quant, blocks, x, t, n)
    assert torch.equal(exact, quant.ops.mul_mat(blocks, x, t, n))
    assert not torch.equal(chosen, exact)


def test_native_bf16_is_the_package_s(quant):
    assert dense_prefill.package().dense_prefill is quant.dense_prefill
    assert dense_prefill.native_bf16() == quant.dense_prefill.NATIVE_BF16


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

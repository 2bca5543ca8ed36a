"""Several Python threads calling our ops at once get the serial results, bit for bit.

transformers may run a model from several threads (a server, a generate() per request), and every
op builds its own ggml context, graph and work buffer per call while sharing the ggml runtime, its
thread pools and torch's intra-op pool. Each case below is run once serially for its expected
result; then THREADS threads, released together, run each case ROUNDS times at once (the same op on
every thread), then all the cases ROUNDS times, each thread from its own place in the list
(different ops of every family overlapping). Every result must
equal the serial one exactly (torch.equal): the inputs are the same and a kernel's arithmetic does
not depend on what else runs, so any difference is shared state leaking between calls.

The in-place ops (`gated_delta_net_`, `causal_conv1d_`) update a fresh copy of their state on every
call, which is compared too. Shapes are large enough that the kernels split their work over
threads (several rows, K-quant blocks, a 256-key decode) and small enough for a few seconds.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tools.testing.kernel_testing import load_kernel

THREADS = 4
ROUNDS = 3
QTYPE = "Q4_K"  # 256-value super-blocks: the K-quant path of every quantized op
ROWS, COLS = 96, 512


@pytest.fixture(scope="module")
def cases():
    """name -> a call with fixed inputs, returning a tensor or a tuple of tensors."""
    gq = load_kernel("ggml-org/ggml-quantization")
    gn = load_kernel("ggml-org/ggml-norm")
    ga = load_kernel("ggml-org/ggml-attn")
    gdn = load_kernel("ggml-org/ggml-gated-delta-net")
    topk = load_kernel("transformers-community/topk")
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # quantization
    weights = gq.quantize(randn(ROWS, COLS), QTYPE)
    experts = gq.quantize(randn(4 * ROWS, COLS), QTYPE).view(4, ROWS, -1)
    x1, x16, x6 = randn(1, COLS), randn(16, COLS), randn(6, COLS)
    expert_ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)]).int()
    row_ids = torch.tensor([5, 0, 95, 5, 17], dtype=torch.int32)
    activations = randn(8, COLS)
    # norm
    hidden, norm_weight = randn(32, 1024), randn(1024)
    # attention: a prefill with GQA and the causal mask, a decode over 256 keys
    q, k, v = randn(1, 4, 64, 64), randn(1, 2, 64, 64), randn(1, 2, 64, 64)
    q_dec, k_dec, v_dec = randn(1, 8, 1, 64), randn(1, 2, 256, 64), randn(1, 2, 256, 64)
    # gated delta net (B, T, H, D) with a state, 2 key heads / 4 value heads, and its conv
    b, t, hk, hv, d = 1, 16, 2, 4, 64
    dq, dk = randn(b, t, hk, d) / d**0.5, torch.nn.functional.normalize(randn(b, t, hk, d), dim=-1)
    dv, decay, beta = randn(b, t, hv, d), -torch.rand(b, t, hv, generator=gen) * 0.5, torch.rand(b, t, hv, generator=gen)
    state = randn(b, hv, d, d) * 0.3
    _, ggml_state = gdn.gated_delta_net(dq, dk, dv, decay, beta, state)  # the layout gated_delta_net_ updates
    conv_x, conv_x1, conv_w, conv_state = randn(2, 80, 16), randn(2, 80, 1), randn(80, 1, 4), randn(2, 80, 4)
    A_log, dt_bias, gate_a, gate_b = randn(16), randn(16), randn(2, 7, 16) * 10, randn(2, 7, 16)
    # topk: router logits of 64 tokens over 128 experts
    logits = randn(64, 128)

    def in_place(op, state, *args, **kwargs):
        state = state.clone()
        return op(*args, state, **kwargs), state

    return {
        "mul_mat_vec": lambda: gq.mul_mat_vec(weights, x1, QTYPE, ROWS),
        "mul_mat": lambda: gq.mul_mat(weights, x16, QTYPE, ROWS),
        "mul_mat_id": lambda: gq.mul_mat_id(experts, x6, expert_ids, QTYPE, ROWS),
        "dequantize": lambda: gq.dequantize(weights, QTYPE, ROWS, COLS),
        "get_rows": lambda: gq.get_rows(weights, row_ids, QTYPE, COLS),
        "quantize": lambda: gq.quantize(activations, QTYPE),
        "rms_norm": lambda: gn.rms_norm(hidden, norm_weight, zero_centered=True),
        "l2_norm": lambda: gn.l2_norm(hidden),
        "flash_attn prefill": lambda: ga.flash_attn(q, k, v, causal=True),
        "flash_attn decode": lambda: ga.flash_attn(q_dec, k_dec, v_dec),
        "gated_delta_net": lambda: gdn.gated_delta_net(dq, dk, dv, decay, beta, state),
        "gated_delta_net_": lambda: in_place(gdn.gated_delta_net_, ggml_state, *(x[:, :1] for x in (dq, dk, dv, decay, beta))),
        "causal_conv1d": lambda: gdn.causal_conv1d(conv_x, conv_w, conv_state),
        "causal_conv1d_": lambda: in_place(gdn.causal_conv1d_, conv_state, conv_x1, conv_w),
        "gates": lambda: gdn.gates(A_log, gate_a, dt_bias, gate_b),
        "softmax_top_k": lambda: topk.softmax_top_k(logits, 8),
    }


def flat(result) -> list[torch.Tensor]:
    return [t for r in result for t in flat(r)] if isinstance(result, (tuple, list)) else [result]


def same(a, b) -> bool:
    a, b = flat(a), flat(b)
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_threads_get_the_serial_results_bit_for_bit(cases):
    names = list(cases)
    serial = {name: cases[name]() for name in names}
    for name in names:  # deterministic to begin with, or the comparison below says nothing
        assert same(cases[name](), serial[name]), name
    together = threading.Barrier(THREADS, timeout=120)
    mismatches, errors = [], []

    def check(i: int, name: str) -> None:
        if not same(cases[name](), serial[name]):
            mismatches.append((i, name))

    def worker(i: int) -> None:
        try:
            for name in names:  # every thread on the same op at once
                together.wait()
                for _ in range(ROUNDS):
                    check(i, name)
            together.wait()  # then every thread through all ops, each from its own place in the list
            for _ in range(ROUNDS):
                for name in names[i * len(names) // THREADS:] + names[: i * len(names) // THREADS]:
                    check(i, name)
        except Exception as e:  # reported below, with the thread it happened in
            errors.append((i, repr(e)))
            together.abort()  # the other threads stop waiting for this one

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [e for e in errors if "BrokenBarrierError" not in e[1]] == []
    assert errors == []
    assert mismatches == []

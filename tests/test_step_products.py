"""tools/bench/step_products.py: a forward's products in the step's order, ours against ggml's op.

What is checked is that the two sides compute the same products on the same inputs (the tiny
Qwen3.5 file's real packed weights, one row and a short prompt's rows), that the step's order and
groups are the integration's, and that the table reads the rounds right. No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tools import REPO
from tools.bench import step_products as sp
from tools.models import make_gguf
from tools.testing import ggml_ctypes

needs_ggml = pytest.mark.skipif(not ggml_ctypes.available(), reason=str(ggml_ctypes.unavailable_reason()))


@pytest.fixture(scope="module")
def step():
    return sp.packed_linears(make_gguf.ensure("qwen35-tiny", "Q4_K_M"))


@pytest.fixture(scope="module")
def kernel():
    from kernels import get_local_kernel

    return get_local_kernel(REPO / "packages" / "ggml-quantization", backend="cpu")


def test_step_runs_each_block_in_the_integrations_groups_then_the_head(step):
    kinds = [kind for kind, _ in step]
    assert kinds[-1] == sp.HEAD and kinds.count(sp.HEAD) == 1
    known = {kind for kind, _ in sp.STEP_GROUPS}
    assert set(kinds[:-1]) <= known
    # qwen35-tiny: 4 blocks, linear attention in 3 of them and full attention in one
    assert kinds.count("ffn gate/up") == kinds.count("ffn down") == 4
    assert kinds.count("linear-attn inputs") + kinds.count("attn q/k/v") == 4
    names = dict(sp.STEP_GROUPS)
    for kind, ws in step:
        assert 1 <= len(ws) <= len(names.get(kind, ("output",)))
        for blocks, _, cols, rows in ws:
            assert blocks.dtype == torch.uint8 and blocks.shape[0] == rows and cols == ws[0][2]


@needs_ggml
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_both_sides_compute_the_same_products(step, kernel, rows):
    xs = sp.activations(step, rows)
    assert [x.shape[0] for x in xs] == [sp.rows_of(kind, rows) for kind, _ in step]
    assert xs[-1].shape[0] == 1  # the head: the last token's row alone
    ours = sp.ours(kernel, step, xs)
    theirs = sp.ggml_ops(step, torch.get_num_threads(), xs)
    for (kind, our_call), (_, ggml_call), (_, ws) in zip(ours, theirs, step, strict=True):
        got, graphs = our_call(), ggml_call()
        assert len(got) == len(graphs) == len(ws), kind
        for out, g in zip(got, graphs, strict=True):
            expected = g.output()
            # ggml's kernels on both sides, its activation rounding included: equal to float32
            # rounding of the sums (the slices' graphs may take other kernels than the whole op)
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(),
                                       err_msg=f"{kind}, {rows} rows")


@needs_ggml
def test_cli_prints_every_kind_and_the_total(step, capsys):
    sp.main(["--gguf", str(make_gguf.ensure("qwen35-tiny", "Q4_K_M")), "--rows", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "a 4-token prompt's" in out and "1 alternating rounds" in out
    for kind in {kind for kind, _ in step} | {"all"}:
        assert f"  {kind} " in out


def test_cli_refuses_zero_rows():
    with pytest.raises(SystemExit):
        sp.main(["--gguf", "x.gguf", "--rows", "0"])


def test_table_reports_medians_and_the_ratio_of_ggml_over_ours():
    got = {"ours": [{"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 2.0}, {"a": 2.0, "b": 2.0}],
           "ggml": [{"a": 2.0, "b": 2.0}, {"a": 3.0, "b": 1.0}, {"a": 4.0, "b": 2.0}]}
    lines = sp.table(["a", "b"], got)
    a, b, total = (line.split() for line in lines[1:])
    assert a[:4] == ["a", "2.00", "3.00", "2.00x"]  # ratios 2, 1, 2
    assert b[:4] == ["b", "2.00", "2.00", "1.00x"]  # ratios 1, 0.5, 1
    assert total[:4] == ["all", "4.00", "4.00", "1.33x"]  # totals 3/5/4 and 4/4/6: ratios 4/3, 4/5, 6/4


def test_alternate_swaps_the_order_every_round():
    order = []
    sides = {"ours": [("k", lambda: order.append("ours"))], "ggml": [("k", lambda: order.append("ggml"))]}
    got = sp.alternate(sides, 3)
    assert order[6:] == ["ours", "ggml", "ggml", "ours", "ours", "ggml"]  # after 3 warm-ups each
    assert [len(v) for v in got.values()] == [3, 3]

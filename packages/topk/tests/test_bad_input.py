"""Bad input gets a clear Python exception naming the problem, never a crash or an index out of range.
Each case calls the op directly (torch.ops) as well, since the checks live in the kernel; the
reference raises the same exception types. Tests taking `build` run on each build kind of the
package (conftest.py: cpu, metal-emu, mps-emu): the checks are shared, the words the same; those
taking `tk` the CPU build alone."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import assert_fake_refuses_as_cpu

NAN, INF = float("nan"), float("inf")


def test_k_too_large(build):
    x = torch.randn(3, 8)
    for f in (build.top_k, build.softmax_top_k, build.top_k_ggml, build.reference.top_k, build.reference.softmax_top_k):
        with pytest.raises(ValueError, match=r"k=9 is larger than the number of experts \(8"):
            f(x, 9)
    with pytest.raises(ValueError, match="k=9 is larger than the number of experts"):
        build.ops.top_k(x, 9, True, False, None, None)


@pytest.mark.parametrize("k", [0, -1, -100])
def test_k_not_positive(build, k):
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=f"k must be at least 1, got k={k}"):
        build.softmax_top_k(x, k)
    with pytest.raises(ValueError, match="k must be at least 1"):
        build.ops.top_k(x, k, True, True, None, None)
    with pytest.raises(ValueError, match="k must be at least 1"):
        build.reference.softmax_top_k(x, k)


@pytest.mark.parametrize("k", [2.0, "2", None, True])
def test_k_not_an_integer(build, k):
    with pytest.raises(TypeError, match="k must be an integer"):
        build.softmax_top_k(torch.randn(3, 8), k)


def test_k_as_tensor_or_numpy_int(build):
    import numpy as np

    x = torch.randn(3, 8)
    assert build.softmax_top_k(x, np.int64(2))[1].shape == (3, 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8])
def test_non_float_logits(build, dtype):
    x = torch.ones(3, 8, dtype=dtype)
    with pytest.raises(TypeError, match="logits must have dtype Float, BFloat16, Half"):
        build.softmax_top_k(x, 2)
    with pytest.raises(TypeError, match="logits must have dtype"):
        build.top_k(x, 2, softmax=False)
    with pytest.raises(TypeError, match="logits must have dtype"):
        build.reference.softmax_top_k(x, 2)


def test_wrong_dims(build):
    with pytest.raises(ValueError, match="at least one dim"):
        build.softmax_top_k(torch.tensor(1.0), 1)
    with pytest.raises(ValueError, match=r"logits must be 2-D \(tokens, experts\)"):
        build.ops.top_k(torch.randn(2, 3, 8), 2, True, False, None, None)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        build.ops.top_k(torch.randn(8), 2, True, False, None, None)
    with pytest.raises(ValueError, match="k=1 is larger than the number of experts"):
        build.softmax_top_k(torch.randn(4, 0), 1)


def test_not_a_tensor(build):
    with pytest.raises(TypeError, match="logits must be a tensor"):
        build.softmax_top_k([[1.0, 2.0]], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softmax", [True, False])
def test_nan_is_a_value_error(build, dtype, softmax):
    x = torch.randn(5, 64).to(dtype)
    x[3, 17] = NAN
    x[4, 0] = NAN
    with pytest.raises(ValueError, match=r"logits contain NaN \(first in token row 3 of 5\)"):
        build.top_k(x, 8, softmax)
    with pytest.raises(ValueError, match="logits contain NaN"):
        build.top_k_ggml(x, 8, softmax)
    with pytest.raises(ValueError, match=r"logits contain NaN \(first in token row 3\)"):
        build.reference.top_k(x, 8, softmax)


def test_nan_in_a_big_batch(build):
    """Rows split over threads: the first offending row is named, whichever thread saw it."""
    x = torch.randn(4096, 128)
    x[4000, 5] = NAN
    x[1234, 0] = NAN
    with pytest.raises(ValueError, match="first in token row 1234 of 4096"):
        build.softmax_top_k(x, 8)


# CPU build alone: on Metal the -inf rows' ties come out in the kernel's order, not torch.topk's
def test_all_neg_inf_row(tk):
    x = torch.randn(3, 16)
    x[1] = -INF
    with pytest.raises(ValueError, match="every logit of token row 1 is -inf"):
        tk.softmax_top_k(x, 2)
    with pytest.raises(ValueError, match="every logit of token row 1 is -inf"):
        tk.top_k_ggml(x, 2)
    with pytest.raises(ValueError, match="every logit of token row 1 is -inf"):
        tk.reference.softmax_top_k(x, 2)
    # without softmax the values are just values: torch.topk's answer
    w, i = tk.top_k(x, 2, softmax=False)
    tw, ti = torch.topk(x, 2)
    assert torch.equal(w, tw) and torch.equal(i, ti)


# CPU build alone: a Metal build's top_k_ggml is its top_k, and the message names that
def test_pos_inf_in_ggml_variant(tk):
    x = torch.randn(2, 16)
    x[0, 3] = INF
    with pytest.raises(ValueError, match=r"top_k_ggml: token row 0 holds \+inf"):
        tk.top_k_ggml(x, 2)


def test_normalize_without_softmax(build):
    with pytest.raises(ValueError, match="normalize=True needs softmax=True"):
        build.ops.top_k(torch.randn(2, 8), 2, False, True, None, None)


def test_bad_dtypes_for_outputs(build):
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="dtype \\(of the weights\\) must be float32, bfloat16 or float16"):
        build.softmax_top_k(x, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="index_dtype must be int64 or int32"):
        build.softmax_top_k(x, 2, index_dtype=torch.int16)


# CPU build alone: ties (inf, -inf, 3e38) compared index for index with the reference's order
def test_indices_always_in_range(tk):
    """Whatever finite / infinite mix a row holds, every index lies in [0, E)."""
    g = torch.Generator().manual_seed(0)
    choices = torch.tensor([-INF, INF, 0.0, 1.0, -1.0, 3e38, -3e38, 1e-45])
    x = choices[torch.randint(0, len(choices), (2000, 33), generator=g)]
    x[:, 0] = 0.0  # at least one finite logit per row
    for softmax in (True, False):
        w, i = tk.top_k(x, 16, softmax)
        assert i.min() >= 0 and i.max() < 33
        assert not w.isnan().any()
        rw, ri = tk.reference.top_k(x, 16, softmax)
        assert torch.equal(i, ri)
        torch.testing.assert_close(w, rw)


def test_device_mismatch_and_meta(build):
    """A meta tensor (stand-in for an accelerator) goes to the shape-only implementation."""
    w, i = build.softmax_top_k(torch.empty(5, 64, device="meta"), 8)
    assert w.device.type == "meta" and w.shape == (5, 8) and i.dtype == torch.int64
    with pytest.raises(ValueError, match="k=65 is larger than the number of experts"):
        build.softmax_top_k(torch.empty(5, 64, device="meta"), 65)


# Each case is an op of torch.ops (as a compiled graph calls it) and its arguments: the kernel refuses
# them on the CPU, and the fake implementation (what torch.compile traces with) refuses the same
# arguments as meta tensors with the same exception type and message.
def _logits(*shape, dtype=torch.float32):
    return torch.zeros(shape or (3, 8), dtype=dtype)


FAKE_CASES = {
    "top_k logits 3-D": ("top_k", lambda: (_logits(1, 3, 8), 2, True, False, None, None)),
    "top_k logits 1-D": ("top_k", lambda: (_logits(8), 2, True, False, None, None)),
    "top_k logits float64": ("top_k", lambda: (_logits(dtype=torch.float64), 2, True, False, None, None)),
    "top_k k 0": ("top_k", lambda: (_logits(), 0, True, False, None, None)),
    "top_k k > experts": ("top_k", lambda: (_logits(), 9, True, False, None, None)),
    "top_k normalize without softmax": ("top_k", lambda: (_logits(), 2, False, True, None, None)),
    "top_k weights dtype": ("top_k", lambda: (_logits(), 2, True, False, torch.int32, None)),
    "top_k index dtype": ("top_k", lambda: (_logits(), 2, True, False, None, torch.float32)),
    "top_k index int16": ("top_k", lambda: (_logits(), 2, True, False, None, torch.int16)),
    "top_k_ggml k > experts": ("top_k_ggml", lambda: (_logits(), 9, True, False)),
    "top_k_ggml logits int": ("top_k_ggml", lambda: (_logits(dtype=torch.int32), 2, True, False)),
    "top_k_ggml normalize without softmax": ("top_k_ggml", lambda: (_logits(), 2, False, True)),
}


@pytest.mark.parametrize("case", sorted(FAKE_CASES))
def test_fake_refuses_what_the_kernel_refuses(build, case):
    op, args = FAKE_CASES[case]
    assert_fake_refuses_as_cpu(getattr(build.ops, op), *args())

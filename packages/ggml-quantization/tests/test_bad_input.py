"""Bad input gets a clear Python exception naming the problem, never a crash or an out-of-bounds read.
Each case calls the op directly (torch.ops) as well, since the checks live in the kernel. Tests
taking `build` run on each build kind of the package (conftest.py: cpu, metal-emu, mps-emu): the
checks are shared, the words the same; those taking `gq` the CPU build alone."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import assert_fake_refuses_as_cpu, on_meta

K, N = 256, 8


@pytest.fixture(scope="module")
def w(gq):
    return gq.quantize(torch.randn(N, K), "Q4_K")


def test_blocks_not_uint8(build, w):
    with pytest.raises(TypeError, match="blocks must have dtype Byte"):
        build.mul_mat_vec(w.view(torch.int8), torch.randn(1, K), "Q4_K", N)
    with pytest.raises(TypeError, match="blocks must have dtype Byte"):
        build.dequantize(torch.zeros(N, 144, dtype=torch.int32), "Q4_K", N, K)


def test_wrong_row_bytes(build, w):
    with pytest.raises(ValueError, match="bytes per row but Q4_K rows of 512 values take 288 bytes"):
        build.dequantize(w, "Q4_K", N, 512)
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        build.mul_mat_vec(w[:, :100].contiguous(), torch.randn(1, K), "Q4_K", N)


def test_unknown_type_id(build, w):
    for bad in (4, 5, 9, 15, 24, 31, 43, -1, 1000):
        with pytest.raises(ValueError, match="unknown or unsupported ggml type id"):
            build.ops.mul_mat_vec(w, torch.randn(1, K), bad, N)
    with pytest.raises(ValueError, match="unknown ggml type name"):
        build.mul_mat_vec(w, torch.randn(1, K), "Q4_Z", N)
    with pytest.raises(TypeError, match="ggml_type must be"):
        build.mul_mat_vec(w, torch.randn(1, K), 12.0, N)


def test_cols_not_multiple_of_block(gq):  # quantize: the CPU build's alone
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        gq.quantize(torch.randn(2, 300), "Q4_K")
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        gq.dequantize(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K", 2, 300)
    with pytest.raises(ValueError, match="not a positive multiple"):
        gq.row_bytes("Q4_0", 33)


def test_x_with_wrong_k(build, w):
    with pytest.raises(ValueError, match=r"x has 128 features .* rows hold 256 values"):
        build.mul_mat_vec(w, torch.randn(1, 128), "Q4_K", N)
    with pytest.raises(ValueError, match="x has 512 features"):
        build.mul_mat_id(torch.stack([w, w]), torch.randn(2, 512), torch.zeros(2, 1, dtype=torch.int32), "Q4_K", N)


def test_x_dims(build, w):
    """mul_mat / mul_mat_vec / mul_mat_group take x (..., K), never a 0-D tensor; mul_mat_id's x is
    (T, K) only."""
    for op in (build.ops.mul_mat_vec, build.ops.mul_mat):
        with pytest.raises(ValueError, match="at least one dim"):
            op(w, torch.tensor(1.0), 12, N)
    with pytest.raises(ValueError, match="at least one dim"):
        build.ops.mul_mat_group([w], torch.tensor(1.0), [12], [N])
    with pytest.raises(ValueError, match="x must be 2-D"):
        build.ops.mul_mat_id(torch.stack([w, w]), torch.randn(1, 2, K), torch.zeros(2, 1, dtype=torch.int32), 12, N)


def test_mul_mat_group_bad_input(build, gq, w):
    x = torch.randn(1, K)
    other = gq.quantize(torch.randn(4, 512), "Q4_K")  # 512 columns, x has 256
    with pytest.raises(ValueError, match="needs at least one weight"):
        build.ops.mul_mat_group([], x, [], [])
    with pytest.raises(ValueError, match="got 2 weights, 1 ggml types and 2 out_features"):
        build.ops.mul_mat_group([w, w], x, [12], [N, N])
    with pytest.raises(ValueError, match=r"x has 256 features .* rows hold 512 values"):
        build.mul_mat_group([w, other], x, [12, 12], [N, 4])
    with pytest.raises(ValueError, match=r"out_features=9 but blocks\[1\] has 8 rows"):
        build.mul_mat_group([w, w], x, [12, 12], [N, 9])
    with pytest.raises(TypeError, match=r"blocks\[1\] must have dtype Byte"):
        build.mul_mat_group([w, w.view(torch.int8)], x, [12, 12], [N, N])
    with pytest.raises(ValueError, match="unknown or unsupported ggml type id"):
        build.ops.mul_mat_group([w, w], x, [12, 4], [N, N])
    with pytest.raises(TypeError, match="x must have dtype"):
        build.mul_mat_group([w], x.double(), [12], [N])


def test_out_features_mismatch(build, w):
    with pytest.raises(ValueError, match="out_features=9 but blocks has 8 rows"):
        build.mul_mat_vec(w, torch.randn(1, K), "Q4_K", 9)


def test_x_dtype(build, w):
    with pytest.raises(TypeError, match="x must have dtype Float, Half, BFloat16"):
        build.mul_mat_vec(w, torch.randn(1, K).double(), "Q4_K", N)
    with pytest.raises(TypeError, match="x must have dtype"):
        build.mul_mat(w, torch.ones(1, K, dtype=torch.int64), "Q4_K", N)


def test_non_contiguous(build, w):
    """Non-contiguous activations are accepted (copied); non-contiguous packed weights are refused,
    since a strided packed row is not a GGUF tensor."""
    x = torch.randn(K, 3).t()
    torch.testing.assert_close(build.mul_mat_vec(w, x, "Q4_K", N), build.mul_mat_vec(w, x.contiguous(), "Q4_K", N))
    wide = torch.cat([w, w], dim=1)[:, :144]
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        build.mul_mat_vec(wide, torch.randn(1, K), "Q4_K", N)
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        build.get_rows(wide, torch.tensor([0]), "Q4_K", K)


def test_indices_out_of_range(build, w):
    for bad in ([8], [-1], [0, 1, 100]):
        with pytest.raises(IndexError, match=r"indices out of range: values must lie in \[0, 8\)"):
            build.get_rows(w, torch.tensor(bad), "Q4_K", K)
    with pytest.raises(TypeError, match="indices must have dtype"):
        build.get_rows(w, torch.tensor([0.0]), "Q4_K", K)
    with pytest.raises(ValueError, match="indices must be 1-D"):
        build.get_rows(w, torch.tensor([[0]]), "Q4_K", K)


def test_ids_out_of_range(build, w):
    experts = torch.stack([w, w, w])
    x = torch.randn(2, K)
    for bad in ([[0, 3], [1, 2]], [[0, -1], [1, 2]]):
        with pytest.raises(IndexError, match=r"ids \(expert indices\) out of range: values must lie in \[0, 3\)"):
            build.mul_mat_id(experts, x, torch.tensor(bad, dtype=torch.int32), "Q4_K", N)
    with pytest.raises(ValueError, match="ids has 3 rows but x has 2 tokens"):
        build.mul_mat_id(experts, x, torch.zeros(3, 1, dtype=torch.int32), "Q4_K", N)
    with pytest.raises(ValueError, match="blocks must be 3-D"):
        build.mul_mat_id(w, x, torch.zeros(2, 1, dtype=torch.int32), "Q4_K", N)


def test_rows_mismatch(build, w):
    with pytest.raises(ValueError, match="rows=9 but blocks has 8 rows"):
        build.dequantize(w, "Q4_K", 9, K)


def test_output_dtype(build, w):
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        build.dequantize(w, "Q4_K", N, K, torch.int32)


def test_device_mismatch(build, w):
    """Tensors on two devices are refused by name. (The meta device stands in for an accelerator:
    mixed devices dispatch to the shape-only implementation, which checks them.)"""
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        build.mul_mat_vec(w, torch.randn(1, K, device="meta"), 12, N)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        build.mul_mat_id(torch.stack([w, w]), torch.randn(2, K), torch.zeros(2, 1, dtype=torch.int32, device="meta"), 12, N)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        build.get_rows(w, torch.zeros(1, dtype=torch.int32, device="meta"), 12, K)


# ---- fake (meta) implementations refuse what the kernel refuses --------------------------------
# Each case is an op of torch.ops (as a compiled graph calls it) and its arguments: the kernel refuses
# them on the CPU, and the fake implementation (what torch.compile traces with) refuses the same
# arguments as meta tensors with the same exception type and message.

Q4K = 12


def _u8(*shape):
    return torch.zeros(shape, dtype=torch.uint8)


def _w(rows=N):
    return _u8(rows, 144)  # rows of K values as Q4_K bytes (zeros: a valid weight)


def _x(*shape, dtype=torch.float32):
    return torch.zeros(shape or (1, K), dtype=dtype)


def _ids(*shape, dtype=torch.int32):
    return torch.zeros(shape or (2, 1), dtype=dtype)


_E = (2, N, 144)  # two experts
FAKE_CASES = {
    "mul_mat blocks int8": ("mul_mat", lambda: (_w().view(torch.int8), _x(), Q4K, N)),
    "mul_mat blocks 3-D": ("mul_mat", lambda: (_u8(1, N, 144), _x(), Q4K, N)),
    "mul_mat partial block": ("mul_mat", lambda: (_u8(N, 100), _x(), Q4K, N)),
    "mul_mat out_features": ("mul_mat", lambda: (_w(), _x(), Q4K, N + 1)),
    "mul_mat x wrong K": ("mul_mat", lambda: (_w(), _x(1, K // 2), Q4K, N)),
    "mul_mat x 0-D": ("mul_mat", lambda: (_w(), _x().sum(), Q4K, N)),
    "mul_mat x float64": ("mul_mat", lambda: (_w(), _x(dtype=torch.float64), Q4K, N)),
    "mul_mat blocks strided": ("mul_mat", lambda: (_u8(N, 288)[:, :144], _x(), Q4K, N)),
    "mul_mat type Q8_K": ("mul_mat", lambda: (_u8(N, 292), _x(), 15, N)),
    "mul_mat type 4": ("mul_mat", lambda: (_w(), _x(), 4, N)),
    # 2^31 + 128 values a row (Q1_0: 302 MB, never touched): more than ggml's dot products' int counts
    "mul_mat K over int32": ("mul_mat", lambda: (torch.empty(1, (2**24 + 1) * 18, dtype=torch.uint8),
                                                 _x(1, 1).expand(1, 2**31 + 128), 41, 1)),
    "mul_mat_vec out_features": ("mul_mat_vec", lambda: (_w(), _x(), Q4K, N - 1)),
    "mul_mat_vec x wrong K": ("mul_mat_vec", lambda: (_w(), _x(3, K + 1), Q4K, N)),
    "mul_mat_group empty": ("mul_mat_group", lambda: ([], _x(), [], [])),
    "mul_mat_group lengths": ("mul_mat_group", lambda: ([_w(), _w()], _x(), [Q4K], [N, N])),
    "mul_mat_group second K": ("mul_mat_group", lambda: ([_w(), _u8(N, 288)], _x(), [Q4K, Q4K], [N, N])),
    "mul_mat_group second rows": ("mul_mat_group", lambda: ([_w(), _w()], _x(), [Q4K, Q4K], [N, N + 1])),
    "mul_mat_group second type": ("mul_mat_group", lambda: ([_w(), _w()], _x(), [Q4K, 5], [N, N])),
    "mul_mat_id blocks 2-D": ("mul_mat_id", lambda: (_w(), _x(2, K), _ids(), Q4K, N)),
    "mul_mat_id out_features": ("mul_mat_id", lambda: (_u8(*_E), _x(2, K), _ids(), Q4K, N + 1)),
    "mul_mat_id x 3-D": ("mul_mat_id", lambda: (_u8(*_E), _x(2, 1, K), _ids(), Q4K, N)),
    "mul_mat_id x wrong K": ("mul_mat_id", lambda: (_u8(*_E), _x(2, 2 * K), _ids(), Q4K, N)),
    "mul_mat_id ids float": ("mul_mat_id", lambda: (_u8(*_E), _x(2, K), _ids(dtype=torch.float32), Q4K, N)),
    "mul_mat_id ids 1-D": ("mul_mat_id", lambda: (_u8(*_E), _x(2, K), _ids(2), Q4K, N)),
    "mul_mat_id ids rows": ("mul_mat_id", lambda: (_u8(*_E), _x(2, K), _ids(3, 1), Q4K, N)),
    "dequantize rows": ("dequantize", lambda: (_w(), Q4K, N + 1, K, torch.float32)),
    "dequantize cols": ("dequantize", lambda: (_w(), Q4K, N, 2 * K, torch.float32)),
    "dequantize cols not whole blocks": ("dequantize", lambda: (_w(), Q4K, N, K + 1, torch.float32)),
    "dequantize cols 0": ("dequantize", lambda: (_w(), Q4K, N, 0, torch.float32)),
    # ggml's row size, type_size * cols / block_size, wraps around 2^64 for these cols: to one block's
    # bytes (Q4_K), to 4 bytes (F32)
    "dequantize cols overflow": ("dequantize", lambda: (_w(), Q4K, N, 2**60 + K, torch.float32)),
    "dequantize no rows, cols overflow": ("dequantize", lambda: (_w(0), Q4K, 0, 2**60 + K, torch.float32)),
    "get_rows cols overflow": ("get_rows", lambda: (_w(), _ids(0), Q4K, 2**60 + K, torch.float32)),
    # (refused by the tensor size limit, 2^35 bytes, before the row size is computed)
    "quantize cols overflow": ("quantize", lambda: (_x(1, 1).expand(1, 2**62 + 1), 0, None)),
    "dequantize dtype": ("dequantize", lambda: (_w(), Q4K, N, K, torch.int32)),
    "dequantize blocks 3-D": ("dequantize", lambda: (_u8(1, N, 144), Q4K, 1, K, torch.float32)),
    "dequantize blocks int32": ("dequantize", lambda: (torch.zeros(N, 36, dtype=torch.int32), Q4K, N, K, torch.float32)),
    "dequantize type Q8_1": ("dequantize", lambda: (_u8(N, 36), 9, N, 32, torch.float32)),
    "get_rows cols": ("get_rows", lambda: (_w(), _ids(1), Q4K, 2 * K, torch.float32)),
    "get_rows indices 2-D": ("get_rows", lambda: (_w(), _ids(1, 1), Q4K, K, torch.float32)),
    "get_rows indices float": ("get_rows", lambda: (_w(), _ids(1, dtype=torch.float32), Q4K, K, torch.float32)),
    "get_rows dtype": ("get_rows", lambda: (_w(), _ids(1), Q4K, K, torch.int64)),
    "get_rows blocks 1-D": ("get_rows", lambda: (_u8(144), _ids(1), Q4K, K, torch.float32)),
    "quantize x 3-D": ("quantize", lambda: (_x(1, 2, K), Q4K, None)),
    "quantize x float64": ("quantize", lambda: (_x(dtype=torch.float64), Q4K, None)),
    "quantize cols": ("quantize", lambda: (_x(2, 300), Q4K, None)),
    "quantize imatrix size": ("quantize", lambda: (_x(), Q4K, _x(K - 1))),
    "quantize imatrix 2-D": ("quantize", lambda: (_x(), Q4K, _x(1, K))),
    "quantize imatrix float64": ("quantize", lambda: (_x(), Q4K, _x(K, dtype=torch.float64))),
    "quantize IQ2_XXS no imatrix": ("quantize", lambda: (_x(), 16, None)),
    "quantize type Q8_1": ("quantize", lambda: (_x(1, 32), 9, None)),
}


@pytest.mark.parametrize("case", sorted(c for c, (op, _) in FAKE_CASES.items() if op != "quantize"))
def test_fake_refuses_what_the_kernel_refuses(build, case):
    op, args = FAKE_CASES[case]
    assert_fake_refuses_as_cpu(getattr(build.ops, op), *args())


@pytest.mark.parametrize("case", sorted(c for c, (op, _) in FAKE_CASES.items() if op == "quantize"))
def test_fake_refuses_what_quantize_refuses(gq, case):
    """quantize runs on the CPU build only (a Metal build refuses every call)."""
    op, args = FAKE_CASES[case]
    assert_fake_refuses_as_cpu(getattr(gq.ops, op), *args())


def test_fake_accepts_what_the_kernel_accepts(build):
    """The rules above refuse nothing valid: well-formed calls trace on the meta device."""
    ops = build.ops
    m = on_meta
    assert ops.mul_mat(m(_w()), m(_x(2, 3, K)), Q4K, N).shape == (2, 3, N)
    assert [t.shape for t in ops.mul_mat_group(m([_w(), _w(4)]), m(_x()), [Q4K, Q4K], [N, 4])] == [(1, N), (1, 4)]
    assert ops.mul_mat_id(m(_u8(*_E)), m(_x(2, K)), m(_ids(2, 3)), Q4K, N).shape == (2, 3, N)
    assert ops.dequantize(m(_w()), Q4K, N, K, torch.bfloat16).dtype == torch.bfloat16
    assert ops.dequantize(m(_u8(N, 4 * 97)), 0, N, 97, torch.float32).shape == (N, 97)
    assert ops.get_rows(m(_w()), m(_ids(5, dtype=torch.int64)), Q4K, K, torch.float16).shape == (5, K)
    assert ops.quantize(m(_x(3, K)), 16, m(_x(K))).shape == (3, 66)

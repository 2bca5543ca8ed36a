"""Bad input gets a clear Python exception naming the problem, never a crash or an out-of-bounds
read. Each case calls the op directly (torch.ops) as well, since the checks live in the kernel."""

from __future__ import annotations

import pytest
import torch

K, N = 256, 8


@pytest.fixture(scope="module")
def w(gq):
    return gq.quantize(torch.randn(N, K), "Q4_K")


def test_blocks_not_uint8(gq, w):
    with pytest.raises(TypeError, match="blocks must have dtype Byte"):
        gq.mul_mat_vec(w.view(torch.int8), torch.randn(1, K), "Q4_K", N)
    with pytest.raises(TypeError, match="blocks must have dtype Byte"):
        gq.dequantize(torch.zeros(N, 144, dtype=torch.int32), "Q4_K", N, K)


def test_wrong_row_bytes(gq, w):
    with pytest.raises(ValueError, match="bytes per row but Q4_K rows of 512 values take 288 bytes"):
        gq.dequantize(w, "Q4_K", N, 512)
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        gq.mul_mat_vec(w[:, :100].contiguous(), torch.randn(1, K), "Q4_K", N)


def test_unknown_type_id(gq, w):
    for bad in (4, 5, 9, 15, 24, 31, 43, -1, 1000):
        with pytest.raises(ValueError, match="unknown or unsupported ggml type id"):
            gq.ops.mul_mat_vec(w, torch.randn(1, K), bad, N)
    with pytest.raises(ValueError, match="unknown ggml type name"):
        gq.mul_mat_vec(w, torch.randn(1, K), "Q4_Z", N)
    with pytest.raises(TypeError, match="ggml_type must be"):
        gq.mul_mat_vec(w, torch.randn(1, K), 12.0, N)


def test_cols_not_multiple_of_block(gq):
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        gq.quantize(torch.randn(2, 300), "Q4_K")
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        gq.dequantize(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K", 2, 300)
    with pytest.raises(ValueError, match="not a positive multiple"):
        gq.row_bytes("Q4_0", 33)


def test_x_with_wrong_k(gq, w):
    with pytest.raises(ValueError, match=r"x has 128 features .* rows hold 256 values"):
        gq.mul_mat_vec(w, torch.randn(1, 128), "Q4_K", N)
    with pytest.raises(ValueError, match="x has 512 features"):
        gq.mul_mat_id(torch.stack([w, w]), torch.randn(2, 512), torch.zeros(2, 1, dtype=torch.int32), "Q4_K", N)


def test_x_dims(gq, w):
    """mul_mat / mul_mat_vec / mul_mat_group take x (..., K), never a 0-D tensor; mul_mat_id's x is
    (T, K) only."""
    for op in (gq.ops.mul_mat_vec, gq.ops.mul_mat):
        with pytest.raises(ValueError, match="at least one dim"):
            op(w, torch.tensor(1.0), 12, N)
    with pytest.raises(ValueError, match="at least one dim"):
        gq.ops.mul_mat_group([w], torch.tensor(1.0), [12], [N])
    with pytest.raises(ValueError, match="x must be 2-D"):
        gq.ops.mul_mat_id(torch.stack([w, w]), torch.randn(1, 2, K), torch.zeros(2, 1, dtype=torch.int32), 12, N)


def test_mul_mat_group_bad_input(gq, w):
    x = torch.randn(1, K)
    other = gq.quantize(torch.randn(4, 512), "Q4_K")  # 512 columns, x has 256
    with pytest.raises(ValueError, match="needs at least one weight"):
        gq.ops.mul_mat_group([], x, [], [])
    with pytest.raises(ValueError, match="got 2 weights, 1 ggml types and 2 out_features"):
        gq.ops.mul_mat_group([w, w], x, [12], [N, N])
    with pytest.raises(ValueError, match=r"x has 256 features .* rows hold 512 values"):
        gq.mul_mat_group([w, other], x, [12, 12], [N, 4])
    with pytest.raises(ValueError, match=r"out_features=9 but blocks\[1\] has 8 rows"):
        gq.mul_mat_group([w, w], x, [12, 12], [N, 9])
    with pytest.raises(TypeError, match=r"blocks\[1\] must have dtype Byte"):
        gq.mul_mat_group([w, w.view(torch.int8)], x, [12, 12], [N, N])
    with pytest.raises(ValueError, match="unknown or unsupported ggml type id"):
        gq.ops.mul_mat_group([w, w], x, [12, 4], [N, N])
    with pytest.raises(TypeError, match="x must have dtype"):
        gq.mul_mat_group([w], x.double(), [12], [N])


def test_out_features_mismatch(gq, w):
    with pytest.raises(ValueError, match="out_features=9 but blocks has 8 rows"):
        gq.mul_mat_vec(w, torch.randn(1, K), "Q4_K", 9)


def test_x_dtype(gq, w):
    with pytest.raises(TypeError, match="x must have dtype Float, Half, BFloat16"):
        gq.mul_mat_vec(w, torch.randn(1, K).double(), "Q4_K", N)
    with pytest.raises(TypeError, match="x must have dtype"):
        gq.mul_mat(w, torch.ones(1, K, dtype=torch.int64), "Q4_K", N)


def test_non_contiguous(gq, w):
    """Non-contiguous activations are accepted (copied); non-contiguous packed weights are refused,
    since a strided packed row is not a GGUF tensor."""
    x = torch.randn(K, 3).t()
    torch.testing.assert_close(gq.mul_mat_vec(w, x, "Q4_K", N), gq.mul_mat_vec(w, x.contiguous(), "Q4_K", N))
    wide = torch.cat([w, w], dim=1)[:, :144]
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        gq.mul_mat_vec(wide, torch.randn(1, K), "Q4_K", N)
    with pytest.raises(ValueError, match="blocks must be contiguous"):
        gq.get_rows(wide, torch.tensor([0]), "Q4_K", K)


def test_indices_out_of_range(gq, w):
    for bad in ([8], [-1], [0, 1, 100]):
        with pytest.raises(IndexError, match=r"indices out of range: values must lie in \[0, 8\)"):
            gq.get_rows(w, torch.tensor(bad), "Q4_K", K)
    with pytest.raises(TypeError, match="indices must have dtype"):
        gq.get_rows(w, torch.tensor([0.0]), "Q4_K", K)
    with pytest.raises(ValueError, match="indices must be 1-D"):
        gq.get_rows(w, torch.tensor([[0]]), "Q4_K", K)


def test_ids_out_of_range(gq, w):
    experts = torch.stack([w, w, w])
    x = torch.randn(2, K)
    for bad in ([[0, 3], [1, 2]], [[0, -1], [1, 2]]):
        with pytest.raises(IndexError, match=r"ids \(expert indices\) out of range: values must lie in \[0, 3\)"):
            gq.mul_mat_id(experts, x, torch.tensor(bad, dtype=torch.int32), "Q4_K", N)
    with pytest.raises(ValueError, match="ids has 3 rows but x has 2 tokens"):
        gq.mul_mat_id(experts, x, torch.zeros(3, 1, dtype=torch.int32), "Q4_K", N)
    with pytest.raises(ValueError, match="blocks must be 3-D"):
        gq.mul_mat_id(w, x, torch.zeros(2, 1, dtype=torch.int32), "Q4_K", N)


def test_rows_mismatch(gq, w):
    with pytest.raises(ValueError, match="rows=9 but blocks has 8 rows"):
        gq.dequantize(w, "Q4_K", 9, K)


def test_output_dtype(gq, w):
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        gq.dequantize(w, "Q4_K", N, K, torch.int32)


def test_device_mismatch(gq, w):
    """Tensors on two devices are refused by name. (The meta device stands in for an accelerator:
    mixed devices dispatch to the shape-only implementation, which checks them.)"""
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        gq.mul_mat_vec(w, torch.randn(1, K, device="meta"), 12, N)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        gq.mul_mat_id(torch.stack([w, w]), torch.randn(2, K), torch.zeros(2, 1, dtype=torch.int32, device="meta"), 12, N)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        gq.get_rows(w, torch.zeros(1, dtype=torch.int32, device="meta"), 12, K)

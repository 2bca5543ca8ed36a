"""ggml-quantization against llama.cpp's own ggml, through tools/testing/ggml_ctypes.py.

The oracle is llama-cpp-python's separately built libggml (same pinned ggml commit, see
upstream.toml): quantization must give the very same bytes, and the matrix products the same
numbers up to float summation order. Skipped as a whole when llama_cpp is not installed.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.llama_cpp

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")

REPO = Path(__file__).resolve().parents[1]
from tools.testing import ggml_ctypes  # noqa: E402

if not ggml_ctypes.available():
    pytest.skip(f"ggml oracle unavailable: {ggml_ctypes.unavailable_reason()}", allow_module_level=True)


TYPES = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
]
M_VALUES = [1, 3, 8, 17, 64]

# Tolerance of the products, relative to the largest |value| of the output row being compared.
# Both sides run the same ggml source on the same packed weight: activations are quantized to the
# same vec_dot_type by the same routine, then the same integer dot products are summed per block in
# float32. The two builds may differ in compiler flags (llama-cpp-python is built -march=native, our
# runtime picks one of a few fixed x86-64 levels) and, for larger M, in how the output is tiled
# across threads, so only the float32 accumulation order of the per-block partial sums can differ.
# With K <= 1024 that is at most K/32 = 32 additions, each rounding by 2**-24 of a partial sum no
# larger than the row's max-magnitude output's scale: worst case ~32 * 6e-8 = 2e-6 of it. 1e-5
# leaves 5x of margin over that bound and is still ~100x tighter than any real algorithmic
# difference (a single activation rounded to a neighbouring int8 step moves an output by ~1e-3 of
# its row's scale). On this machine the two builds agree bit for bit (observed max error 0).
RTOL_ROW = 1e-5


@pytest.fixture(scope="module")
def ggml_quant_ext():
    from tools.testing.kernel_testing import load_kernel

    return load_kernel("ggml-org/ggml-quantization")  # a missing build fails, it is not skipped


@pytest.fixture(scope="module")
def n_threads():
    return max(1, torch.get_num_threads())


def _tid(ext, name: str) -> int:
    return int(ext.GGMLType[name])


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())  # stable across processes, unlike hash()


def _randn(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _assert_rows_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert np.isfinite(ours).all() and np.isfinite(ref).all(), what
    scale = np.abs(ref).max(axis=-1, keepdims=True)
    scale = np.maximum(scale, np.finfo(np.float32).tiny)
    err = np.abs(ours - ref) / scale
    worst = float(err.max())
    assert worst <= RTOL_ROW, f"{what}: max |ours - ggml| / row max = {worst:.3g} > {RTOL_ROW}"


# ---- (a) quantization: byte-identical ----------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (64, 2304)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("type_name", TYPES)
def test_quantize_matches_ggml(ggml_quant_ext, type_name, shape):
    ext = ggml_quant_ext
    t = _tid(ext, type_name)
    x = _randn(_seed(type_name, *shape), *shape)
    ref = ggml_ctypes.quantize(x, t)
    ours = ext.quantize(torch.from_numpy(x), type_name).numpy()
    assert ours.shape == ref.shape == (shape[0], ext.row_bytes(t, shape[1]))
    mismatched = np.flatnonzero((ours != ref).any(axis=1))
    assert mismatched.size == 0, f"{type_name}: rows {mismatched[:10].tolist()} differ from ggml_quantize_chunk"


@pytest.mark.parametrize("type_name", TYPES)
def test_quantize_with_imatrix_matches_ggml(ggml_quant_ext, type_name):
    ext = ggml_quant_ext
    t = _tid(ext, type_name)
    x = _randn(11, 16, 768) * 3.0
    imatrix = np.abs(_randn(12, 768)) + 0.05
    ref = ggml_ctypes.quantize(x, t, imatrix=imatrix)
    ours = ext.quantize(torch.from_numpy(x), type_name, imatrix=torch.from_numpy(imatrix)).numpy()
    assert np.array_equal(ours, ref), f"{type_name} with an imatrix differs from ggml_quantize_chunk"


# ---- (b) matrix products: same numbers up to summation order ------------------------------------

@pytest.fixture(scope="module")
def packed_weights(ggml_quant_ext):
    """(type, N, K) -> packed weight, quantized by the oracle (so the two sides share one input)."""
    cache: dict[tuple[str, int, int], np.ndarray] = {}

    def get(type_name: str, n: int, k: int) -> np.ndarray:
        key = (type_name, n, k)
        if key not in cache:
            w = _randn(_seed(*key), n, k)
            cache[key] = ggml_ctypes.quantize(w, _tid(ggml_quant_ext, type_name))
        return cache[key]

    return get


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("nk", [(256, 1024), (72, 768)], ids=lambda s: f"N{s[0]}_K{s[1]}")
@pytest.mark.parametrize("type_name", TYPES)
def test_mul_mat_matches_ggml(ggml_quant_ext, packed_weights, n_threads, type_name, nk, m):
    ext = ggml_quant_ext
    n, k = nk
    t = _tid(ext, type_name)
    blocks = packed_weights(type_name, n, k)
    x = _randn(1000 + m, m, k)
    ref = ggml_ctypes.MulMat(blocks, t, k, m, n_threads)(x)
    wt, xt = torch.from_numpy(blocks), torch.from_numpy(x)
    # exact=True: ggml's own op for every row count (mul_mat's dense path would take block-32 types at 64)
    _assert_rows_close(ext.mul_mat(wt, xt, type_name, n, exact=True).numpy(), ref, f"mul_mat {type_name} M={m}")
    _assert_rows_close(ext.mul_mat_vec(wt, xt, t, n).numpy(), ref, f"mul_mat_vec {type_name} M={m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_mul_mat_low_precision_activations(ggml_quant_ext, packed_weights, n_threads, type_name, dtype):
    # ours upcasts bf16/f16 activations to float32 first; ggml sees those float32 values
    ext = ggml_quant_ext
    n, k, m = 256, 1024, 5
    blocks = packed_weights(type_name, n, k)
    x = torch.from_numpy(_randn(7, m, k)).to(dtype)
    ref = ggml_ctypes.MulMat(blocks, _tid(ext, type_name), k, m, n_threads)(x.float().numpy())
    _assert_rows_close(ext.mul_mat_vec(torch.from_numpy(blocks), x, type_name, n).numpy(), ref, f"{type_name} {dtype}")


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("type_name", TYPES)
def test_mul_mat_id_matches_ggml(ggml_quant_ext, packed_weights, n_threads, type_name, m):
    ext = ggml_quant_ext
    experts, n, k, n_ids = 4, 96, 512, 2
    t = _tid(ext, type_name)
    blocks = np.stack([packed_weights(f"{type_name}", n + 8 * e, k)[:n] for e in range(experts)])
    x = _randn(2000 + m, m, k)
    rng = np.random.default_rng(3000 + m)
    # each token picks n_ids distinct experts, as a top-k router does
    ids = np.stack([rng.permutation(experts)[:n_ids] for _ in range(m)]).astype(np.int32)
    ref = ggml_ctypes.MulMatId(blocks, t, k, m, n_ids, n_threads)(x, ids)
    ours = ext.mul_mat_id(torch.from_numpy(blocks), torch.from_numpy(x), torch.from_numpy(ids), type_name, n)
    _assert_rows_close(ours.numpy(), ref, f"mul_mat_id {type_name} M={m}")
    # int64 ids are accepted too and mean the same
    ours64 = ext.mul_mat_id(torch.from_numpy(blocks), torch.from_numpy(x), torch.from_numpy(ids).long(), t, n)
    _assert_rows_close(ours64.numpy(), ref, f"mul_mat_id int64 ids {type_name} M={m}")


def test_oracle_is_not_ours(ggml_quant_ext):
    # the comparison is only independent if the two sides load different ggml builds
    ours = Path(ggml_quant_ext.info()["runtime"]).resolve()
    theirs = Path(ggml_ctypes.info()["lib_dir"]).resolve()
    assert theirs not in ours.parents

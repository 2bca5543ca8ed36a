"""A small ctypes binding to the ggml that llama-cpp-python ships, used as an independent oracle.

llama-cpp-python's shared libraries (`llama_cpp/lib/libggml-base.so`, `libggml-cpu.so`) export
ggml's C API. This module builds single-op ggml graphs with them -- `ggml_mul_mat`,
`ggml_mul_mat_id` -- and calls ggml's quantizers, so tests can compare ggml-kernels against
llama.cpp's own build of the same ggml, and benchmarks can time ggml's op with nothing of ours in
the way.

    from tools.testing import ggml_ctypes
    if ggml_ctypes.available():
        q = ggml_ctypes.quantize(w, 12)      # (rows, cols) float32 -> (rows, row_bytes) uint8, Q4_K
        mm = ggml_ctypes.MulMat(q, 12, cols=w.shape[1], m=8, n_threads=2)
        y = mm(x)                            # (8, cols) float32 -> (8, rows) float32 = x @ W.T

The module imports without llama_cpp; `available()` is then False and everything else raises.
Struct layouts and signatures are those of ggml's public headers (ggml.h, ggml-cpu.h) at the
commit llama-cpp-python 0.3.36 vendors. A failed ggml assertion aborts the process, so the
Python side checks shapes and types before every call into ggml.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from pathlib import Path

import numpy as np

__all__ = ["MulMat", "MulMatId", "available", "info", "lib_dir", "quantize", "row_size", "type_name", "unavailable_reason"]

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
GGML_TYPE_COUNT = 43  # ggml.h's enum ggml_type
GGML_MAX_N_THREADS = 512  # ggml.h
GGML_STATUS_SUCCESS = 0


# ---- structs (ggml.h / ggml-cpu.h) ------------------------------------------------------------

class _InitParams(ctypes.Structure):  # struct ggml_init_params, passed by value to ggml_init
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):  # struct ggml_cplan, returned by value from ggml_graph_plan
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


class _ThreadpoolParams(ctypes.Structure):  # struct ggml_threadpool_params
    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


# ---- loading ---------------------------------------------------------------------------------

_lock = threading.Lock()
_lib: _Ggml | None = None
_error: str | None = None


def lib_dir() -> Path | None:
    """Folder holding llama-cpp-python's libggml*.so, or None when llama_cpp is not installed."""
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "lib"
        if (d / "libggml-cpu.so").exists() or (d / "libggml-cpu.dylib").exists():
            return d
    return None


class _Ggml:
    """The two libraries, with argtypes/restype declared for every function used here."""

    def __init__(self, folder: Path):
        ext = ".dylib" if (folder / "libggml-base.dylib").exists() else ".so"
        mode = getattr(os, "RTLD_LOCAL", 0) | getattr(os, "RTLD_NOW", 0)
        # base first: ggml-cpu's DT_NEEDED on it then resolves to this very copy ($ORIGIN runpath)
        self.base = ctypes.CDLL(str(folder / f"libggml-base{ext}"), mode=mode)
        self.cpu = ctypes.CDLL(str(folder / f"libggml-cpu{ext}"), mode=mode)
        self.path = folder
        P, S, I64, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int  # noqa: E741  (ctypes signatures read as C)
        T = ctypes.c_int  # enum ggml_type
        sig = {
            # ggml-base
            "ggml_init": (P, [_InitParams]),
            "ggml_free": (None, [P]),
            "ggml_new_tensor_2d": (P, [P, T, I64, I64]),
            "ggml_new_tensor_3d": (P, [P, T, I64, I64, I64]),
            "ggml_mul_mat": (P, [P, P, P]),
            "ggml_mul_mat_id": (P, [P, P, P, P]),
            "ggml_new_graph": (P, [P]),
            "ggml_build_forward_expand": (None, [P, P]),
            "ggml_get_data": (P, [P]),
            "ggml_nbytes": (S, [P]),
            "ggml_row_size": (S, [T, I64]),
            "ggml_type_size": (S, [T]),
            "ggml_blck_size": (I64, [T]),
            "ggml_type_name": (ctypes.c_char_p, [T]),
            "ggml_tensor_overhead": (S, []),
            "ggml_graph_overhead": (S, []),
            "ggml_quantize_chunk": (S, [T, P, P, I64, I64, I64, P]),
            "ggml_quantize_requires_imatrix": (ctypes.c_bool, [T]),
            "ggml_threadpool_params_init": (None, [ctypes.POINTER(_ThreadpoolParams), I]),
            # ggml-cpu
            "ggml_cpu_init": (None, []),
            "ggml_graph_plan": (_CPlan, [P, I, P]),
            "ggml_graph_compute": (I, [P, ctypes.POINTER(_CPlan)]),
            "ggml_threadpool_new": (P, [ctypes.POINTER(_ThreadpoolParams)]),
            "ggml_threadpool_free": (None, [P]),
            "ggml_cpu_has_llamafile": (I, []),
        }
        for name, (res, args) in sig.items():
            lib = self.base if hasattr(self.base, name) else self.cpu
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
            setattr(self, name, fn)
        self.ggml_cpu_init()


def _load() -> _Ggml | None:
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        folder = lib_dir()
        if folder is None:
            _error = "llama_cpp (llama-cpp-python) is not installed, or ships no libggml-cpu"
            return None
        try:
            _lib = _Ggml(folder)
        except (OSError, AttributeError) as e:
            _error = f"cannot load ggml from {folder}: {e}"
        return _lib


def available() -> bool:
    """Whether llama-cpp-python's ggml could be loaded."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    _load()
    return _error


def _ggml() -> _Ggml:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"ggml_ctypes: {_error}")
    return lib


def _check_type(type_id: int) -> int:
    g = _ggml()
    t = int(type_id)
    if not 0 <= t < GGML_TYPE_COUNT or g.ggml_blck_size(t) <= 0 or g.ggml_type_size(t) == 0:
        raise ValueError(f"ggml_ctypes: {t} is not a ggml type this ggml knows")
    return t


def type_name(type_id: int) -> str:
    return _ggml().ggml_type_name(_check_type(type_id)).decode()


def row_size(type_id: int, cols: int) -> int:
    """Bytes of one packed row of `cols` values (ValueError unless cols is whole blocks)."""
    g = _ggml()
    t = _check_type(type_id)
    if cols % g.ggml_blck_size(t):
        raise ValueError(f"ggml_ctypes: {type_name(t)} rows need a multiple of {g.ggml_blck_size(t)} values, got {cols}")
    return int(g.ggml_row_size(t, cols))


def _as_f32(x, ndim: int, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().cpu().float().numpy()
    a = np.ascontiguousarray(x, dtype=np.float32)
    if a.ndim != ndim:
        raise ValueError(f"ggml_ctypes: {name} must be {ndim}-D, got shape {a.shape}")
    return a


def _as_u8(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.ascontiguousarray(x)
    if a.dtype != np.uint8:
        raise ValueError(f"ggml_ctypes: {name} must be uint8, got {a.dtype}")
    return a


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


# ---- quantize --------------------------------------------------------------------------------

def quantize(x, type_id: int, imatrix=None) -> np.ndarray:
    """float32 `(rows, cols)` -> packed uint8 `(rows, row_bytes)`, by ggml's `ggml_quantize_chunk`.

    `imatrix` (cols float32 importances) is passed through; types that need one raise without it.
    """
    g = _ggml()
    t = _check_type(type_id)
    a = _as_f32(x, 2, "x")
    rows, cols = a.shape
    rb = row_size(t, cols)
    im = None
    if imatrix is not None:
        im = _as_f32(imatrix, 1, "imatrix")
        if im.shape[0] != cols:
            raise ValueError(f"ggml_ctypes: imatrix has {im.shape[0]} values, rows have {cols}")
    elif g.ggml_quantize_requires_imatrix(t):
        raise ValueError(f"ggml_ctypes: {type_name(t)} quantization needs an imatrix")
    out = np.zeros((rows, rb), dtype=np.uint8)
    if rows:
        n = g.ggml_quantize_chunk(t, _ptr(a), _ptr(out), 0, rows, cols, None if im is None else _ptr(im))
        assert n == rows * rb, (n, rows * rb)
    return out


# ---- one-op graphs ---------------------------------------------------------------------------

class _OneOpGraph:
    """A ggml context that owns its tensors' memory, one op's graph, and a compute plan.

    Built once; `compute()` then only runs ggml_graph_compute on a persistent threadpool with a
    persistent work buffer, which is how llama.cpp runs a graph it has planned.
    """

    def __init__(self, data_bytes: int, n_tensors: int, n_threads: int):
        g = self._g = _ggml()
        self.n_threads = max(1, int(n_threads))
        # every tensor's data is padded to GGML_MEM_ALIGN (16): a few KiB of slack covers it
        size = data_bytes + n_tensors * (g.ggml_tensor_overhead() + 64) + g.ggml_graph_overhead() + (1 << 16)
        self.ctx = g.ggml_init(_InitParams(size, None, False))
        if not self.ctx:
            raise MemoryError(f"ggml_ctypes: ggml_init({size}) failed")
        self.graph = None
        self.threadpool = None
        self._work = None

    def _finish(self, result) -> None:
        g = self._g
        self.result = result
        self.graph = g.ggml_new_graph(self.ctx)
        g.ggml_build_forward_expand(self.graph, result)
        params = _ThreadpoolParams()
        g.ggml_threadpool_params_init(ctypes.byref(params), self.n_threads)
        self.threadpool = g.ggml_threadpool_new(ctypes.byref(params))
        if not self.threadpool:
            raise RuntimeError("ggml_ctypes: ggml_threadpool_new failed")
        self.plan = g.ggml_graph_plan(self.graph, self.n_threads, self.threadpool)
        if self.plan.work_size:
            self._work = np.empty(self.plan.work_size + 64, dtype=np.uint8)
            self.plan.work_data = (_ptr(self._work) + 63) // 64 * 64
        self._plan_ref = ctypes.byref(self.plan)

    @staticmethod
    def _copy_in(dst_ptr: int, src: np.ndarray) -> None:
        ctypes.memmove(dst_ptr, _ptr(src), src.nbytes)

    def _data(self, tensor) -> int:
        return self._g.ggml_get_data(tensor)

    def compute(self) -> None:
        """Recompute the op on whatever the input tensors hold now (no copies)."""
        status = self._g.ggml_graph_compute(self.graph, self._plan_ref)
        if status != GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_ctypes: ggml_graph_compute returned status {status}")

    def _read_result(self, shape) -> np.ndarray:
        n = int(np.prod(shape))
        buf = (ctypes.c_float * n).from_address(self._data(self.result))
        return np.frombuffer(buf, dtype=np.float32, count=n).reshape(shape).copy()

    def close(self) -> None:
        g = getattr(self, "_g", None)
        if g is None:
            return
        if self.threadpool:
            g.ggml_threadpool_free(self.threadpool)
            self.threadpool = None
        if self.ctx:
            g.ggml_free(self.ctx)
            self.ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


class MulMat(_OneOpGraph):
    """ggml's `ggml_mul_mat(W, x)` on a packed weight: `x (m, cols) -> x @ W.T (m, N)` float32.

    blocks: uint8 `(N, row_bytes)` in `type_id`'s format. x is float32 (ggml quantizes it to the
    type's vec_dot_type inside the op, exactly as llama.cpp's CPU backend does).
    """

    def __init__(self, blocks, type_id: int, cols: int, m: int, n_threads: int = 1):
        t = _check_type(type_id)
        b = _as_u8(blocks, "blocks")
        rb = row_size(t, int(cols))
        if b.ndim != 2 or b.shape[1] != rb:
            raise ValueError(f"ggml_ctypes: blocks must be (N, {rb}) for {type_name(t)} rows of {cols}, got {b.shape}")
        self.type_id, self.cols, self.m, self.n = t, int(cols), int(m), int(b.shape[0])
        if self.m < 1 or self.n < 1:
            raise ValueError("ggml_ctypes: m and N must be >= 1")
        data = b.nbytes + 4 * self.cols * self.m + 4 * self.n * self.m
        super().__init__(data, 3, n_threads)
        g = self._g
        self.w = g.ggml_new_tensor_2d(self.ctx, t, self.cols, self.n)
        self.x = g.ggml_new_tensor_2d(self.ctx, GGML_TYPE_F32, self.cols, self.m)
        assert g.ggml_nbytes(self.w) == b.nbytes
        self._copy_in(self._data(self.w), b)
        ctypes.memset(self._data(self.x), 0, 4 * self.cols * self.m)
        self._finish(g.ggml_mul_mat(self.ctx, self.w, self.x))  # {N, m}

    def set_input(self, x) -> None:
        a = _as_f32(x, 2, "x")
        if a.shape != (self.m, self.cols):
            raise ValueError(f"ggml_ctypes: x must be ({self.m}, {self.cols}), got {a.shape}")
        self._copy_in(self._data(self.x), a)

    def output(self) -> np.ndarray:
        return self._read_result((self.m, self.n))

    def __call__(self, x) -> np.ndarray:
        self.set_input(x)
        self.compute()
        return self.output()


class MulMatId(_OneOpGraph):
    """ggml's `ggml_mul_mat_id`: experts `(E, N, row_bytes)`, x `(T, cols)`, ids `(T, n_ids)` int32
    -> `(T, n_ids, N)` float32 with `out[t, j] = W[ids[t, j]] @ x[t]`.

    Each token's one activation row is shared by all the experts it picked (b is `{cols, 1, T}`),
    the layout a MoE layer's gate/up projection uses.
    """

    def __init__(self, blocks, type_id: int, cols: int, tokens: int, n_ids: int, n_threads: int = 1):
        t = _check_type(type_id)
        b = _as_u8(blocks, "blocks")
        rb = row_size(t, int(cols))
        if b.ndim != 3 or b.shape[2] != rb:
            raise ValueError(f"ggml_ctypes: blocks must be (E, N, {rb}), got {b.shape}")
        self.type_id, self.cols = t, int(cols)
        self.experts, self.n = int(b.shape[0]), int(b.shape[1])
        self.tokens, self.n_ids = int(tokens), int(n_ids)
        if min(self.tokens, self.n_ids, self.n, self.experts) < 1:
            raise ValueError("ggml_ctypes: every dimension must be >= 1")
        data = b.nbytes + 4 * self.cols * self.tokens + 4 * self.n_ids * self.tokens + 4 * self.n * self.n_ids * self.tokens
        super().__init__(data, 4, n_threads)
        g = self._g
        self.w = g.ggml_new_tensor_3d(self.ctx, t, self.cols, self.n, self.experts)
        self.x = g.ggml_new_tensor_3d(self.ctx, GGML_TYPE_F32, self.cols, 1, self.tokens)
        self.ids = g.ggml_new_tensor_2d(self.ctx, GGML_TYPE_I32, self.n_ids, self.tokens)
        assert g.ggml_nbytes(self.w) == b.nbytes
        self._copy_in(self._data(self.w), b)
        ctypes.memset(self._data(self.x), 0, 4 * self.cols * self.tokens)
        ctypes.memset(self._data(self.ids), 0, 4 * self.n_ids * self.tokens)
        self._finish(g.ggml_mul_mat_id(self.ctx, self.w, self.x, self.ids))  # {N, n_ids, T}

    def set_input(self, x, ids) -> None:
        a = _as_f32(x, 2, "x")
        if a.shape != (self.tokens, self.cols):
            raise ValueError(f"ggml_ctypes: x must be ({self.tokens}, {self.cols}), got {a.shape}")
        if hasattr(ids, "detach"):
            ids = ids.detach().cpu().numpy()
        i = np.ascontiguousarray(ids, dtype=np.int32)
        if i.shape != (self.tokens, self.n_ids):
            raise ValueError(f"ggml_ctypes: ids must be ({self.tokens}, {self.n_ids}), got {i.shape}")
        if i.size and (i.min() < 0 or i.max() >= self.experts):
            raise ValueError(f"ggml_ctypes: ids must be in [0, {self.experts})")
        self._copy_in(self._data(self.x), a)
        self._copy_in(self._data(self.ids), i)

    def output(self) -> np.ndarray:
        return self._read_result((self.tokens, self.n_ids, self.n))

    def __call__(self, x, ids) -> np.ndarray:
        self.set_input(x, ids)
        self.compute()
        return self.output()


def info() -> dict[str, str]:
    """Where the oracle's ggml comes from, and whether it has llamafile's sgemm."""
    g = _ggml()
    return {"lib_dir": str(g.path), "llamafile": str(bool(g.ggml_cpu_has_llamafile()))}

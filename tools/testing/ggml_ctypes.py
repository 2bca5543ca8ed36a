"""A small ctypes binding to the ggml that llama-cpp-python ships, used as an independent oracle.

llama-cpp-python's shared libraries (`llama_cpp/lib/libggml-base.so`, `libggml-cpu.so`) export
ggml's C API. This module builds single-op ggml graphs with them -- `ggml_mul_mat`,
`ggml_mul_mat_id`, and the small graphs llama.cpp builds for one layer op (RMS norm, gated RMS norm,
L2 norm, flash attention, the gated delta net, the short causal conv) -- and calls ggml's
quantizers, so tests can compare ggml-kernels against llama.cpp's own build of the same ggml, and
benchmarks can time ggml's op with nothing of ours in the way.

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
import weakref
from pathlib import Path

import numpy as np

__all__ = ["CausalConv1d", "FlashAttn", "GatedDeltaNet", "L2Norm", "MulMat", "MulMatId", "RMSNorm", "RMSNormGated",
           "available", "info", "lib_dir", "pause_threadpools", "quantize", "row_size", "type_name",
           "unavailable_reason"]

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
GGML_TYPE_BF16 = 30
# activation dtypes the layer-op graphs take, by name: ggml type and element size
ACTIVATION_TYPES = {"f32": (GGML_TYPE_F32, 4), "f16": (GGML_TYPE_F16, 2), "bf16": (GGML_TYPE_BF16, 2)}
GGML_TYPE_COUNT = 43  # ggml.h's enum ggml_type
GGML_MAX_N_THREADS = 512  # ggml.h
GGML_STATUS_SUCCESS = 0
TENSOR_ALIGNMENT = 32  # ggml-backend's: a buffer made from a pointer must start on it (or ggml aborts)


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
        F = ctypes.c_float
        T = ctypes.c_int  # enum ggml_type
        sig = {
            # ggml-base
            "ggml_init": (P, [_InitParams]),
            "ggml_free": (None, [P]),
            "ggml_new_tensor_1d": (P, [P, T, I64]),
            "ggml_new_tensor_2d": (P, [P, T, I64, I64]),
            "ggml_new_tensor_3d": (P, [P, T, I64, I64, I64]),
            "ggml_new_tensor_4d": (P, [P, T, I64, I64, I64, I64]),
            "ggml_mul_mat": (P, [P, P, P]),
            "ggml_rms_norm": (P, [P, P, F]),
            "ggml_l2_norm": (P, [P, P, F]),
            "ggml_mul": (P, [P, P, P]),
            "ggml_scale": (P, [P, P, F]),
            "ggml_silu": (P, [P, P]),
            "ggml_cast": (P, [P, P, T]),
            "ggml_cpy": (P, [P, P, P]),
            "ggml_concat": (P, [P, P, P, I]),
            "ggml_transpose": (P, [P, P]),
            "ggml_view_2d": (P, [P, P, I64, I64, S, S]),
            "ggml_flash_attn_ext": (P, [P, P, P, P, P, F, F, F]),
            "ggml_gated_delta_net": (P, [P, P, P, P, P, P, P, I64]),
            "ggml_ssm_conv": (P, [P, P, P]),
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
            "ggml_set_no_alloc": (None, [P, ctypes.c_bool]),
            "ggml_backend_cpu_buffer_from_ptr": (P, [P, S]),
            "ggml_backend_tensor_alloc": (I, [P, P, P]),
            "ggml_backend_buffer_free": (None, [P]),
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
            "ggml_threadpool_pause": (None, [P]),
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
        self._borrowed = []  # (ggml buffer, array) of tensors placed on memory not the context's
        self.n_threads = max(1, int(n_threads))
        # every tensor's data is padded to GGML_MEM_ALIGN (16): a few KiB of slack covers it
        size = data_bytes + n_tensors * (g.ggml_tensor_overhead() + 64) + g.ggml_graph_overhead() + (1 << 16)
        self.ctx = g.ggml_init(_InitParams(size, None, False))
        if not self.ctx:
            raise MemoryError(f"ggml_ctypes: ggml_init({size}) failed")
        self.graph = None
        self.threadpool = None
        self._work = None

    def _finish(self, result, *also) -> None:
        """Plan the graph that computes `result` (read by output()) and `also` (other results)."""
        g = self._g
        self.result = result
        self.graph = g.ggml_new_graph(self.ctx)
        for tensor in (*also, result):
            g.ggml_build_forward_expand(self.graph, tensor)
        params = _ThreadpoolParams()
        g.ggml_threadpool_params_init(ctypes.byref(params), self.n_threads)
        self.threadpool = g.ggml_threadpool_new(ctypes.byref(params))
        if not self.threadpool:
            raise RuntimeError("ggml_ctypes: ggml_threadpool_new failed")
        _GRAPHS.add(self)
        self.plan = g.ggml_graph_plan(self.graph, self.n_threads, self.threadpool)
        if self.plan.work_size:
            self._work = np.empty(self.plan.work_size + 64, dtype=np.uint8)
            self.plan.work_data = (_ptr(self._work) + 63) // 64 * 64
        self._plan_ref = ctypes.byref(self.plan)

    @staticmethod
    def _copy_in(dst_ptr: int, src: np.ndarray) -> None:
        ctypes.memmove(dst_ptr, _ptr(src), src.nbytes)

    def _place(self, tensor, array: np.ndarray) -> None:
        """Make `tensor` (created without memory) read `array`'s memory in place; the graph keeps
        `array` alive until it is closed."""
        g = self._g
        if _ptr(array) % TENSOR_ALIGNMENT:
            raise ValueError(f"ggml_ctypes: borrowed memory must be {TENSOR_ALIGNMENT}-byte aligned "
                             f"(a torch tensor's is); got an address {_ptr(array) % TENSOR_ALIGNMENT} bytes past it")
        buffer = g.ggml_backend_cpu_buffer_from_ptr(_ptr(array), array.nbytes)
        if not buffer or g.ggml_backend_tensor_alloc(buffer, tensor, _ptr(array)) != GGML_STATUS_SUCCESS:
            raise RuntimeError("ggml_ctypes: could not place a tensor on borrowed memory")
        self._borrowed.append((buffer, array))

    def _new(self, type_id: int, *ne: int):
        """A tensor of this context, its dims in ggml's order (fastest first)."""
        g = self._g
        make = {1: g.ggml_new_tensor_1d, 2: g.ggml_new_tensor_2d, 3: g.ggml_new_tensor_3d, 4: g.ggml_new_tensor_4d}
        return make[len(ne)](self.ctx, type_id, *(int(n) for n in ne))

    def _fill(self, tensor, src: np.ndarray) -> None:
        """Copy `src` (contiguous, exactly the tensor's bytes) into a tensor of this graph."""
        assert self._g.ggml_nbytes(tensor) == src.nbytes, (self._g.ggml_nbytes(tensor), src.nbytes)
        self._copy_in(self._data(tensor), src)

    def _data(self, tensor) -> int:
        return self._g.ggml_get_data(tensor)

    def compute(self) -> None:
        """Recompute the op on whatever the input tensors hold now (no copies)."""
        status = self._g.ggml_graph_compute(self.graph, self._plan_ref)
        if status != GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_ctypes: ggml_graph_compute returned status {status}")

    def _read_result(self, shape, type_id: int = GGML_TYPE_F32, tensor=None) -> np.ndarray:
        """The result (or `tensor`) as a float32 array of `shape` (16-bit results widened exactly)."""
        n = int(np.prod(shape))
        ptr = self._data(self.result if tensor is None else tensor)
        if type_id == GGML_TYPE_F32:
            return np.frombuffer((ctypes.c_float * n).from_address(ptr), dtype=np.float32, count=n).reshape(shape).copy()
        bits = np.frombuffer((ctypes.c_uint16 * n).from_address(ptr), dtype=np.uint16, count=n).reshape(shape)
        if type_id == GGML_TYPE_F16:
            return bits.view(np.float16).astype(np.float32)
        return (bits.astype(np.uint32) << 16).view(np.float32)  # bfloat16: the top half of a float32

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
        for buffer, _ in self._borrowed:
            g.ggml_backend_buffer_free(buffer)  # a from_ptr buffer does not free the memory it wraps
        self._borrowed = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


# every graph with a threadpool, for pause_threadpools
_GRAPHS: weakref.WeakSet = weakref.WeakSet()


def pause_threadpools() -> None:
    """Put the idle workers of every graph's threadpool to sleep.

    After a graph, a ggml threadpool's workers poll for the next one (llama.cpp's default polling
    level, as in a real decode: up to ~100 ms of spinning on this module's pools), so a timing of
    anything else right after a multi-threaded graph would share the cores with them. The next
    compute() wakes them again (ggml_graph_compute resumes a paused pool)."""
    for graph in list(_GRAPHS):
        if graph.threadpool and graph.n_threads > 1:
            graph._g.ggml_threadpool_pause(graph.threadpool)


class MulMat(_OneOpGraph):
    """ggml's `ggml_mul_mat(W, x)` on a packed weight: `x (m, cols) -> x @ W.T (m, N)` float32.

    blocks: uint8 `(N, row_bytes)` in `type_id`'s format. x is float32 (ggml quantizes it to the
    type's vec_dot_type inside the op, exactly as llama.cpp's CPU backend does). The weight is copied
    into the graph's own memory, or with `borrow=True` read where `blocks` lies (a C-contiguous uint8
    array or CPU tensor, kept alive by the graph), so that a benchmark times ggml's op and another
    implementation on the very same pages.
    """

    def __init__(self, blocks, type_id: int, cols: int, m: int, n_threads: int = 1, *, borrow: bool = False):
        t = _check_type(type_id)
        b = _as_u8(blocks, "blocks")
        rb = row_size(t, int(cols))
        if b.ndim != 2 or b.shape[1] != rb:
            raise ValueError(f"ggml_ctypes: blocks must be (N, {rb}) for {type_name(t)} rows of {cols}, got {b.shape}")
        self.type_id, self.cols, self.m, self.n = t, int(cols), int(m), int(b.shape[0])
        if self.m < 1 or self.n < 1:
            raise ValueError("ggml_ctypes: m and N must be >= 1")
        data = (0 if borrow else b.nbytes) + 4 * self.cols * self.m + 4 * self.n * self.m
        super().__init__(data, 3, n_threads)
        g = self._g
        g.ggml_set_no_alloc(self.ctx, borrow)
        self.w = g.ggml_new_tensor_2d(self.ctx, t, self.cols, self.n)
        g.ggml_set_no_alloc(self.ctx, False)
        self.x = g.ggml_new_tensor_2d(self.ctx, GGML_TYPE_F32, self.cols, self.m)
        assert g.ggml_nbytes(self.w) == b.nbytes
        if borrow:
            self._place(self.w, b)
        else:
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
    the layout a MoE layer's gate/up projection uses. `borrow=True` reads the experts where `blocks`
    lies, as `MulMat` does.
    """

    def __init__(self, blocks, type_id: int, cols: int, tokens: int, n_ids: int, n_threads: int = 1, *,
                 borrow: bool = False):
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
        data = ((0 if borrow else b.nbytes) + 4 * self.cols * self.tokens + 4 * self.n_ids * self.tokens
                + 4 * self.n * self.n_ids * self.tokens)
        super().__init__(data, 4, n_threads)
        g = self._g
        g.ggml_set_no_alloc(self.ctx, borrow)
        self.w = g.ggml_new_tensor_3d(self.ctx, t, self.cols, self.n, self.experts)
        g.ggml_set_no_alloc(self.ctx, False)
        self.x = g.ggml_new_tensor_3d(self.ctx, GGML_TYPE_F32, self.cols, 1, self.tokens)
        self.ids = g.ggml_new_tensor_2d(self.ctx, GGML_TYPE_I32, self.n_ids, self.tokens)
        assert g.ggml_nbytes(self.w) == b.nbytes
        if borrow:
            self._place(self.w, b)
        else:
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


# ---- layer ops: the small graphs llama.cpp builds around one op -------------------------------

def _activation_type(dtype: str) -> tuple[int, int]:
    if dtype not in ACTIVATION_TYPES:
        raise ValueError(f"ggml_ctypes: dtype must be one of {sorted(ACTIVATION_TYPES)}, got {dtype!r}")
    return ACTIVATION_TYPES[dtype]


def _as_activation(x, dtype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """x as the contiguous bytes of a `dtype` tensor of `shape`: float32 / float16 values, bfloat16 as its
    uint16 bits (a torch bfloat16 tensor, or uint16 bits already)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            if dtype != "bf16":
                x = x.float()
            else:
                import torch  # only reached with a torch tensor in hand

                x = x.contiguous().view(torch.int16)
        x = x.numpy()
    a = np.asarray(x)
    if dtype == "bf16":
        if a.dtype not in (np.int16, np.uint16):
            raise ValueError(f"ggml_ctypes: {name} for a bf16 graph must be a torch bfloat16 tensor or its uint16 bits, "
                             f"got {a.dtype}")
        a = np.ascontiguousarray(a).view(np.uint16)
    else:
        a = np.ascontiguousarray(a, dtype=np.float32 if dtype == "f32" else np.float16)
    if a.shape != tuple(shape):
        raise ValueError(f"ggml_ctypes: {name} must be {tuple(shape)}, got {a.shape}")
    return a


def _check_positive(**dims: int) -> None:
    bad = {k: v for k, v in dims.items() if int(v) < 1}
    if bad:
        raise ValueError(f"ggml_ctypes: dimensions must be >= 1, got {bad}")


class _RowOp(_OneOpGraph):
    """A graph over rows of `cols` activations in `dtype`: ggml-cpu's norms compute in float32 only, so
    16-bit activations are cast to float32 going in and the result back (ggml_cast, both in the graph)."""

    def __init__(self, rows: int, cols: int, dtype: str, n_f32_temps: int, n_inputs: int, n_threads: int):
        _check_positive(rows=rows, cols=cols)
        self.rows, self.cols, self.dtype = int(rows), int(cols), dtype
        self.type_id, size = _activation_type(dtype)
        n = self.rows * self.cols
        super().__init__(n * ((n_inputs + 1) * size + 4 * (n_f32_temps + n_inputs + 1)) + 4 * self.cols,
                         2 * n_inputs + n_f32_temps + 4, n_threads)

    def _activation_input(self):
        t = self._new(self.type_id, self.cols, self.rows)
        return t, (t if self.type_id == GGML_TYPE_F32 else self._g.ggml_cast(self.ctx, t, GGML_TYPE_F32))

    def _finish_rows(self, y) -> None:
        self._finish(y if self.type_id == GGML_TYPE_F32 else self._g.ggml_cast(self.ctx, y, self.type_id))

    def _rows_in(self, tensor, x, name: str) -> None:
        self._fill(tensor, _as_activation(x, self.dtype, (self.rows, self.cols), name))

    def output(self) -> np.ndarray:
        """(rows, cols) float32 (a 16-bit result widened exactly)."""
        return self._read_result((self.rows, self.cols), self.type_id)


class RMSNorm(_RowOp):
    """`ggml_rms_norm(x, eps)` then `ggml_mul` by the weight, llama.cpp's RMS norm (build_norm):
    x (rows, cols) in dtype, weight (cols,) float32 -> (rows, cols).

    A zero-centred norm (Qwen3.5's, Gemma's `norm(x) * (1 + w)`) is this same graph given `1 + w`:
    llama.cpp's GGUF converter stores the weight with the 1 added, so its graph has no extra op.
    """

    def __init__(self, rows: int, cols: int, eps: float = 1e-6, dtype: str = "f32", n_threads: int = 1):
        super().__init__(rows, cols, dtype, n_f32_temps=2, n_inputs=1, n_threads=n_threads)
        g = self._g
        self.x, x = self._activation_input()
        self.w = self._new(GGML_TYPE_F32, self.cols)
        self._finish_rows(g.ggml_mul(self.ctx, g.ggml_rms_norm(self.ctx, x, float(eps)), self.w))

    def set_input(self, x, weight) -> None:
        self._rows_in(self.x, x, "x")
        self._fill(self.w, _as_activation(weight, "f32", (self.cols,), "weight"))

    def __call__(self, x, weight) -> np.ndarray:
        self.set_input(x, weight)
        self.compute()
        return self.output()


class RMSNormGated(_RowOp):
    """The gated RMS norm after Qwen3.5's gated delta net, as llama.cpp's Qwen3.5 graph builds it
    (build_norm_gated): `ggml_mul(ggml_mul(ggml_rms_norm(x, eps), w), ggml_silu(gate))`.
    x, gate (rows, cols) in dtype, weight (cols,) float32 -> (rows, cols)."""

    def __init__(self, rows: int, cols: int, eps: float = 1e-6, dtype: str = "f32", n_threads: int = 1):
        super().__init__(rows, cols, dtype, n_f32_temps=4, n_inputs=2, n_threads=n_threads)
        g, ctx = self._g, self.ctx
        self.x, x = self._activation_input()
        self.gate, gate = self._activation_input()
        self.w = self._new(GGML_TYPE_F32, self.cols)
        normed = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, x, float(eps)), self.w)
        self._finish_rows(g.ggml_mul(ctx, normed, g.ggml_silu(ctx, gate)))

    def set_input(self, x, gate, weight) -> None:
        self._rows_in(self.x, x, "x")
        self._rows_in(self.gate, gate, "gate")
        self._fill(self.w, _as_activation(weight, "f32", (self.cols,), "weight"))

    def __call__(self, x, gate, weight) -> np.ndarray:
        self.set_input(x, gate, weight)
        self.compute()
        return self.output()


class L2Norm(_RowOp):
    """`ggml_l2_norm(x, eps)`: x / max(||x||, eps) over rows of `cols` float32 values."""

    def __init__(self, rows: int, cols: int, eps: float = 1e-6, n_threads: int = 1):
        super().__init__(rows, cols, "f32", n_f32_temps=1, n_inputs=1, n_threads=n_threads)
        self.x, x = self._activation_input()
        self._finish_rows(self._g.ggml_l2_norm(self.ctx, x, float(eps)))

    def set_input(self, x) -> None:
        self._rows_in(self.x, x, "x")

    def __call__(self, x) -> np.ndarray:
        self.set_input(x)
        self.compute()
        return self.output()


class FlashAttn(_OneOpGraph):
    """`ggml_flash_attn_ext` with a causal mask, as llama.cpp's attention runs it: q (Hq, Sq, D) float32,
    k, v (Hkv, Skv, D) in kv_dtype (the KV cache's type), GQA native (query head h reads KV head
    h // (Hq / Hkv)) -> (Sq, Hq, D) float32. The mask is ggml's additive float16 one (0 or -inf),
    bottom-right causal (query i sees keys up to Skv - Sq + i), made once."""

    def __init__(self, hq: int, hkv: int, d: int, sq: int, skv: int, scale: float | None = None,
                 kv_dtype: str = "f32", n_threads: int = 1):
        _check_positive(hq=hq, hkv=hkv, d=d, sq=sq, skv=skv)
        if hq % hkv:
            raise ValueError(f"ggml_ctypes: query heads ({hq}) must be a multiple of KV heads ({hkv})")
        if kv_dtype == "bf16":
            raise ValueError("ggml_ctypes: FlashAttn takes f32 or f16 K/V")
        self.hq, self.hkv, self.d, self.sq, self.skv = (int(v) for v in (hq, hkv, d, sq, skv))
        self.kv_dtype = kv_dtype
        kv_type, kv_size = _activation_type(kv_dtype)
        q_bytes, kv_bytes = 4 * self.hq * self.sq * self.d, kv_size * self.hkv * self.skv * self.d
        super().__init__(2 * q_bytes + 2 * kv_bytes + 2 * self.sq * self.skv, 6, n_threads)
        g = self._g
        self.q = self._new(GGML_TYPE_F32, self.d, self.sq, self.hq, 1)
        self.k = self._new(kv_type, self.d, self.skv, self.hkv, 1)
        self.v = self._new(kv_type, self.d, self.skv, self.hkv, 1)
        self.mask = self._new(GGML_TYPE_F16, self.skv, self.sq, 1, 1)
        visible = np.arange(self.skv)[None, :] <= np.arange(self.sq)[:, None] + (self.skv - self.sq)
        self._fill(self.mask, np.where(visible, 0.0, -np.inf).astype(np.float16))
        scale = self.d**-0.5 if scale is None else float(scale)
        self._finish(g.ggml_flash_attn_ext(self.ctx, self.q, self.k, self.v, self.mask, scale, 0.0, 0.0))

    def set_input(self, q, k, v) -> None:
        self._fill(self.q, _as_activation(q, "f32", (self.hq, self.sq, self.d), "q"))
        kv_shape = (self.hkv, self.skv, self.d)
        self._fill(self.k, _as_activation(k, self.kv_dtype, kv_shape, "k"))
        self._fill(self.v, _as_activation(v, self.kv_dtype, kv_shape, "v"))

    def output(self) -> np.ndarray:
        return self._read_result((self.sq, self.hq, self.d))

    def __call__(self, q, k, v) -> np.ndarray:
        self.set_input(q, k, v)
        self.compute()
        return self.output()


class GatedDeltaNet(_OneOpGraph):
    """Qwen3.5's gated delta rule as llama.cpp's graph runs it: q and k L2-normalised the way its
    Qwen3.5 graph does (`ggml_rms_norm(x, eps / D)` scaled by `1 / sqrt(D)`, = x / sqrt(|x|^2 + eps)),
    then `ggml_gated_delta_net` (output scaled by 1 / sqrt(D), the final state packed after it).

    Inputs in transformers' layout: q, k (T, Hk, D), v (T, Hv, D), g (log decay) and beta (T, Hv), state
    (Hv, Dk, Dv); value head h reads key head h // (Hv / Hk). ggml pairs value head h with key head
    h % Hk instead, so set_input orders the value heads (and gates and states) the way llama.cpp's
    converter stores Qwen3.5's, and transposes the state into ggml's layout; output() and state()
    undo both. Those copies are outside compute()."""

    def __init__(self, hk: int, hv: int, d: int, tokens: int, eps: float = 1e-6, n_threads: int = 1):
        _check_positive(hk=hk, hv=hv, d=d, tokens=tokens)
        if hv % hk:
            raise ValueError(f"ggml_ctypes: value heads ({hv}) must be a multiple of key heads ({hk})")
        self.hk, self.hv, self.d, self.tokens = int(hk), int(hv), int(d), int(tokens)
        qk, vb, st = self.tokens * self.hk * self.d * 4, self.tokens * self.hv * self.d * 4, self.hv * self.d * self.d * 4
        super().__init__(6 * qk + 2 * vb + 2 * st + 8 * self.tokens * self.hv, 12, n_threads)
        g, ctx = self._g, self.ctx
        # value head j of ggml's order is head _order[j] of transformers' (j % Hk is its key head)
        r = self.hv // self.hk
        self._order = np.array([(j % self.hk) * r + j // self.hk for j in range(self.hv)])
        self.q = self._new(GGML_TYPE_F32, self.d, self.hk, self.tokens, 1)
        self.k = self._new(GGML_TYPE_F32, self.d, self.hk, self.tokens, 1)
        self.v = self._new(GGML_TYPE_F32, self.d, self.hv, self.tokens, 1)
        self.g = self._new(GGML_TYPE_F32, 1, self.hv, self.tokens, 1)
        self.beta = self._new(GGML_TYPE_F32, 1, self.hv, self.tokens, 1)
        self.state_in = self._new(GGML_TYPE_F32, self.d, self.d, self.hv, 1)

        def l2(x):
            return g.ggml_scale(ctx, g.ggml_rms_norm(ctx, x, float(eps) / self.d), self.d**-0.5)

        self._finish(g.ggml_gated_delta_net(ctx, l2(self.q), l2(self.k), self.v, self.g, self.beta, self.state_in, 1))

    def set_input(self, q, k, v, g, beta, state) -> None:
        t, hk, hv, d = self.tokens, self.hk, self.hv, self.d
        self._fill(self.q, _as_activation(q, "f32", (t, hk, d), "q"))
        self._fill(self.k, _as_activation(k, "f32", (t, hk, d), "k"))
        order = self._order
        self._fill(self.v, np.ascontiguousarray(_as_activation(v, "f32", (t, hv, d), "v")[:, order]))
        self._fill(self.g, np.ascontiguousarray(_as_activation(g, "f32", (t, hv), "g")[:, order]))
        self._fill(self.beta, np.ascontiguousarray(_as_activation(beta, "f32", (t, hv), "beta")[:, order]))
        s = _as_activation(state, "f32", (hv, d, d), "state")[order].transpose(0, 2, 1)
        self._fill(self.state_in, np.ascontiguousarray(s))

    def _unordered(self, a: np.ndarray, axis: int) -> np.ndarray:
        out = np.empty_like(a)
        np.put_along_axis(out, self._order.reshape([-1 if i == axis else 1 for i in range(a.ndim)]), a, axis)
        return out

    def output(self) -> np.ndarray:
        """(T, Hv, D) float32, transformers' head order."""
        return self._unordered(self._read_result((self.tokens, self.hv, self.d)), 1)

    def state(self) -> np.ndarray:
        """The final state (Hv, Dk, Dv) float32, transformers' head order and layout."""
        packed = self._read_result((self.tokens + self.d, self.hv * self.d))  # rows of Hv * D
        s = packed[self.tokens:].reshape(self.hv, self.d, self.d).transpose(0, 2, 1)
        return self._unordered(np.ascontiguousarray(s), 0)

    def __call__(self, q, k, v, g, beta, state) -> np.ndarray:
        self.set_input(q, k, v, g, beta, state)
        self.compute()
        return self.output()


class CausalConv1d(_OneOpGraph):
    """The short causal conv of Qwen3.5's linear attention as llama.cpp's graph runs it: the last
    kernel - 1 columns of the conv state `ggml_concat`ed with the transposed new tokens, `ggml_ssm_conv`,
    `ggml_silu`; the next state (the last kernel - 1 columns of that concatenation) copied out too.

    x (T, C) float32 (tokens as rows, as the projection writes them), weight (C, kernel), state
    (C, kernel - 1) -> y (T, C) float32; state() is the next (C, kernel - 1)."""

    def __init__(self, channels: int, kernel: int, tokens: int, n_threads: int = 1):
        _check_positive(channels=channels, kernel=kernel, tokens=tokens)
        if kernel < 2:
            raise ValueError(f"ggml_ctypes: the conv kernel must be >= 2, got {kernel}")
        self.c, self.kernel, self.tokens = int(channels), int(kernel), int(tokens)
        width = self.kernel - 1 + self.tokens
        super().__init__(4 * self.c * (2 * self.tokens + 2 * width + self.kernel + 2 * (self.kernel - 1)), 10,
                         n_threads)
        g, ctx = self._g, self.ctx
        self.x = self._new(GGML_TYPE_F32, self.c, self.tokens)
        self.w = self._new(GGML_TYPE_F32, self.kernel, self.c)
        self.state_in = self._new(GGML_TYPE_F32, self.kernel - 1, self.c, 1)
        self.state_out = self._new(GGML_TYPE_F32, self.kernel - 1, self.c, 1)
        x_t = g.ggml_transpose(ctx, self.x)  # {T, C}, a strided view
        conv_input = g.ggml_concat(ctx, self.state_in, x_t, 0)  # {kernel - 1 + T, C, 1}, contiguous
        tail = g.ggml_view_2d(ctx, conv_input, self.kernel - 1, self.c, 4 * width, 4 * self.tokens)
        y = g.ggml_silu(ctx, g.ggml_ssm_conv(ctx, conv_input, self.w))  # {C, T, 1}
        self._finish(y, g.ggml_cpy(ctx, tail, self.state_out))

    def set_input(self, x, weight, state) -> None:
        self._fill(self.x, _as_activation(x, "f32", (self.tokens, self.c), "x"))
        self._fill(self.w, _as_activation(weight, "f32", (self.c, self.kernel), "weight"))
        self._fill(self.state_in, _as_activation(state, "f32", (self.c, self.kernel - 1), "state"))

    def output(self) -> np.ndarray:
        return self._read_result((self.tokens, self.c))

    def state(self) -> np.ndarray:
        return self._read_result((self.c, self.kernel - 1), tensor=self.state_out)

    def __call__(self, x, weight, state) -> np.ndarray:
        self.set_input(x, weight, state)
        self.compute()
        return self.output()


def info() -> dict[str, str]:
    """Where the oracle's ggml comes from, and whether it has llamafile's sgemm."""
    g = _ggml()
    return {"lib_dir": str(g.path), "llamafile": str(bool(g.ggml_cpu_has_llamafile()))}

"""Upstream's Metal backend on Linux (tools/build/metal_runtime.py) driven from Python through ctypes.

`libggml-kernels-metal-emu.so` holds ggml-base, upstream's Metal host code and our device layer;
this module builds one-op ggml graphs in a Metal buffer with ggml's C API, computes them with
`ggml_backend_metal_init()`'s backend, and returns the dispatches upstream's host code encoded:

    host = MetalHost()
    found = host.compute(lambda g: g.mul_mat(g.tensor(12, 4096, 4096), g.tensor(0, 4096, 12)), execute=False)
    found.supported, [d["kernel"] for d in found.dispatches]   # True, ['kernel_mul_mm_q4_K_f32']
    x = np.random.randn(3, 1024).astype(np.float32)
    ran = host.compute(lambda g: g.rms_norm(g.input(0, x.tobytes(), 1024, 3)))   # on the emulated device
    np.frombuffer(ran.output, np.float32)                                          # x / rms(x)

A failed assertion in upstream's code aborts the process: tests that could reach one run the call in
a fresh process.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from dataclasses import dataclass

from tools.build import ggml_runtime, metal_runtime
from tools.testing.ggml_ctypes import _InitParams  # struct ggml_init_params (ggml.h)

_P = ctypes.c_void_p
_SIGNATURES = {  # name -> (restype, argtypes), as ggml.h / ggml-backend.h / ggml-metal.h / metal_emu.h declare them
    "ggml_init": (_P, [_InitParams]),
    "ggml_free": (None, [_P]),
    "ggml_new_tensor_1d": (_P, [_P, ctypes.c_int, ctypes.c_int64]),
    "ggml_new_tensor_2d": (_P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
    "ggml_new_tensor_3d": (_P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
    "ggml_get_data": (_P, [_P]),
    "ggml_quantize_chunk": (ctypes.c_size_t, [ctypes.c_int, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P]),
    "ggml_row_size": (ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
    "ggml_nbytes": (ctypes.c_size_t, [_P]),
    "ggml_mul_mat": (_P, [_P, _P, _P]),
    "ggml_mul_mat_id": (_P, [_P, _P, _P, _P]),
    "ggml_mul_mat_set_hint": (None, [_P, ctypes.c_int]),
    "ggml_get_rows": (_P, [_P, _P, _P]),
    "ggml_mul": (_P, [_P, _P, _P]),
    "ggml_add": (_P, [_P, _P, _P]),
    "ggml_silu": (_P, [_P, _P]),
    "ggml_flash_attn_ext": (_P, [_P, _P, _P, _P, _P, ctypes.c_float, ctypes.c_float, ctypes.c_float]),
    "ggml_rms_norm": (_P, [_P, _P, ctypes.c_float]),
    "ggml_l2_norm": (_P, [_P, _P, ctypes.c_float]),
    "ggml_new_graph": (_P, [_P]),
    "ggml_build_forward_expand": (None, [_P, _P]),
    "ggml_backend_metal_init": (_P, []),
    "ggml_backend_name": (ctypes.c_char_p, [_P]),
    "ggml_backend_alloc_ctx_tensors": (_P, [_P, _P]),
    "ggml_backend_buffer_free": (None, [_P]),
    "ggml_backend_supports_op": (ctypes.c_bool, [_P, _P]),
    "ggml_backend_graph_compute": (ctypes.c_int, [_P, _P]),
    "ggml_backend_tensor_set": (None, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "ggml_backend_tensor_get": (None, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "ggml_backend_free": (None, [_P]),
    "gk_metal_dispatches_json": (ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
    "gk_metal_dispatches_reset": (None, []),
    "gk_metal_set_execute": (None, [ctypes.c_int]),
    "gk_metal_last_error": (ctypes.c_char_p, []),
    "gk_metal_set_lane_schedule": (None, [ctypes.c_int]),
}


def library_path():
    return ggml_runtime.runtime_dir() / metal_runtime.LIBRARY


@dataclass
class Computed:
    supported: bool  # upstream's supports_op for the graph's output
    dispatches: list[dict]  # what upstream's host code encoded (see metal_emu.h's Dispatch)
    error: str = ""  # why the emulated device failed ("" when it ran, or only logged)
    output: bytes = b""  # the output tensor's bytes, when the dispatches ran


class Graph:
    """A ggml context without data (tensors get Metal memory when the graph is computed)."""

    def __init__(self, lib):
        self.lib = lib
        self.ctx = lib.ggml_init(_InitParams(1 << 20, None, True))
        self.inputs: dict[int, bytes] = {}  # tensor -> bytes set once allocated

    def input(self, type_id: int, data: bytes, *ne: int):
        t = self.tensor(type_id, *ne)
        self.inputs[t] = bytes(data)
        return t

    def tensor(self, type_id: int, *ne: int):
        fn = {1: self.lib.ggml_new_tensor_1d, 2: self.lib.ggml_new_tensor_2d, 3: self.lib.ggml_new_tensor_3d}[len(ne)]
        return fn(self.ctx, type_id, *ne)

    def mul_mat(self, a, b):
        return self.lib.ggml_mul_mat(self.ctx, a, b)

    def mul_mat_hadamard(self, h, x):
        """A product whose src0 the caller declares a Hadamard matrix (GGML_HINT_SRC0_IS_HADAMARD)."""
        out = self.lib.ggml_mul_mat(self.ctx, h, x)
        self.lib.ggml_mul_mat_set_hint(out, 1)
        return out

    def mul_mat_id(self, experts, x, ids):
        return self.lib.ggml_mul_mat_id(self.ctx, experts, x, ids)

    def get_rows(self, table, rows):
        return self.lib.ggml_get_rows(self.ctx, table, rows)

    def rms_norm(self, x, eps: float = 1e-6):
        return self.lib.ggml_rms_norm(self.ctx, x, eps)

    def l2_norm(self, x, eps: float = 1e-6):
        return self.lib.ggml_l2_norm(self.ctx, x, eps)

    def mul(self, a, b):
        return self.lib.ggml_mul(self.ctx, a, b)

    def add(self, a, b):
        return self.lib.ggml_add(self.ctx, a, b)

    def silu(self, x):
        return self.lib.ggml_silu(self.ctx, x)

    def flash_attn(self, q, k, v, mask=None, scale: float = 1.0):
        return self.lib.ggml_flash_attn_ext(self.ctx, q, k, v, mask, scale, 0.0, 0.0)


class MetalHost:
    def __init__(self):
        self.lib = ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_LOCAL)
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = res, args
        self.backend = self.lib.ggml_backend_metal_init()
        if not self.backend:
            raise RuntimeError("ggml_backend_metal_init() returned no backend")

    def quantize(self, type_id: int, w) -> bytes:
        """ggml's own quantizer (ggml-base) on float32 rows `w` (rows, cols) -> the GGUF blocks."""
        import numpy as np

        w = np.ascontiguousarray(w, dtype=np.float32)
        rows, cols = w.shape
        out = ctypes.create_string_buffer(self.lib.ggml_row_size(type_id, cols) * rows)
        self.lib.ggml_quantize_chunk(type_id, w.ctypes.data, out, 0, rows, cols, None)
        return out.raw

    def name(self) -> str:
        return self.lib.ggml_backend_name(self.backend).decode()

    def dispatches(self) -> list[dict]:
        size = self.lib.gk_metal_dispatches_json(None, 0)
        text = ctypes.create_string_buffer(size + 1)
        self.lib.gk_metal_dispatches_json(text, size + 1)
        return json.loads(text.value)

    def compute(self, build: Callable[[Graph], object], *, execute: bool = True, reverse_lanes: bool = False) -> Computed:
        """Build `build(graph)`'s output, allocate every tensor in a Metal buffer, set the graph's
        inputs, and compute it if upstream supports it: on the emulated device (lanes resumed in
        reverse order within SIMD groups if asked), or only logging the dispatches."""
        g = Graph(self.lib)
        try:
            out = build(g)
            graph = self.lib.ggml_new_graph(g.ctx)
            self.lib.ggml_build_forward_expand(graph, out)
            buffer = self.lib.ggml_backend_alloc_ctx_tensors(g.ctx, self.backend)
            try:
                for t, data in g.inputs.items():
                    self.lib.ggml_backend_tensor_set(t, data, 0, len(data))
                supported = self.lib.ggml_backend_supports_op(self.backend, out)
                self.lib.gk_metal_dispatches_reset()
                self.lib.gk_metal_set_execute(int(execute))
                self.lib.gk_metal_set_lane_schedule(int(reverse_lanes))
                error, output = "", b""
                if supported:
                    status = self.lib.ggml_backend_graph_compute(self.backend, graph)
                    error = self.lib.gk_metal_last_error().decode() if status != 0 else ""
                    if execute and not error:
                        size = self.lib.ggml_nbytes(out)
                        data = ctypes.create_string_buffer(size)
                        self.lib.ggml_backend_tensor_get(out, data, 0, size)
                        output = data.raw
                return Computed(bool(supported), self.dispatches(), error, output)
            finally:
                self.lib.gk_metal_set_execute(1)
                self.lib.gk_metal_set_lane_schedule(0)
                self.lib.ggml_backend_buffer_free(buffer)
        finally:
            self.lib.ggml_free(g.ctx)

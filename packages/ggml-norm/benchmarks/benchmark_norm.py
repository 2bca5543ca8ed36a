"""ggml-norm at Qwen3.5 shapes: decode (1 token) and prefill (512 tokens), against ggml's own ops and
transformers.

    kernels benchmark ./packages/ggml-norm          # a local build
    kernels benchmark ggml-org/ggml-norm@v1         # the published one

Workloads are named <op>_<dtype>_h<hidden>_t<tokens>. Each class times one implementation of the
same workloads: `RMSNormZeroCentered`, `RMSNormGated` and `L2Norm` this package's ops;
`RMSNormZeroCentered_layer` transformers' Qwen3_5RMSNorm kernelized onto this package's layer (what a
model runs per norm with the kernel), `RMSNormZeroCentered_transformers` that module as transformers
ships it, `RMSNormZeroCentered_reference` the package's pure-PyTorch reference. `<Op>_ggml` is ggml's
own graph for the op through llama-cpp-python's libggml (the repository's tools/testing/ggml_ctypes.py;
present when that is importable, as in `nox -s bench`), built once, only ggml_graph_compute timed:
ggml_rms_norm then ggml_mul by the weight (the zero-centred norm is that graph given 1 + w, as
llama.cpp's converter stores it), the gated norm as llama.cpp's Qwen3.5 graph builds it (rms_norm,
mul, silu, mul), ggml_l2_norm; bfloat16 rows are cast to float32 and back inside the graph (ggml-cpu's
norms are float32 only). Every class is checked against the plain formula of transformers' module
(verify_*), whose time is the runner's Ref column.

Inputs are uniform in [-1, 1] and weights near their typical values, so every output lies below 2
in magnitude, where one bf16 ulp (2^-7) is inside the runner's atol of 1e-2: kernel and reference
may round a value near a tie differently (see tests/test_ops.py). GGML_KERNELS_BENCH_QUICK=1 runs
one hidden size (for tests).
"""

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark

try:  # ggml's own op: llama-cpp-python's libggml, through this repository's tools (not on the Hub)
    from tools.testing import ggml_ctypes
except ImportError:
    ggml_ctypes = None

QUICK = os.environ.get("GGML_KERNELS_BENCH_QUICK") == "1"
HIDDEN = [1024] if QUICK else [1024, 2560, 4096]
TOKENS = [1, 512]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
GATED_HEADS, GATED_DIM = 32, 128  # Qwen3.5 linear attention: 32 value heads of 128
L2_HEADS, L2_DIM = 16, 128  # q and k: 16 key heads of 128
EPS = 1e-6


def _uniform(shape, dtype, gen):
    return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)


def _kernelized(module: torch.nn.Module, kernel, layer_name: str) -> torch.nn.Module:
    """module with its forward replaced by this build's layer, as kernels' kernelize does in a model."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    repo = LocalLayerRepository(repo_path=Path(kernel.__file__).parent, layer_name=layer_name)
    with use_kernel_mapping({layer_name: {"cpu": repo}}, inherit_mapping=False):
        kernelize(module, device="cpu", mode=Mode.INFERENCE)
    return module


def _add(cls, name: str, *params) -> None:
    """Workload `name` of cls and its subclasses: prepare(*params), then run() timed, reference() checked."""
    setattr(cls, f"setup_{name}", lambda self: self.prepare(*params))
    setattr(cls, f"benchmark_{name}", lambda self: self.run())
    setattr(cls, f"verify_{name}", lambda self: self.reference())


class RMSNormZeroCentered(Benchmark):
    """Qwen3_5RMSNorm: norm(x) * (1 + w), the input/post-attention/final norms."""

    seed = 0

    def prepare(self, dtype: torch.dtype, hidden: int, tokens: int) -> None:
        gen = torch.Generator().manual_seed(hidden * 31 + tokens)
        self.x = _uniform((1, tokens, hidden), dtype, gen)
        self.w = (torch.randn(hidden, generator=gen) * 0.05).clamp(-0.1, 0.1).to(dtype)

    def run(self) -> None:
        self.out = self.kernel.rms_norm(self.x, self.w, EPS, True)

    def reference(self) -> torch.Tensor:
        xf = self.x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        return (y * (1.0 + self.w.float())).type_as(self.x)


class RMSNormZeroCentered_reference(RMSNormZeroCentered):
    def run(self) -> None:
        self.out = self.kernel.reference.rms_norm(self.x, self.w, EPS, True)


class RMSNormZeroCentered_transformers(RMSNormZeroCentered):
    def prepare(self, dtype: torch.dtype, hidden: int, tokens: int) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        super().prepare(dtype, hidden, tokens)
        self.module = Qwen3_5RMSNorm(hidden, eps=EPS).to(dtype).requires_grad_(False)
        self.module.weight.copy_(self.w)

    def run(self) -> None:
        self.out = self.module(self.x)


class RMSNormZeroCentered_layer(RMSNormZeroCentered_transformers):
    def prepare(self, dtype: torch.dtype, hidden: int, tokens: int) -> None:
        super().prepare(dtype, hidden, tokens)
        self.module = _kernelized(self.module, self.kernel, "RMSNormZeroCentered")


class RMSNormGated(Benchmark):
    """Qwen3_5RMSNormGated: weight * norm(x).to(dtype) * silu(z), after the gated delta rule."""

    seed = 0

    def prepare(self, dtype: torch.dtype, tokens: int) -> None:
        gen = torch.Generator().manual_seed(tokens)
        self.x = _uniform((tokens * GATED_HEADS, GATED_DIM), dtype, gen)
        self.z = _uniform((tokens * GATED_HEADS, GATED_DIM), dtype, gen)
        self.w = (1 + torch.randn(GATED_DIM, generator=gen) * 0.05).clamp(0.9, 1.1).to(dtype)

    def run(self) -> None:
        self.out = self.kernel.rms_norm_gated(self.x, self.z, self.w, EPS)

    def reference(self) -> torch.Tensor:
        xf = self.x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        y = self.w * y.to(self.x.dtype)
        return (y * F.silu(self.z.float())).to(self.x.dtype)


class L2Norm(Benchmark):
    """q/k L2 norm of the gated delta net (transformers' l2norm: mode "rsqrt")."""

    seed = 0

    def prepare(self, tokens: int) -> None:
        gen = torch.Generator().manual_seed(tokens + 7)
        self.x = torch.randn(1, tokens, L2_HEADS, L2_DIM, generator=gen)

    def run(self) -> None:
        self.out = self.kernel.l2_norm(self.x, EPS, "rsqrt")

    def reference(self) -> torch.Tensor:
        return self.x * torch.rsqrt((self.x * self.x).sum(-1, keepdim=True) + EPS)


class _Ggml:
    """ggml's graph for the op, made in prepare(); run() only computes it and `out` reads its result
    (rows as x's, x's dtype: a bfloat16 result widened and narrowed back exactly)."""

    def run(self) -> None:
        self.graph.compute()

    @property
    def out(self):
        graph = self.__dict__.get("graph")
        return None if graph is None else torch.from_numpy(graph.output()).reshape(self.x.shape).to(self.x.dtype)

    @out.setter
    def out(self, value):
        pass


def _ggml_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]


if ggml_ctypes is not None and ggml_ctypes.available():

    class RMSNormZeroCentered_ggml(_Ggml, RMSNormZeroCentered):
        def prepare(self, dtype: torch.dtype, hidden: int, tokens: int) -> None:
            super().prepare(dtype, hidden, tokens)
            self.graph = ggml_ctypes.RMSNorm(tokens, hidden, EPS, _ggml_dtype(dtype), torch.get_num_threads())
            self.graph.set_input(self.x.reshape(tokens, hidden), 1.0 + self.w.float())

    class RMSNormGated_ggml(_Ggml, RMSNormGated):
        def prepare(self, dtype: torch.dtype, tokens: int) -> None:
            super().prepare(dtype, tokens)
            rows = tokens * GATED_HEADS
            self.graph = ggml_ctypes.RMSNormGated(rows, GATED_DIM, EPS, _ggml_dtype(dtype), torch.get_num_threads())
            self.graph.set_input(self.x, self.z, self.w.float())

    class L2Norm_ggml(_Ggml, L2Norm):
        def prepare(self, tokens: int) -> None:
            super().prepare(tokens)
            self.graph = ggml_ctypes.L2Norm(tokens * L2_HEADS, L2_DIM, EPS, torch.get_num_threads())
            self.graph.set_input(self.x.reshape(-1, L2_DIM))


for _dname, _dtype in DTYPES.items():
    for _t in TOKENS:
        for _h in HIDDEN:
            _add(RMSNormZeroCentered, f"rms_norm_{_dname}_h{_h}_t{_t}", _dtype, _h, _t)
        _add(RMSNormGated, f"rms_norm_gated_{_dname}_h{GATED_DIM}_t{_t}", _dtype, _t)
for _t in TOKENS:
    _add(L2Norm, f"l2_norm_f32_h{L2_DIM}_t{_t}", _t)

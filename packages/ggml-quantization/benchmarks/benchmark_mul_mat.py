"""Packed GGUF matrix products at Qwen3.5 linear shapes: decode (M = 1, 8) and prefill (M = 64, 512).

    kernels benchmark ./packages/ggml-quantization          # a local build
    kernels benchmark ggml-org/ggml-quantization@v1         # the published one

Workloads are named <type>_<N>x<K>_m<M> for a weight of N output rows and K input columns. The
reference (verify_*) is a dense float32 matmul against the dequantized weight, with the activations
rounded the way ggml's CPU dot products round them (to Q8_0 or Q8_K blocks, see `_round_like_ggml`):
the kernel matches it to ~1e-5 of the output scale (~1e-3 in the rare row where an activation sits
exactly on a rounding tie), inside the runner's atol of 1e-2, and the reference's time is what a
dense float32 weight costs per call (transformers' CPU path without a kernel).
"""

import torch

from kernels.benchmark import Benchmark

TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]
MATVEC_SHAPES = [(1024, 1024), (3584, 1024), (1024, 3584), (2560, 9216), (9216, 2560)]  # (N, K)
MATVEC_M = [1, 8]
MATMAT = {64: [(3584, 1024), (1024, 3584), (9216, 2560)], 512: [(3584, 1024), (1024, 3584)]}


def _round_like_ggml(x: torch.Tensor, vec_dot_type: str) -> torch.Tensor:
    """x as ggml-cpu sees it after quantizing it to the weight type's vec_dot_type.

    Q8_0: blocks of 32, scale amax/127 stored as fp16, values rounded to nearest (ties to even).
    Q8_K: blocks of 256, scale from the signed value of largest magnitude, stored as float32.
    """
    m, k = x.shape
    if vec_dot_type == "Q8_0":
        b = x.reshape(m, k // 32, 32)
        amax = b.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(b * inv)
        d = (amax / 127.0).half().float()
        return (q * d).reshape(m, k)
    if vec_dot_type == "Q8_K":
        b = x.reshape(m, k // 256, 256)
        idx = b.abs().argmax(-1, keepdim=True)
        big = b.gather(-1, idx)
        iscale = torch.where(big != 0, -127.0 / big, torch.zeros_like(big))
        q = torch.round(b * iscale).clamp(max=127)
        d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale))
        return (q * d).reshape(m, k)
    raise ValueError(f"no reference rounding for activations of type {vec_dot_type}")


class _PackedProduct:
    """Shared setup and reference (not a Benchmark itself: the runner wants workloads in each)."""

    seed = 0

    def _setup(self, type_name: str, n: int, k: int, m: int) -> None:
        gen = torch.Generator().manual_seed(n * 7919 + k * 31 + m)
        # weights ~ N(0, 1/K) keep every output O(1), whatever K is
        w = torch.randn(n, k, generator=gen) / k**0.5
        self.type, self.n = type_name, n
        self.blocks = self.kernel.quantize(w, type_name)
        self.x = torch.randn(m, k, generator=gen)
        self.out = torch.empty(m, n)
        # the reference, precomputed so verify times only a dense float32 matmul
        self.w_dense = self.kernel.dequantize(self.blocks, type_name, n, k, torch.float32)
        vec_dot = self.kernel.type_info(type_name).vec_dot_type.name
        self.x_rounded = _round_like_ggml(self.x, vec_dot)

    def _verify(self) -> torch.Tensor:
        return torch.nn.functional.linear(self.x_rounded, self.w_dense)


class MulMatVec(_PackedProduct, Benchmark):
    """Decode: transformers calls mul_mat_vec for M <= 8 rows."""


class MulMat(_PackedProduct, Benchmark):
    """Prefill: mul_mat on the packed weight, no dense copy."""


class MulMatGroup(Benchmark):
    """Decode: a layer's sibling projections, which read the same activations, in one mul_mat_group
    call (Qwen3.5-0.8B shapes, Q4_K_M types). The timed call includes concatenating the outputs into
    one tensor, which the runner compares with the reference."""

    seed = 0

    def _setup(self, parts: list[tuple[str, int]], k: int, m: int) -> None:
        gen = torch.Generator().manual_seed(k + m + len(parts))
        self.types, self.rows = [t for t, _ in parts], [n for _, n in parts]
        self.blocks, dense, rounded = [], [], []
        x = torch.randn(m, k, generator=gen)
        for type_name, n in parts:
            blocks = self.kernel.quantize(torch.randn(n, k, generator=gen) / k**0.5, type_name)
            self.blocks.append(blocks)
            dense.append(self.kernel.dequantize(blocks, type_name, n, k, torch.float32))
            rounded.append(_round_like_ggml(x, self.kernel.type_info(type_name).vec_dot_type.name))
        self.x, self.dense, self.rounded = x, dense, rounded
        self.out = torch.empty(m, sum(self.rows))

    def _bench(self) -> None:
        self.out = torch.cat(self.kernel.mul_mat_group(self.blocks, self.x, self.types, self.rows), -1)

    def _verify(self) -> torch.Tensor:
        return torch.cat([torch.nn.functional.linear(x, w) for x, w in zip(self.rounded, self.dense, strict=True)], -1)

    def setup_attn_qkv_m1(self):
        self._setup([("Q4_K", 4096), ("Q4_K", 512), ("Q6_K", 512)], 1024, 1)

    def benchmark_attn_qkv_m1(self):
        self._bench()

    def verify_attn_qkv_m1(self):
        return self._verify()

    def setup_mlp_gate_up_m1(self):
        self._setup([("Q4_K", 3584), ("Q4_K", 3584)], 1024, 1)

    def benchmark_mlp_gate_up_m1(self):
        self._bench()

    def verify_mlp_gate_up_m1(self):
        return self._verify()


def _add(cls, op: str, type_name: str, n: int, k: int, m: int) -> None:
    name = f"{type_name.lower()}_{n}x{k}_m{m}"

    def setup(self):
        self._setup(type_name, n, k, m)

    def bench(self):
        self.out = getattr(self.kernel, op)(self.blocks, self.x, self.type, self.n)

    def verify(self):
        return self._verify()

    setattr(cls, f"setup_{name}", setup)
    setattr(cls, f"benchmark_{name}", bench)
    setattr(cls, f"verify_{name}", verify)


for _t in TYPES:
    for _m in MATVEC_M:
        for _n, _k in MATVEC_SHAPES:
            _add(MulMatVec, "mul_mat_vec", _t, _n, _k, _m)
    for _m, _shapes in MATMAT.items():
        for _n, _k in _shapes:
            _add(MulMat, "mul_mat", _t, _n, _k, _m)

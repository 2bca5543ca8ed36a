"""ggml-norm at Qwen3.5 shapes: decode (1 token) and prefill (512 tokens).

    kernels benchmark ./packages/ggml-norm          # a local build
    kernels benchmark ggml-org/ggml-norm@v1         # the published one

Workloads are named <op>_<dtype>_h<hidden>_t<tokens>. The reference (verify_*) is the plain
PyTorch formula of transformers' module for that norm, so its time is what transformers runs per
call without the kernel. Inputs are uniform in [-1, 1] and weights near their typical values, so
every output lies below 2 in magnitude, where one bf16 ulp (2^-7) is inside the runner's atol of
1e-2: kernel and reference may round a value near a tie differently (see tests/test_ops.py).
"""

import torch
import torch.nn.functional as F

from kernels.benchmark import Benchmark

HIDDEN = [1024, 2560, 4096]
TOKENS = [1, 512]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
GATED_HEADS, GATED_DIM = 32, 128  # Qwen3.5 linear attention: 32 value heads of 128
L2_HEADS, L2_DIM = 16, 128  # q and k: 16 key heads of 128
EPS = 1e-6


def _uniform(shape, dtype, gen):
    return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)


class RMSNormZeroCentered(Benchmark):
    """Qwen3_5RMSNorm: norm(x) * (1 + w), the input/post-attention/final norms."""

    seed = 0


class RMSNormGated(Benchmark):
    """Qwen3_5RMSNormGated: weight * norm(x).to(dtype) * silu(z), after the gated delta rule."""

    seed = 0


class L2Norm(Benchmark):
    """q/k L2 norm of the gated delta net (transformers' l2norm: mode "rsqrt")."""

    seed = 0


def _add_rms(dtype_name: str, hidden: int, tokens: int) -> None:
    name = f"rms_norm_{dtype_name}_h{hidden}_t{tokens}"
    dtype = DTYPES[dtype_name]

    def setup(self):
        gen = torch.Generator().manual_seed(hidden * 31 + tokens)
        self.x = _uniform((1, tokens, hidden), dtype, gen)
        self.w = (torch.randn(hidden, generator=gen) * 0.05).clamp(-0.1, 0.1).to(dtype)

    def bench(self):
        self.out = self.kernel.rms_norm(self.x, self.w, EPS, True)

    def verify(self):
        xf = self.x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        return (y * (1.0 + self.w.float())).type_as(self.x)

    setattr(RMSNormZeroCentered, f"setup_{name}", setup)
    setattr(RMSNormZeroCentered, f"benchmark_{name}", bench)
    setattr(RMSNormZeroCentered, f"verify_{name}", verify)


def _add_gated(dtype_name: str, tokens: int) -> None:
    name = f"rms_norm_gated_{dtype_name}_h{GATED_DIM}_t{tokens}"
    dtype = DTYPES[dtype_name]

    def setup(self):
        gen = torch.Generator().manual_seed(tokens)
        self.x = _uniform((tokens * GATED_HEADS, GATED_DIM), dtype, gen)
        self.z = _uniform((tokens * GATED_HEADS, GATED_DIM), dtype, gen)
        self.w = (1 + torch.randn(GATED_DIM, generator=gen) * 0.05).clamp(0.9, 1.1).to(dtype)

    def bench(self):
        self.out = self.kernel.rms_norm_gated(self.x, self.z, self.w, EPS)

    def verify(self):
        xf = self.x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        y = self.w * y.to(self.x.dtype)
        return (y * F.silu(self.z.float())).to(self.x.dtype)

    setattr(RMSNormGated, f"setup_{name}", setup)
    setattr(RMSNormGated, f"benchmark_{name}", bench)
    setattr(RMSNormGated, f"verify_{name}", verify)


def _add_l2(tokens: int) -> None:
    name = f"l2_norm_f32_h{L2_DIM}_t{tokens}"

    def setup(self):
        gen = torch.Generator().manual_seed(tokens + 7)
        self.x = torch.randn(1, tokens, L2_HEADS, L2_DIM, generator=gen)

    def bench(self):
        self.out = self.kernel.l2_norm(self.x, EPS, "rsqrt")

    def verify(self):
        return self.x * torch.rsqrt((self.x * self.x).sum(-1, keepdim=True) + EPS)

    setattr(L2Norm, f"setup_{name}", setup)
    setattr(L2Norm, f"benchmark_{name}", bench)
    setattr(L2Norm, f"verify_{name}", verify)


for _d in DTYPES:
    for _t in TOKENS:
        for _h in HIDDEN:
            _add_rms(_d, _h, _t)
        _add_gated(_d, _t)
for _t in TOKENS:
    _add_l2(_t)

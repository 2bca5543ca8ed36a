"""Gated delta net and the short causal conv at Qwen3.5's linear-attention shapes (16 key heads x 128,
16 or 32 value heads x 128, conv kernel 4, conv channels 2 * 16 * 128 + Hv * 128), batch 1:
decode (T = 1, on a state) and a 512-token prefill.

    kernels benchmark ./packages/ggml-gated-delta-net          # a local build
    kernels benchmark ggml-org/ggml-gated-delta-net@v1         # the published one

Workloads are named <op>_<decode|prefill512>_hv<Hv>. The reference (verify_*) is the package's own
per-token loop (reference.py) in float32; the kernel matches it to ~1e-6 of the output scale, far
inside the runner's atol of 1e-2. The reference's time is that loop's (vectorised over heads).
"""

import torch
from kernels.benchmark import Benchmark

HK, D, KERNEL = 16, 128, 4
VALUE_HEADS = [16, 32]
TOKENS = {"decode": 1, "prefill512": 512}


class GatedDeltaNet(Benchmark):
    """gated_delta_net with q/k L2-normalised in the op, from a non-zero state."""

    seed = 0

    def _setup(self, tokens: int, hv: int) -> None:
        gen = torch.Generator().manual_seed(tokens * 100 + hv)
        self.q = torch.randn(1, tokens, HK, D, generator=gen)
        self.k = torch.randn(1, tokens, HK, D, generator=gen)
        self.v = torch.randn(1, tokens, hv, D, generator=gen)
        self.g = -torch.rand(1, tokens, hv, generator=gen)
        self.beta = torch.rand(1, tokens, hv, generator=gen)
        self.state = torch.randn(1, hv, D, D, generator=gen) * 0.1
        self.out = torch.empty(1, tokens, hv, D)

    def _run(self) -> None:
        self.out, _ = self.kernel.gated_delta_net(self.q, self.k, self.v, self.g, self.beta, self.state, l2_normalize_qk=True)

    def _verify(self) -> torch.Tensor:
        out, _ = self.kernel.reference.gated_delta_net(self.q, self.k, self.v, self.g, self.beta, self.state, l2_normalize_qk=True)
        return out


class CausalConv1d(Benchmark):
    """causal_conv1d + SiLU on x (1, C, T) as the layer passes it (a transposed view), with a
    (1, C, K) rolling state."""

    seed = 0

    def _setup(self, tokens: int, hv: int) -> None:
        gen = torch.Generator().manual_seed(tokens * 100 + hv)
        channels = 2 * HK * D + hv * D
        self.x = torch.randn(1, tokens, channels, generator=gen).transpose(1, 2)
        self.w = torch.randn(channels, 1, KERNEL, generator=gen) * 0.5
        self.state = torch.randn(1, channels, KERNEL, generator=gen)
        self.out = torch.empty(1, channels, tokens)

    def _run(self) -> None:
        self.out, _ = self.kernel.causal_conv1d(self.x, self.w, self.state, "silu")

    def _verify(self) -> torch.Tensor:
        out, _ = self.kernel.reference.causal_conv1d(self.x, self.w, self.state, "silu")
        return out


def _add(cls, op: str, phase: str, hv: int) -> None:
    name = f"{op}_{phase}_hv{hv}"
    tokens = TOKENS[phase]

    def setup(self):
        self._setup(tokens, hv)

    def bench(self):
        self._run()

    def verify(self):
        return self._verify()

    setattr(cls, f"setup_{name}", setup)
    setattr(cls, f"benchmark_{name}", bench)
    setattr(cls, f"verify_{name}", verify)


for _hv in VALUE_HEADS:
    for _phase in TOKENS:
        _add(GatedDeltaNet, "gdn", _phase, _hv)
        _add(CausalConv1d, "conv", _phase, _hv)

"""MoE routing (softmax over the experts -> top-8 -> renormalisation) for decode (1 token) and
prefill (512 tokens) at the expert counts of today's MoE models.

    kernels benchmark ./packages/topk                       # a local build
    kernels benchmark transformers-community/topk@v1        # the published one

Workloads are named <dtype>_e<experts>_t<tokens>. The kernel's result is compared as a dense
(tokens, experts) routing matrix (each token's weights at its chosen experts, zeros elsewhere), so
the check covers the chosen experts and their weights at once. The reference (verify_*) is what
transformers' softmax top-k router runs after its router linear (softmax in float32, torch.topk,
divide by the sum, cast back) plus that scatter: its time is the eager cost per call.
"""

import torch

from kernels.benchmark import Benchmark

K = 8
EXPERTS = [64, 128, 256, 512]
TOKENS = [1, 512]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _dense(weights: torch.Tensor, indices: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(weights.shape[0], experts).scatter_(1, indices, weights.float())


class SoftmaxTopK(Benchmark):
    """topk.softmax_top_k(logits, 8): the fused routing op."""

    seed = 0

    # The runner reads `out` after a benchmark call; the call stores (weights, indices) and `out`
    # turns them into the dense routing matrix only when read, so the timed call is the op alone.
    @property
    def out(self):
        routed = self.__dict__.get("_routed")
        return None if routed is None else _dense(*routed, self.experts)

    @out.setter
    def out(self, value):
        self.__dict__["_routed"] = value

    def _setup(self, dtype: torch.dtype, experts: int, tokens: int) -> None:
        gen = torch.Generator().manual_seed(experts * 131 + tokens)
        self.experts = experts
        self.logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)

    def _verify(self) -> torch.Tensor:
        probs = torch.nn.functional.softmax(self.logits, dtype=torch.float, dim=-1)
        values, indices = torch.topk(probs, K, dim=-1)
        values /= values.sum(dim=-1, keepdim=True)
        return _dense(values.to(self.logits.dtype), indices, self.experts)


def _add(dname: str, dtype: torch.dtype, experts: int, tokens: int) -> None:
    name = f"{dname}_e{experts}_t{tokens}"

    def setup(self):
        self._setup(dtype, experts, tokens)

    def bench(self):
        self.out = self.kernel.softmax_top_k(self.logits, K)

    def verify(self):
        return self._verify()

    setattr(SoftmaxTopK, f"setup_{name}", setup)
    setattr(SoftmaxTopK, f"benchmark_{name}", bench)
    setattr(SoftmaxTopK, f"verify_{name}", verify)


for _dname, _dtype in DTYPES.items():
    for _e in EXPERTS:
        for _t in TOKENS:
            _add(_dname, _dtype, _e, _t)

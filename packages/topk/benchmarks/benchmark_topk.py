"""MoE routing (softmax over the experts -> top-8 -> renormalisation) for decode (1 token) and
prefill (512 tokens) at the expert counts of today's MoE models.

    kernels benchmark ./packages/topk                       # a local build
    kernels benchmark transformers-community/topk@v1        # the published one

Workloads are named <dtype>_e<experts>_t<tokens>. Each class times one implementation of the same
workloads, the router logits given:
  SoftmaxTopK               topk.softmax_top_k(logits, 8): the fused op
  SoftmaxTopK_ggml          topk.top_k_ggml: ggml-cpu's soft_max_ext -> top_k -> get_rows -> sum_rows
                            -> div as one-op graphs (ggml's own ops for the same routing)
  SoftmaxTopK_eager         what transformers' softmax top-k router runs after its router linear
                            (softmax in float32, torch.topk, divide by the sum, cast back)
  SoftmaxTopK_reference     topk.reference.softmax_top_k (eager plus input checks and +inf handling)
and the whole router module, its router linear included (hidden 2048, Qwen3.5-35B-A3B's size):
  Router                    transformers' Qwen3_5MoeTopKRouter kernelized onto this package's layer
  Router_transformers       the same module as transformers ships it

Every result is compared as a dense (tokens, experts) routing matrix (each token's weights at its
chosen experts, zeros elsewhere), so the check covers the chosen experts and their weights at once.
The reference (verify_*) is the eager routing plus that scatter. GGML_KERNELS_BENCH_QUICK=1 runs
two expert counts (for tests).
"""

import os
from pathlib import Path

import torch
from kernels.benchmark import Benchmark

QUICK = os.environ.get("GGML_KERNELS_BENCH_QUICK") == "1"
K = 8
EXPERTS = [64, 256] if QUICK else [64, 128, 256, 512]
TOKENS = [1, 512]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
HIDDEN = 2048


def _dense(weights: torch.Tensor, indices: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(weights.shape[0], experts).scatter_(1, indices, weights.float())


def _eager_routing(logits: torch.Tensor):
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    values, indices = torch.topk(probs, K, dim=-1)
    values /= values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), indices


def _add(cls, name: str, *params) -> None:
    """Workload `name` of cls and its subclasses: prepare(*params), then run() timed, reference() checked."""
    setattr(cls, f"setup_{name}", lambda self: self.prepare(*params))
    setattr(cls, f"benchmark_{name}", lambda self: self.run())
    setattr(cls, f"verify_{name}", lambda self: self.reference())


class _Routing:
    """Shared setup, reference and output (not a Benchmark itself: the runner would time it). The
    runner reads `out` after a benchmark call; the call stores (weights, indices) and `out`
    turns them into the dense routing matrix only when read, so the timed call is the routing alone."""

    seed = 0

    @property
    def out(self):
        routed = self.__dict__.get("_routed")
        return None if routed is None else _dense(*routed, self.experts)

    @out.setter
    def out(self, value):
        self.__dict__["_routed"] = value

    def prepare(self, dtype: torch.dtype, experts: int, tokens: int) -> None:
        gen = torch.Generator().manual_seed(experts * 131 + tokens)
        self.experts = experts
        self.logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)

    def reference(self) -> torch.Tensor:
        return _dense(*_eager_routing(self.logits), self.experts)


class SoftmaxTopK(_Routing, Benchmark):
    def run(self) -> None:
        self.out = self.kernel.softmax_top_k(self.logits, K)


class SoftmaxTopK_ggml(_Routing, Benchmark):
    """Checked on each token's weights in order: where experts tie (common in bfloat16) ggml's graph
    may pick another of the tied experts, which the dense matrix would count as a difference."""

    @property
    def out(self):
        routed = self.__dict__.get("_routed")
        return None if routed is None else routed[0].float().sort(-1).values

    @out.setter
    def out(self, value):
        self.__dict__["_routed"] = value

    def run(self) -> None:
        self.out = self.kernel.top_k_ggml(self.logits, K, True, True)

    def reference(self) -> torch.Tensor:
        return _eager_routing(self.logits)[0].float().sort(-1).values


class SoftmaxTopK_eager(_Routing, Benchmark):
    def run(self) -> None:
        self.out = _eager_routing(self.logits)


class SoftmaxTopK_reference(_Routing, Benchmark):
    def run(self) -> None:
        self.out = self.kernel.reference.softmax_top_k(self.logits, K)


class Router_transformers(_Routing, Benchmark):
    """Qwen3_5MoeTopKRouter.forward(hidden) -> (logits, weights, indices); checked against the eager
    routing of the logits that forward computed."""

    def prepare(self, dtype: torch.dtype, experts: int, tokens: int) -> None:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

        gen = torch.Generator().manual_seed(experts * 131 + tokens)
        self.experts = experts
        config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=K,
                                      num_hidden_layers=1)
        self.module = Qwen3_5MoeTopKRouter(config).requires_grad_(False)
        self.module.weight.copy_(torch.randn(experts, HIDDEN, generator=gen) * 0.02)
        self.module = self.module.to(dtype).eval()
        self.hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)

    def run(self) -> None:
        self.out = self.module(self.hidden)[1:]

    def reference(self) -> torch.Tensor:
        return _dense(*_eager_routing(self.module(self.hidden)[0]), self.experts)


class Router(Router_transformers):
    def prepare(self, dtype: torch.dtype, experts: int, tokens: int) -> None:
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

        super().prepare(dtype, experts, tokens)
        repo = LocalLayerRepository(repo_path=Path(self.kernel.__file__).parent, layer_name="SoftmaxTopKRouter")
        with use_kernel_mapping({"SoftmaxTopKRouter": {"cpu": repo}}, inherit_mapping=False):
            kernelize(self.module, device="cpu", mode=Mode.INFERENCE)


for _dname, _dtype in DTYPES.items():
    for _e in EXPERTS:
        for _t in TOKENS:
            _add(_Routing, f"{_dname}_e{_e}_t{_t}", _dtype, _e, _t)

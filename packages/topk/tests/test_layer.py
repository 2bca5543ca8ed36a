"""The SoftmaxTopKRouter layer grafted onto transformers' own routers with kernels' kernelize, as a
user (or transformers' GGUF integration) does it, compared with the routers' original forward.

The mapping points "SoftmaxTopKRouter" on the CPU at this package folder (LocalLayerRepository,
absolute path: kernels caches loaded builds by path, so the session's get_kernel import is reused).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from kernels import LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.laguna.configuration_laguna import LagunaConfig
from transformers.models.laguna.modeling_laguna import LagunaTopKRouter
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeSparseMoeBlock,
    Qwen3_5MoeTopKRouter,
)
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from tools.testing.kernel_testing import variant_dir

HIDDEN = 64
DT_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def mapping():
    return {"SoftmaxTopKRouter": {"cpu": LocalLayerRepository(repo_path=variant_dir("topk"), layer_name="SoftmaxTopKRouter")}}


def kernelized(module, mode=Mode.INFERENCE):
    with use_kernel_mapping(mapping(), inherit_mapping=False):
        return kernelize(module, device="cpu", mode=mode)


def qwen35_config(experts=128, k=8):
    return Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=1,
    )


def randomize(module, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.to(dtype).eval()


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatcher (ours included) while active."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def count(self, suffix: str) -> int:
        return sum(n for name, n in self.calls.items() if name.endswith(suffix))


def pair(module):
    """(original, kernelized copy)."""
    ours = kernelized(copy.deepcopy(module))
    return module, ours


def tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10, "atol": 1e-6}


def check_same(orig_out, our_out, dtype):
    (lo, wo, io), (logits_ours, w, i) = orig_out, our_out
    assert torch.equal(logits_ours, lo)  # the router logits: the same F.linear
    assert i.dtype == io.dtype == torch.int64 and w.dtype == wo.dtype == dtype
    assert torch.equal(i, io)
    torch.testing.assert_close(w, wo, **tol(dtype))


def cases():
    for e in (8, 64, 128, 256, 512):
        for k in (1, 2, 8, 16):
            if k <= e:
                yield e, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DT_IDS.get)
@pytest.mark.parametrize("tokens", [1, 3, 512])
@pytest.mark.parametrize("experts,k", list(cases()))
def test_qwen35_router_matches_transformers(tk, dtype, tokens, experts, k):
    orig, ours = pair(randomize(Qwen3_5MoeTopKRouter(qwen35_config(experts, k)), experts + k, dtype))
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.no_grad():
        expected = orig(x)
        with OpCounter() as ops:
            got = ours(x)
    check_same(expected, got, dtype)
    assert ops.count("::top_k") == 1 and ops.count("aten::topk") == 0, ops.calls


def test_kernelize_swaps_in_our_forward(tk):
    orig, ours = pair(randomize(Qwen3_5MoeTopKRouter(qwen35_config()), 0, torch.float32))
    assert ours.forward.__func__ is tk.layers.SoftmaxTopKRouter.forward
    assert "forward" not in vars(orig)  # the original keeps its class forward


def test_zero_initialised_router_ties(tk):
    """transformers initialises the router weight to zeros: every expert ties, torch's order wins."""
    for experts, k in cases():
        orig, ours = pair(Qwen3_5MoeTopKRouter(qwen35_config(experts, k)).eval())
        x = torch.randn(5, HIDDEN)
        with torch.no_grad():
            check_same(orig(x), ours(x), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT_IDS.get)
@pytest.mark.parametrize("tokens", [1, 7])
def test_qwen35_moe_block(tk, dtype, tokens):
    """The whole sparse MoE block (router -> experts) with the kernelized router: the experts consume
    our weights and int64 indices as they consume the original's."""
    block = randomize(Qwen3_5MoeSparseMoeBlock(qwen35_config(64, 8)), 1, dtype)
    orig, ours = pair(block)
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        expected = orig(x)
        with OpCounter() as ops:
            got = ours(x)
    assert ops.count("::top_k") == 1 and ops.count("aten::topk") == 0
    torch.testing.assert_close(got, expected, **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))


@pytest.mark.parametrize("norm", [True, False])
def test_norm_topk_prob_attribute(tk, norm):
    """Qwen3-MoE's router has the same forward plus `norm_topk_prob`; the layer honours it."""

    class Router(Qwen3MoeTopKRouter):
        pass

    replace_kernel_forward_from_hub(Router, "SoftmaxTopKRouter")
    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=64, num_experts_per_tok=4, norm_topk_prob=norm)
    orig, ours = pair(randomize(Router(cfg), 3, torch.float32))
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        expected, got = orig(x), ours(x)
    check_same(expected, got, torch.float32)
    assert torch.allclose(got[1].sum(-1), torch.ones(9)) == norm


def test_laguna_router_keeps_its_forward(tk):
    """Laguna's router shares the name but scores with a sigmoid and a correction bias: the layer
    runs its own forward for it, unchanged."""
    cfg = LagunaConfig(hidden_size=HIDDEN, num_experts=32, num_experts_per_tok=4, moe_router_logit_softcapping=0.0)
    orig, ours = pair(randomize(LagunaTopKRouter(cfg), 4, torch.float32))
    x = torch.randn(6, HIDDEN)
    with torch.no_grad():
        expected = orig(x)
        with OpCounter() as ops:
            got = ours(x)
    assert ops.count("::top_k") == 0
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_grad_enabled_forward(tk):
    """Called without no_grad (the router weight is a Parameter): works, no warning; indices exact."""
    orig, ours = pair(randomize(Qwen3_5MoeTopKRouter(qwen35_config(64, 4)), 5, torch.float32))
    x = torch.randn(4, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours(x)
    check_same(orig(x), got, torch.float32)


def test_packed_weight_is_a_clear_error(tk):
    _, ours = pair(randomize(Qwen3_5MoeTopKRouter(qwen35_config(64, 4)), 6, torch.float32))
    ours.weight = torch.nn.Parameter(torch.zeros(64, 72, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(TypeError, match="packed GGUF data"):
        ours(torch.randn(2, HIDDEN))


def test_torch_compile_kernelized_router(tk):
    orig = randomize(Qwen3_5MoeTopKRouter(qwen35_config(128, 8)), 7, torch.bfloat16)
    ours = kernelized(copy.deepcopy(orig), Mode.INFERENCE | Mode.TORCH_COMPILE)
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    with torch.no_grad():
        for tokens in (1, 4, 33):
            x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
            check_same(orig(x), compiled(x), torch.bfloat16)

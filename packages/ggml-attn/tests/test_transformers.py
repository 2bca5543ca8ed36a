"""ggml-attn as transformers' attention on a small random Qwen3.5 model: logits equal SDPA's within
tolerance, greedy generation identical, and the kernel really ran."""

from __future__ import annotations

import pytest
import torch

from tools.testing.kernel_testing import backend_kwargs

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

HUB_ID = "ggml-org/ggml-attn"


def tiny_qwen35() -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    config._attn_implementation = "sdpa"
    return Qwen3_5ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def attn_name(ga):
    """The name the model selects. On a CPU build of torch that is the Hub id itself (transformers
    loads the kernel through kernels.get_kernel and LOCAL_KERNELS). A CUDA build of torch makes
    kernels look for a CUDA variant; there the kernel is registered explicitly instead."""
    if backend_kwargs():
        AttentionInterface.register("ggml_attn_cpu", ga.flash_attn_forward)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        ALL_MASK_ATTENTION_FUNCTIONS.register("ggml_attn_cpu", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        return "ggml_attn_cpu"
    return HUB_ID


class CountCalls:
    """Counts calls of our op (by its namespace) while a model runs."""

    def __init__(self, ga):
        self.ns = ga.ops.name
        self.calls = 0

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        self.calls = sum(e.count for e in self.prof.key_averages() if e.key.startswith(self.ns + "::"))


@torch.inference_mode()
def test_logits_and_greedy_generation_match_sdpa(ga, attn_name):
    model = tiny_qwen35()
    ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    ref_logits = model(ids).logits
    ref_tokens = model.generate(ids, max_new_tokens=16, do_sample=False)

    model.set_attn_implementation(attn_name)
    with CountCalls(ga) as counter:
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=16, do_sample=False)
    # 2 full-attention layers x (1 forward + 1 prefill + 15 decode steps)
    assert counter.calls == 2 * 17
    scale = ref_logits.abs().max()
    assert ((logits - ref_logits).abs().max() / scale).item() < 1e-5
    assert torch.equal(tokens, ref_tokens)


@torch.inference_mode()
def test_left_padded_batch_equals_prompts_alone(ga, attn_name):
    model = tiny_qwen35()
    model.set_attn_implementation(attn_name)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 256, (1, 12), generator=g), torch.randint(1, 256, (1, 7), generator=g)
    pad = 12 - 7
    batch = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    out = model(batch, attention_mask=mask).logits
    alone_a, alone_b = model(a).logits, model(b).logits
    assert torch.isfinite(out).all()
    assert ((out[0] - alone_a[0]).abs().max() / alone_a.abs().max()).item() < 1e-4
    assert ((out[1, pad:] - alone_b[0]).abs().max() / alone_b.abs().max()).item() < 1e-4
    gen = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(gen[0, 12:], model.generate(a, max_new_tokens=8, do_sample=False)[0, 12:])
    assert torch.equal(gen[1, 12:], model.generate(b, max_new_tokens=8, do_sample=False)[0, 7:])

"""The kernels-library layer against transformers' own `Qwen3_5GatedDeltaNet` (its torch fallbacks):
kernelized through `use_kernel_mapping` + `kernelize`, as a user (or transformers on "mps") does.

Tolerances: float32 LAYER_TOL = 1e-5 of the output scale. Both sides run the same float32 math in a
different order (transformers' chunked UT-transform algebra for prefill vs ggml's token recurrence):
observed ~4e-7 of the scale after a prefill and 10 decode steps. bfloat16 BF16_LAYER_TOL = 3e-2:
transformers rounds to bf16 at more places than we do (beta, the conv in bf16, the gated norm's
intermediates), each ~2^-9 relative, and the projections carry them on; observed up to 1.5e-2. Against
the same module run in float32, ours is the closer one (0.7-0.9e-2 vs 1.1e-2).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5GatedDeltaNet

from tools.testing.kernel_testing import variant_dir

LAYER_TOL = 1e-5
BF16_LAYER_TOL = 3e-2


CONFIGS = {
    # GQA-style: 4 value heads on 2 key heads, head dim 64
    "hv2hk_d64": dict(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64),
    # Hv == Hk, head dim 128 (Qwen3.5's)
    "hv1hk_d128": dict(hidden_size=192, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128),
}


def assert_close_scaled(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """|out - ref| <= tol * max|ref|, elementwise."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape
    scale = ref.abs().max().item() or 1.0
    err = (out - ref).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3e} = {err / scale:.2e} of the scale {scale:.3e} (tolerance {tol:.0e})"


def make_config(name: str, layers: int = 2, **extra) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        num_hidden_layers=layers, linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=256, vocab_size=128, **CONFIGS[name], **extra,
    )


def mapping():
    # the build variant folder itself: kernels then takes our CPU build on a CUDA torch too
    repo = LocalLayerRepository(repo_path=variant_dir("ggml-gated-delta-net"), layer_name="Qwen3_5GatedDeltaNet")
    return {"Qwen3_5GatedDeltaNet": {"cpu": repo}}


def make_pair(config, layer_idx=0, dtype=torch.float32, seed=0):
    """transformers' module with random weights, and a kernelized copy."""
    torch.manual_seed(seed)
    ref = Qwen3_5GatedDeltaNet(config, layer_idx=layer_idx).eval()
    with torch.no_grad():  # non-trivial norm weight and dt_bias
        ref.norm.weight.add_(0.1 * torch.randn_like(ref.norm.weight))
        ref.dt_bias.add_(0.5 * torch.randn_like(ref.dt_bias))
    ref = ref.to(dtype)
    ours = copy.deepcopy(ref)
    with use_kernel_mapping(mapping()):
        kernelize(ours, device="cpu", mode=Mode.INFERENCE)
    return ref, ours


def op_counts(fn) -> Counter:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events())


def our_ops(counts: Counter, gdn) -> Counter:
    ns = gdn.ops.name + "::"
    return Counter({name[len(ns):]: n for name, n in counts.items() if name.startswith(ns)})


def states(cache, idx):
    layer = cache.layers[idx]
    return layer.conv_states[0], layer.recurrent_states[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_transformers(gdn, name):
    config = make_config(name)
    ref, ours = make_pair(config, layer_idx=1)
    assert ours.forward.__func__ is not Qwen3_5GatedDeltaNet.forward  # kernelize swapped it
    ref_cache, our_cache = DynamicCache(config=config), DynamicCache(config=config)
    x = torch.randn(2, 23, config.hidden_size)
    with torch.no_grad():
        counts = op_counts(lambda: ours(x, cache_params=our_cache))
        ops = our_ops(counts, gdn)
        assert ops == Counter(causal_conv1d=1, gates=1, gated_delta_net=1, gated_rms_norm=1), ops
        assert "aten::linalg_solve_triangular" not in counts and "aten::conv1d" not in counts
        y_ref = ref(x, cache_params=ref_cache)
        # run again on fresh caches for the value check (the profiled run filled our_cache)
        our_cache = DynamicCache(config=config)
        y = ours(x, cache_params=our_cache)
        assert_close_scaled(y, y_ref, LAYER_TOL)
        for a, b in zip(states(our_cache, 1), states(ref_cache, 1), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert_close_scaled(a, b, LAYER_TOL)
        assert our_cache.has_previous_state(1)
        # the cache holds the state in ggml's layout (zeros_like kept our strides): no transposes
        assert states(our_cache, 1)[1].transpose(-1, -2).is_contiguous()

        for step in range(10):
            x = torch.randn(2, 1, config.hidden_size)
            if step == 0:
                ops = our_ops(op_counts(lambda x=x: ours(x, cache_params=copy.deepcopy(our_cache))), gdn)
                # decode updates the cached conv and recurrent states in place
                assert ops == Counter(causal_conv1d_=1, gates=1, gated_delta_net_=1, gated_rms_norm=1), ops
            conv_before, state_before = states(our_cache, 1)
            y_ref, y = ref(x, cache_params=ref_cache), ours(x, cache_params=our_cache)
            # updated in place, as transformers does (its update_recurrent_state copies into the cache)
            assert states(our_cache, 1)[0] is conv_before and states(our_cache, 1)[1] is state_before
            assert_close_scaled(y, y_ref, LAYER_TOL)
        for a, b in zip(states(our_cache, 1), states(ref_cache, 1), strict=True):
            assert_close_scaled(a, b, LAYER_TOL)


def test_prefill_continuing_a_cache(gdn):
    """A second multi-token chunk on a filled cache (chunked prefill): conv over [cached | new]."""
    config = make_config("hv2hk_d64")
    ref, ours = make_pair(config)
    ref_cache, our_cache = DynamicCache(config=config), DynamicCache(config=config)
    with torch.no_grad():
        for t in (9, 2, 7, 1, 5):
            x = torch.randn(1, t, config.hidden_size)
            assert_close_scaled(ours(x, cache_params=our_cache), ref(x, cache_params=ref_cache), LAYER_TOL)
    for a, b in zip(states(our_cache, 0), states(ref_cache, 0), strict=True):
        assert_close_scaled(a, b, LAYER_TOL)


def test_short_prefill_and_no_cache(gdn):
    """Prefill shorter than the conv kernel (the cache pads), and a forward without any cache."""
    config = make_config("hv1hk_d128")
    ref, ours = make_pair(config)
    with torch.no_grad():
        x = torch.randn(3, 2, config.hidden_size)
        ref_cache, our_cache = DynamicCache(config=config), DynamicCache(config=config)
        assert_close_scaled(ours(x, cache_params=our_cache), ref(x, cache_params=ref_cache), LAYER_TOL)
        for a, b in zip(states(our_cache, 0), states(ref_cache, 0), strict=True):
            assert_close_scaled(a, b, LAYER_TOL)
        x = torch.randn(2, 17, config.hidden_size)
        assert_close_scaled(ours(x), ref(x), LAYER_TOL)


def test_recording_past(gdn):
    """With past recording on (assisted decoding), transformers keeps the full conv history and
    decodes through update_conv_state: the same branch here."""
    config = make_config("hv2hk_d64")
    ref, ours = make_pair(config)
    ref_cache, our_cache = DynamicCache(config=config), DynamicCache(config=config)
    ref_cache.activate_past_recording()
    our_cache.activate_past_recording()
    with torch.no_grad():
        for t in (6, 1, 1, 3):
            x = torch.randn(1, t, config.hidden_size)
            assert_close_scaled(ours(x, cache_params=our_cache), ref(x, cache_params=ref_cache), LAYER_TOL)
    assert states(our_cache, 0)[0].shape == states(ref_cache, 0)[0].shape == (1, ours.conv_dim, 11)


def test_left_padded_batch_equals_each_prompt_alone(gdn):
    config = make_config("hv2hk_d64")
    ref, ours = make_pair(config)
    gen = torch.Generator().manual_seed(5)
    long, short = torch.randn(1, 12, config.hidden_size, generator=gen), torch.randn(1, 8, config.hidden_size, generator=gen)
    batch = torch.cat([long, torch.cat([torch.randn(1, 4, config.hidden_size, generator=gen), short], 1)])  # junk in the pad slots
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    steps = [torch.randn(2, 1, config.hidden_size, generator=gen) for _ in range(3)]
    with torch.no_grad():
        batch_cache, ref_cache = DynamicCache(config=config), DynamicCache(config=config)
        y = ours(batch, cache_params=batch_cache, attention_mask=mask)
        assert_close_scaled(y, ref(batch, cache_params=ref_cache, attention_mask=mask), LAYER_TOL)
        decode = [ours(s, cache_params=batch_cache) for s in steps]
        for i, prompt in enumerate((long, short)):
            cache = DynamicCache(config=config)
            alone = ours(prompt, cache_params=cache)
            assert_close_scaled(y[i : i + 1, 12 - prompt.shape[1] :], alone, LAYER_TOL)
            for s, d in zip(steps, decode, strict=True):
                assert_close_scaled(d[i : i + 1], ours(s[i : i + 1], cache_params=cache), LAYER_TOL)


def test_bf16_layer(gdn):
    config = make_config("hv2hk_d64")
    ref, ours = make_pair(config, dtype=torch.bfloat16)
    ref_cache, our_cache = DynamicCache(config=config), DynamicCache(config=config)
    with torch.no_grad():
        for t in (16, 1, 1, 1):
            x = torch.randn(2, t, config.hidden_size).bfloat16()
            y, y_ref = ours(x, cache_params=our_cache), ref(x, cache_params=ref_cache)
            assert y.dtype == torch.bfloat16
            assert_close_scaled(y, y_ref, BF16_LAYER_TOL)
    conv, rec = states(our_cache, 0)
    assert conv.dtype == torch.bfloat16 and rec.dtype == torch.float32


def test_whole_model_generate(gdn):
    """A tiny Qwen3.5 (one linear-attention and one full-attention layer) kernelized as a whole:
    generate() builds its own cache; greedy tokens and logits match transformers."""
    config = make_config("hv2hk_d64", layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    ref = Qwen3_5ForCausalLM(config).eval()
    ours = copy.deepcopy(ref)
    with use_kernel_mapping(mapping()):
        kernelize(ours, device="cpu", mode=Mode.INFERENCE)
    prompt = torch.randint(0, config.vocab_size, (1, 9))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        counts = op_counts(lambda: ours.generate(prompt, **kwargs))
        ours_out = ours.generate(prompt, **kwargs)
        ref_out = ref.generate(prompt, **kwargs)
    ops = our_ops(counts, gdn)
    assert (ops["gated_delta_net"], ops["gated_delta_net_"]) == (1, 7)  # one prefill, 7 decode steps in place
    assert torch.equal(ours_out.sequences, ref_out.sequences)
    for a, b in zip(ours_out.logits, ref_out.logits, strict=True):
        assert_close_scaled(a, b, 1e-4)


def test_torch_compile_layer_fullgraph(gdn):
    """can_torch_compile = True: the kernelized forward traces in one graph (fake impls), with and
    without transformers' cache, and gives the eager results."""
    config = make_config("hv2hk_d64")
    ref, ours = make_pair(config)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    ref_cache, our_cache = DynamicCache(config=config), DynamicCache(config=config)
    with torch.no_grad():
        x = torch.randn(1, 5, config.hidden_size)
        assert_close_scaled(compiled(x), ref(x), LAYER_TOL)
        for t in (5, 1, 1):
            x = torch.randn(1, t, config.hidden_size)
            assert_close_scaled(compiled(x, cache_params=our_cache), ref(x, cache_params=ref_cache), LAYER_TOL)

"""Bad input gets a clear Python exception naming the problem, never a crash or an out-of-bounds
read. The checks live in the kernel, so the op is called directly (torch.ops) too; the layer's
cache checks are Python."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

B, T, HK, HV, D = 1, 3, 2, 4, 64


def inputs(**over):
    x = dict(
        q=torch.randn(B, T, HK, D), k=torch.randn(B, T, HK, D), v=torch.randn(B, T, HV, D),
        g=-torch.rand(B, T, HV), beta=torch.rand(B, T, HV), state=torch.zeros(B, HV, D, D),
    )
    x.update(over)
    return x


def call(gdn, **over):
    a = inputs(**over)
    return gdn.gated_delta_net(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"])


def test_heads_not_a_multiple(gdn):
    with pytest.raises(ValueError, match=r"value heads \(3\) must be a multiple of key heads \(2\)"):
        call(gdn, v=torch.randn(B, T, 3, D), g=torch.rand(B, T, 3), beta=torch.rand(B, T, 3), state=None)
    with pytest.raises(ValueError, match="must be a multiple of key heads"):
        a = inputs(v=torch.randn(B, T, 3, D), g=torch.rand(B, T, 3), beta=torch.rand(B, T, 3))
        gdn.ops.gated_delta_net(a["q"], a["k"], a["v"], a["g"], a["beta"], None, True, None)


def test_unsupported_head_dim(gdn):
    with pytest.raises(ValueError, match=r"head dim 96 is not supported \(32, 64 or 128\)"):
        call(gdn, q=torch.randn(B, T, HK, 96), k=torch.randn(B, T, HK, 96), v=torch.randn(B, T, HV, 96), state=None)
    with pytest.raises(ValueError, match="key head dim 128 differs from value head dim 64"):
        call(gdn, q=torch.randn(B, T, HK, 128), k=torch.randn(B, T, HK, 128), state=None)


def test_dtype_mismatch(gdn):
    with pytest.raises(TypeError, match="q, k and v must share one dtype, got q BFloat16, k Float, v Float"):
        call(gdn, q=torch.randn(B, T, HK, D).bfloat16())
    with pytest.raises(TypeError, match="q must have dtype Float, BFloat16, Half; got Long"):
        call(gdn, q=torch.ones(B, T, HK, D, dtype=torch.long))


def test_bad_state(gdn):
    with pytest.raises(TypeError, match="state must have dtype Float; got BFloat16"):
        call(gdn, state=torch.zeros(B, HV, D, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"state must be \(batch, value heads, key dim, value dim\) = \[1, 4, 64, 64\], got \[1, 2, 64, 64\]"):
        call(gdn, state=torch.zeros(B, HK, D, D))
    with pytest.raises(ValueError, match="state must be"):
        call(gdn, state=torch.zeros(B, HV, D * D))


def test_bad_shapes(gdn):
    with pytest.raises(ValueError, match=r"k must have q's shape"):
        call(gdn, k=torch.randn(B, T, HK + 1, D))
    with pytest.raises(ValueError, match=r"q \(batch, tokens, key heads, head dim\) must be 4-D"):
        call(gdn, q=torch.randn(T, HK, D))
    with pytest.raises(ValueError, match=r"must agree on batch and tokens"):
        call(gdn, v=torch.randn(B, T + 1, HV, D))
    with pytest.raises(ValueError, match=r"g must be \(batch, tokens, value heads\) = \[1, 3, 4\], got \[1, 3, 2\]"):
        call(gdn, g=torch.rand(B, T, HK))
    with pytest.raises(ValueError, match=r"beta must be"):
        call(gdn, beta=torch.rand(B, T))


def test_not_cpu(gdn):
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        call(gdn, q=torch.randn(B, T, HK, D, device="meta"))


def test_conv_bad_input(gdn):
    x, w = torch.randn(1, 8, 5), torch.randn(8, 1, 4)
    with pytest.raises(ValueError, match=r"weight has 6 channels but x"):
        gdn.causal_conv1d(x, torch.randn(6, 1, 4))
    with pytest.raises(ValueError, match=r"weight must be \(channels, 1, kernel\) or \(channels, kernel\)"):
        gdn.causal_conv1d(x, torch.randn(8, 2, 4))
    with pytest.raises(ValueError, match=r"state must be \(batch, channels, >= kernel - 1\) = \[1, 8, 3\]"):
        gdn.causal_conv1d(x, w, torch.randn(1, 8, 2))
    with pytest.raises(ValueError, match="state must be"):
        gdn.causal_conv1d(x, w, torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match="activation must be None, 'silu' or 'swish', got 'gelu'"):
        gdn.causal_conv1d(x, w, None, "gelu")
    with pytest.raises(ValueError, match=r"x \(batch, channels, tokens\) must be 3-D"):
        gdn.causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match=r"bias must be \(channels,\)"):
        gdn.causal_conv1d(x, w, bias=torch.randn(3))


def test_small_ops_bad_input(gdn):
    with pytest.raises(ValueError, match=r"a must be \(\.\.\., 4\)"):
        gdn.gates(torch.randn(4), torch.randn(2, 3), torch.randn(4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="b must have a's shape"):
        gdn.gates(torch.randn(4), torch.randn(2, 4), torch.randn(4), torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"weight must be \(16,\)"):
        gdn.gated_rms_norm(torch.randn(2, 16), torch.randn(2, 16), torch.ones(8))
    with pytest.raises(ValueError, match="gate must have x's shape"):
        gdn.gated_rms_norm(torch.randn(2, 16), torch.randn(2, 8), torch.ones(16))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        gdn.l2_norm(torch.randn(2, 16), -1.0)


# ---- the layer: a cache that cannot belong to it ----


def _config(**kw):
    base = dict(hidden_size=128, num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=32, linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                intermediate_size=128, vocab_size=64, layer_types=["linear_attention", "linear_attention", "full_attention"])
    base.update(kw)
    return Qwen3_5TextConfig(**base)


def _layer(gdn, config, layer_idx):
    from tools.testing.kernel_testing import variant_dir
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    module = Qwen3_5GatedDeltaNet(config, layer_idx=layer_idx).eval()
    repo = LocalLayerRepository(repo_path=variant_dir("ggml-gated-delta-net"), layer_name="Qwen3_5GatedDeltaNet")
    with use_kernel_mapping({"Qwen3_5GatedDeltaNet": {"cpu": repo}}):
        kernelize(module, device="cpu", mode=Mode.INFERENCE)
    return module


@torch.no_grad()
def test_cache_from_another_layer(gdn):
    config = _config()
    module = _layer(gdn, config, layer_idx=2)  # layer 2 of this cache is a full-attention layer
    with pytest.raises(ValueError, match="cache layer 2 is a .*, not a linear-attention cache layer: layer_idx=2 does not match"):
        module(torch.randn(1, 3, 128), cache_params=DynamicCache(config=config))
    module = _layer(gdn, _config(layer_types=["linear_attention"] * 3), layer_idx=2)
    one_layer = _config(num_hidden_layers=1, layer_types=["linear_attention"])
    with pytest.raises(ValueError, match="cache_params has 1 layers but this linear-attention layer has layer_idx=2"):
        module(torch.randn(1, 3, 128), cache_params=DynamicCache(config=one_layer))


@torch.no_grad()
def test_cache_from_another_model(gdn):
    small, other = _config(), _config(linear_num_value_heads=2)
    cache = DynamicCache(config=other)
    _layer(gdn, other, 0)(torch.randn(1, 3, 128), cache_params=cache)  # fills layer 0 for the other model
    with pytest.raises(ValueError, match=r"cache layer 0 holds a conv state of shape \(1, 192, 4\), but layer_idx=0 needs \(batch, 256, 4\)"):
        _layer(gdn, small, 0)(torch.randn(1, 1, 128), cache_params=cache)


@torch.no_grad()
def test_cache_for_another_batch(gdn):
    config = _config()
    module = _layer(gdn, config, 0)
    cache = DynamicCache(config=config)
    module(torch.randn(2, 3, 128), cache_params=cache)
    with pytest.raises(ValueError, match="holds a conv state for batch size 2, but hidden_states has batch size 1"):
        module(torch.randn(1, 1, 128), cache_params=cache)

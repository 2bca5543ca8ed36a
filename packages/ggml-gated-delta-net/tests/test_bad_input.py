"""Bad input gets a clear Python exception naming the problem, never a crash or an out-of-bounds read.
The checks live in the kernel, so the op is called directly (torch.ops) too; the layer's cache
checks are Python. Every test runs on each build kind of the package (conftest.py: cpu, metal-emu,
mps-emu): the checks are shared, the words the same."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from tools.testing.kernel_testing import assert_fake_refuses_as_cpu, on_meta

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


def test_heads_not_a_multiple(build):
    with pytest.raises(ValueError, match=r"value heads \(3\) must be a multiple of key heads \(2\)"):
        call(build, v=torch.randn(B, T, 3, D), g=torch.rand(B, T, 3), beta=torch.rand(B, T, 3), state=None)
    with pytest.raises(ValueError, match="must be a multiple of key heads"):
        a = inputs(v=torch.randn(B, T, 3, D), g=torch.rand(B, T, 3), beta=torch.rand(B, T, 3))
        build.ops.gated_delta_net(a["q"], a["k"], a["v"], a["g"], a["beta"], None, True, None)


def test_unsupported_head_dim(build):
    with pytest.raises(ValueError, match=r"head dim 96 is not supported \(32, 64 or 128\)"):
        call(build, q=torch.randn(B, T, HK, 96), k=torch.randn(B, T, HK, 96), v=torch.randn(B, T, HV, 96), state=None)
    with pytest.raises(ValueError, match="key head dim 128 differs from value head dim 64"):
        call(build, q=torch.randn(B, T, HK, 128), k=torch.randn(B, T, HK, 128), state=None)


def test_dtype_mismatch(build):
    with pytest.raises(TypeError, match="q, k and v must share one dtype, got q BFloat16, k Float, v Float"):
        call(build, q=torch.randn(B, T, HK, D).bfloat16())
    with pytest.raises(TypeError, match="q must have dtype Float, BFloat16, Half; got Long"):
        call(build, q=torch.ones(B, T, HK, D, dtype=torch.long))


def test_bad_state(build):
    with pytest.raises(TypeError, match="state must have dtype Float; got BFloat16"):
        call(build, state=torch.zeros(B, HV, D, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"state must be \(batch, value heads, key dim, value dim\) = \[1, 4, 64, 64\], got \[1, 2, 64, 64\]"):
        call(build, state=torch.zeros(B, HK, D, D))
    with pytest.raises(ValueError, match="state must be"):
        call(build, state=torch.zeros(B, HV, D * D))


def test_bad_shapes(build):
    with pytest.raises(ValueError, match=r"k must have q's shape"):
        call(build, k=torch.randn(B, T, HK + 1, D))
    with pytest.raises(ValueError, match=r"q \(batch, tokens, key heads, head dim\) must be 4-D"):
        call(build, q=torch.randn(T, HK, D))
    with pytest.raises(ValueError, match=r"must agree on batch and tokens"):
        call(build, v=torch.randn(B, T + 1, HV, D))
    with pytest.raises(ValueError, match=r"g must be \(batch, tokens, value heads\) = \[1, 3, 4\], got \[1, 3, 2\]"):
        call(build, g=torch.rand(B, T, HK))
    with pytest.raises(ValueError, match=r"beta must be"):
        call(build, beta=torch.rand(B, T))


def test_not_cpu(build):
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        call(build, q=torch.randn(B, T, HK, D, device="meta"))


def test_conv_bad_input(build):
    x, w = torch.randn(1, 8, 5), torch.randn(8, 1, 4)
    with pytest.raises(ValueError, match=r"weight has 6 channels but x"):
        build.causal_conv1d(x, torch.randn(6, 1, 4))
    with pytest.raises(ValueError, match=r"weight must be \(channels, 1, kernel\) or \(channels, kernel\)"):
        build.causal_conv1d(x, torch.randn(8, 2, 4))
    with pytest.raises(ValueError, match=r"state must be \(batch, channels, >= kernel - 1\) = \[1, 8, 3\]"):
        build.causal_conv1d(x, w, torch.randn(1, 8, 2))
    with pytest.raises(ValueError, match="state must be"):
        build.causal_conv1d(x, w, torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match="activation must be None, 'silu' or 'swish', got 'gelu'"):
        build.causal_conv1d(x, w, None, "gelu")
    with pytest.raises(ValueError, match=r"x \(batch, channels, tokens\) must be 3-D"):
        build.causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match=r"bias must be \(channels,\)"):
        build.causal_conv1d(x, w, bias=torch.randn(3))
    with pytest.raises(ValueError, match=r"the kernel size must be 1 to 64, got weight shape \[8, 1, 65\]"):
        build.causal_conv1d(x, torch.randn(8, 1, 65))


def test_small_ops_bad_input(build):
    with pytest.raises(ValueError, match=r"a must be \(\.\.\., 4\)"):
        build.gates(torch.randn(4), torch.randn(2, 3), torch.randn(4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="b must have a's shape"):
        build.gates(torch.randn(4), torch.randn(2, 4), torch.randn(4), torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"weight must be \(16,\)"):
        build.gated_rms_norm(torch.randn(2, 16), torch.randn(2, 16), torch.ones(8))
    with pytest.raises(ValueError, match="gate must have x's shape"):
        build.gated_rms_norm(torch.randn(2, 16), torch.randn(2, 8), torch.ones(16))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        build.l2_norm(torch.randn(2, 16), -1.0)


FLOAT32_RANGE = r", within float32's range \(magnitude at most 3.40282e\+38: ggml computes in float32\), got "


@pytest.mark.parametrize("scale", [1e300, -1e300, 3.5e38])
def test_scale_beyond_float32_is_refused(build, scale):
    """ggml computes in float32: a finite double beyond its range (1e300) became inf there and the
    output all NaN; it is a ValueError, in place or not."""
    a = inputs()
    with pytest.raises(ValueError, match="scale must be finite" + FLOAT32_RANGE):
        build.gated_delta_net(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], scale=scale)
    state = a["state"].transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match="scale must be finite" + FLOAT32_RANGE):
        build.gated_delta_net_(a["q"], a["k"], a["v"], a["g"], a["beta"], state, l2_normalize_qk=True, scale=scale)
    out, _ = build.gated_delta_net(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], scale=1e-3)
    assert torch.isfinite(out).all()


def test_eps_beyond_float32_is_refused(build):
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="eps must be finite and >= 0" + FLOAT32_RANGE + "1e\\+300"):
        build.l2_norm(x, 1e300)
    with pytest.raises(ValueError, match="eps must be finite and >= 0" + FLOAT32_RANGE):
        build.gated_rms_norm(x, x, torch.ones(16), eps=1e300)


# ---- the layer: a cache that cannot belong to it ----


def _config(**kw):
    base = dict(hidden_size=128, num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=32, linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                intermediate_size=128, vocab_size=64, layer_types=["linear_attention", "linear_attention", "full_attention"])
    base.update(kw)
    return Qwen3_5TextConfig(**base)


def _layer(gdn, config, layer_idx):
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    from tools.testing.kernel_testing import variant_dir

    module = Qwen3_5GatedDeltaNet(config, layer_idx=layer_idx).eval()
    repo = LocalLayerRepository(repo_path=variant_dir("ggml-gated-delta-net"), layer_name="Qwen3_5GatedDeltaNet")
    with use_kernel_mapping({"Qwen3_5GatedDeltaNet": {"cpu": repo}}):
        kernelize(module, device="cpu", mode=Mode.INFERENCE)
    return module


@torch.no_grad()
def test_cache_from_another_layer(build):
    config = _config()
    module = _layer(build, config, layer_idx=2)  # layer 2 of this cache is a full-attention layer
    with pytest.raises(ValueError, match="cache layer 2 is a .*, not a linear-attention cache layer: layer_idx=2 does not match"):
        module(torch.randn(1, 3, 128), cache_params=DynamicCache(config=config))
    module = _layer(build, _config(layer_types=["linear_attention"] * 3), layer_idx=2)
    one_layer = _config(num_hidden_layers=1, layer_types=["linear_attention"])
    with pytest.raises(ValueError, match="cache_params has 1 layers but this linear-attention layer has layer_idx=2"):
        module(torch.randn(1, 3, 128), cache_params=DynamicCache(config=one_layer))


@torch.no_grad()
def test_cache_from_another_model(build):
    small, other = _config(), _config(linear_num_value_heads=2)
    cache = DynamicCache(config=other)
    _layer(build, other, 0)(torch.randn(1, 3, 128), cache_params=cache)  # fills layer 0 for the other model
    with pytest.raises(ValueError, match=r"cache layer 0 holds a conv state of shape \(1, 192, 4\), but layer_idx=0 needs \(batch, 256, 4\)"):
        _layer(build, small, 0)(torch.randn(1, 1, 128), cache_params=cache)


@torch.no_grad()
def test_cache_for_another_batch(build):
    config = _config()
    module = _layer(build, config, 0)
    cache = DynamicCache(config=config)
    module(torch.randn(2, 3, 128), cache_params=cache)
    with pytest.raises(ValueError, match="holds a conv state for batch size 2, but hidden_states has batch size 1"):
        module(torch.randn(1, 1, 128), cache_params=cache)


# ---- in-place ops: a state that inputs share memory with, or one made with expand ----


def test_causal_conv1d_inplace_refuses_inputs_overlapping_the_state(build):
    """x read from the state the op rolls would be read after it moved (torch's in-place ops refuse
    such an overlap); an expanded state would have every batch entry written to one place."""
    state = torch.randn(1, 8, 4)
    w = torch.randn(8, 1, 4)
    before = state.clone()
    with pytest.raises(RuntimeError, match="x shares memory with state"):
        build.causal_conv1d_(state[:, :, 3:], w, state)
    with pytest.raises(RuntimeError, match="weight shares memory with state"):
        build.causal_conv1d_(torch.randn(1, 8, 1), state[0, :, :].view(8, 1, 4), state)
    with pytest.raises(RuntimeError, match="bias shares memory with state"):
        build.causal_conv1d_(torch.randn(1, 8, 1), w, state, bias=state[0, :, 0])
    assert torch.equal(state, before)
    with pytest.raises(RuntimeError, match="state is written in place but several of its elements share one memory location"):
        build.causal_conv1d_(torch.randn(2, 8, 1), w, torch.zeros(1, 8, 4).expand(2, 8, 4))
    y = build.causal_conv1d_(state[:, :, 3:].clone(), w, state)  # a copy is apart: fine
    assert y.shape == (1, 8, 1)


def test_gated_delta_net_inplace_refuses_inputs_overlapping_the_state(build):
    a = inputs(state=torch.zeros(B, HV, D, D).transpose(2, 3))  # ggml's layout, as the in-place op needs
    flat = a["state"].transpose(2, 3).reshape(-1)
    for name, view in (("q", flat[: B * T * HK * D].view(B, T, HK, D)), ("beta", flat[: B * T * HV].view(B, T, HV))):
        b = dict(a, **{name: view})
        with pytest.raises(RuntimeError, match=f"{name} shares memory with state"):
            build.gated_delta_net_(b["q"], b["k"], b["v"], b["g"], b["beta"], b["state"])


# ---- the fake (meta) implementations refuse what the CPU op refuses, with the same words ----


GDN_REFUSED = {  # overrides of inputs(): q, k (1, 3, 2, 64), v (1, 3, 4, 64), g, beta (1, 3, 4), state (1, 4, 64, 64)
    "int q": dict(q=torch.ones(B, T, HK, D, dtype=torch.long)),
    "mixed dtypes": dict(k=torch.randn(B, T, HK, D).bfloat16()),
    "3-D q": dict(q=torch.randn(T, HK, D), k=torch.randn(T, HK, D)),
    "3-D v": dict(v=torch.randn(T, HV, D)),
    "k shape": dict(k=torch.randn(B, T, HK + 1, D)),
    "tokens": dict(v=torch.randn(B, T + 1, HV, D)),
    "value head dim": dict(q=torch.randn(B, T, HK, 128), k=torch.randn(B, T, HK, 128)),
    "head dim 96": dict(q=torch.randn(B, T, HK, 96), k=torch.randn(B, T, HK, 96), v=torch.randn(B, T, HV, 96),
                        state=None),
    "heads not a multiple": dict(v=torch.randn(B, T, 3, D), g=torch.rand(B, T, 3), beta=torch.rand(B, T, 3), state=None),
    "no key heads": dict(q=torch.randn(B, T, 0, D), k=torch.randn(B, T, 0, D)),
    "g heads": dict(g=torch.rand(B, T, HK)),
    "2-D beta": dict(beta=torch.rand(B, T)),
    "int g": dict(g=torch.ones(B, T, HV, dtype=torch.int32)),
    "bf16 state": dict(state=torch.zeros(B, HV, D, D, dtype=torch.bfloat16)),
    "state heads": dict(state=torch.zeros(B, HK, D, D)),
    "3-D state": dict(state=torch.zeros(B, HV, D * D)),
    "infinite scale": dict(scale=float("inf")),
    "NaN scale": dict(scale=float("nan")),
    "scale 1e300 (float32: inf)": dict(scale=1e300),
}


@pytest.mark.parametrize("case", GDN_REFUSED)
def test_fake_gated_delta_net_refuses_as_the_cpu_op(build, case):
    a = dict(inputs(), l2_normalize_qk=True, scale=None)
    a.update(GDN_REFUSED[case])
    assert_fake_refuses_as_cpu(build.ops.gated_delta_net, *a.values())
    if a["state"] is not None:  # the in-place op, on a state in ggml's layout
        a["state"] = a["state"].transpose(-1, -2).contiguous().transpose(-1, -2) if a["state"].dim() == 4 else a["state"]
        assert_fake_refuses_as_cpu(build.ops.gated_delta_net_, *a.values())


def test_fake_gated_delta_net_inplace_needs_ggml_layout(build):
    a = dict(inputs(), l2_normalize_qk=True, scale=None)  # a contiguous (transformers') state
    assert_fake_refuses_as_cpu(build.ops.gated_delta_net_, *a.values())


CONV_REFUSED = {  # overrides of a good call: x (1, 8, 5), weight (8, 1, 4), state (1, 8, 4)
    "channels": dict(weight=torch.randn(6, 1, 4)),
    "weight (C, 2, K)": dict(weight=torch.randn(8, 2, 4)),
    "1-D weight": dict(weight=torch.randn(8)),
    "empty kernel": dict(weight=torch.randn(8, 0), state=None),
    "kernel too long": dict(weight=torch.randn(8, 65), state=None),
    "narrow state": dict(state=torch.randn(1, 8, 2)),
    "state batch": dict(state=torch.randn(2, 8, 4)),
    "activation": dict(activation="gelu"),
    "2-D x": dict(x=torch.randn(8, 5)),
    "int x": dict(x=torch.ones(1, 8, 5, dtype=torch.int32)),
    "bias": dict(bias=torch.randn(3)),
    "int state": dict(state=torch.ones(1, 8, 4, dtype=torch.int64)),
}


@pytest.mark.parametrize("case", CONV_REFUSED)
def test_fake_causal_conv1d_refuses_as_the_cpu_op(build, case):
    a = dict(x=torch.randn(1, 8, 5), weight=torch.randn(8, 1, 4), state=torch.randn(1, 8, 4), bias=None, activation="silu")
    a.update(CONV_REFUSED[case])
    assert_fake_refuses_as_cpu(build.ops.causal_conv1d, *a.values())
    if a["state"] is not None:
        assert_fake_refuses_as_cpu(build.ops.causal_conv1d_, *a.values())


def test_fake_causal_conv1d_inplace_state_dtype(build):
    x, w = torch.randn(1, 8, 1, dtype=torch.bfloat16), torch.randn(8, 1, 4)
    assert_fake_refuses_as_cpu(build.ops.causal_conv1d_, x, w, torch.zeros(1, 8, 4, dtype=torch.float16), None, "silu")


SMALL_OPS_REFUSED = {
    "gates: 2-D A_log": ("gates", torch.randn(2, 4), torch.randn(2, 4), torch.randn(4), torch.randn(2, 4)),
    "gates: dt_bias": ("gates", torch.randn(4), torch.randn(2, 4), torch.randn(3), torch.randn(2, 4)),
    "gates: a heads": ("gates", torch.randn(4), torch.randn(2, 3), torch.randn(4), torch.randn(2, 3)),
    "gates: b shape": ("gates", torch.randn(4), torch.randn(2, 4), torch.randn(4), torch.randn(3, 4)),
    "gates: int b": ("gates", torch.randn(4), torch.randn(2, 4), torch.randn(4), torch.ones(2, 4, dtype=torch.long)),
    "gated_rms_norm: weight": ("gated_rms_norm", torch.randn(2, 16), torch.randn(2, 16), torch.ones(8), 1e-6),
    "gated_rms_norm: gate": ("gated_rms_norm", torch.randn(2, 16), torch.randn(2, 8), torch.ones(16), 1e-6),
    "gated_rms_norm: empty rows": ("gated_rms_norm", torch.randn(2, 0), torch.randn(2, 0), torch.ones(0), 1e-6),
    "gated_rms_norm: eps": ("gated_rms_norm", torch.randn(2, 16), torch.randn(2, 16), torch.ones(16), -1.0),
    "l2_norm: eps": ("l2_norm", torch.randn(2, 16), -1.0),
    "l2_norm: NaN eps": ("l2_norm", torch.randn(2, 16), float("nan")),
    "l2_norm: eps 1e300": ("l2_norm", torch.randn(2, 16), 1e300),
    "gated_rms_norm: eps 1e300": ("gated_rms_norm", torch.randn(2, 16), torch.randn(2, 16), torch.ones(16), 1e300),
    "l2_norm: scalar": ("l2_norm", torch.tensor(1.0), 1e-6),
    "l2_norm: int": ("l2_norm", torch.ones(2, 16, dtype=torch.int32), 1e-6),
}


@pytest.mark.parametrize("case", SMALL_OPS_REFUSED)
def test_fake_small_ops_refuse_as_the_cpu_op(build, case):
    op, *args = SMALL_OPS_REFUSED[case]
    assert_fake_refuses_as_cpu(getattr(build.ops, op), *args)


def test_fake_accepts_what_the_cpu_op_accepts(build):
    a = {name: on_meta(x) for name, x in inputs().items()}
    out, state = build.gated_delta_net(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], scale=0.3)
    build.gated_delta_net_(a["q"], a["k"], a["v"], a["g"], a["beta"], state, scale=0.3)
    x, w = on_meta(torch.randn(1, 8, 5)), on_meta(torch.randn(8, 4))
    build.causal_conv1d(x, w, on_meta(torch.randn(1, 8, 3)), bias=on_meta(torch.randn(8)), activation=None)
    build.causal_conv1d_(x, w, on_meta(torch.randn(1, 8, 9)), activation="swish")
    build.gates(on_meta(torch.randn(4)), on_meta(torch.randn(2, 3, 4)), on_meta(torch.randn(4)), on_meta(torch.randn(2, 3, 4)))
    build.gated_rms_norm(x, x, on_meta(torch.ones(5)))
    assert build.l2_norm(x).is_meta

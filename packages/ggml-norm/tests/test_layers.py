"""The layers against transformers' own modules: each module is kernelized through kernels'
`kernelize(..., device="cpu", mode=Mode.INFERENCE)` with a mapping to this package's build
(LocalLayerRepository), then compared with an untouched copy, and the swap is checked twice: the
module's forward is our layer's, and running it calls our op (torch profiler).

Tolerances (see test_ops.py for the derivations): transformers computes the same float32 formula
with torch's reductions, so float32 outputs agree to a few ulps (gated: ggml's silu, a few more);
bf16/f16 outputs are equal or one ulp apart, and where the module rounds an intermediate (Llama's
`weight * y.to(x.dtype)`, the gated norm) one flipped intermediate rounding moves the result by up
to 2 ulps of that dtype, relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

from tools.testing.kernel_testing import variant_dir

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
ULPS = {torch.float32: 4, torch.bfloat16: 1, torch.float16: 1}
GATED_ULPS = {torch.float32: 8, torch.bfloat16: 1, torch.float16: 1}
FLIP_RTOL = {torch.float32: 0.0, torch.bfloat16: 2 * 2.0**-7, torch.float16: 2 * 2.0**-10}


def mapping(*layer_names: str) -> dict:
    return {
        name: {"cpu": LocalLayerRepository(repo_path=variant_dir("ggml-norm"), layer_name=name)} for name in layer_names
    }


def kernelized(module: torch.nn.Module, *layer_names: str) -> torch.nn.Module:
    swapped = copy.deepcopy(module)
    with use_kernel_mapping(mapping(*layer_names), inherit_mapping=False):
        kernelize(swapped, device="cpu", mode=Mode.INFERENCE)
    return swapped


def our_op_calls(fn, op: str) -> int:
    """How many times running fn calls ggml-norm's `op` (any build of it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("_ggml_norm_cpu_") and e.key.endswith(f"::{op}"))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def inputs(shape, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype)


SHAPES = [(1, 1), (3, 5), (2, 7, 11)]


# ---------------------------------------------------------------------------------------------
# Qwen3.5's zero-centred RMSNorm -> RMSNormZeroCentered


@pytest.mark.parametrize("lead", SHAPES, ids=str)
@pytest.mark.parametrize("hidden", [7, 1000, 2560])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_qwen3_5_rmsnorm(assert_ulps, dtype, hidden, lead):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    assert Qwen3_5RMSNorm.kernel_layer_name == "RMSNormZeroCentered"
    ref = Qwen3_5RMSNorm(hidden, eps=1e-6).to(dtype)
    randomize(ref)
    ours = kernelized(ref, "RMSNormZeroCentered")
    assert ours.forward.__func__.__qualname__ == "RMSNormZeroCentered.forward"
    assert ref.forward.__func__ is Qwen3_5RMSNorm.forward
    x = inputs((*lead, hidden), dtype)
    with torch.no_grad():
        want, got = ref(x), ours(x)
        assert our_op_calls(lambda: ours(x), "rms_norm") == 1
    assert got.dtype == want.dtype == dtype
    assert_ulps(got, want, ULPS[dtype])


def test_qwen3_5_rmsnorm_eps_and_weight_dtype(assert_ulps):
    """The layer reads the module's own eps; a float32 weight with bf16 activations (a model whose
    norms were kept in float32) still returns x's dtype, like the original."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    ref = Qwen3_5RMSNorm(256, eps=0.5)
    randomize(ref)
    ours = kernelized(ref, "RMSNormZeroCentered")
    x = inputs((4, 256), torch.bfloat16, seed=2) * 0.1
    with torch.no_grad():
        assert_ulps(ours(x), ref(x), ULPS[torch.bfloat16])


# ---------------------------------------------------------------------------------------------
# Qwen3.5's gated RMSNorm (inside Qwen3_5GatedDeltaNet) -> RMSNormGated


@pytest.mark.parametrize("w_dtype", [None, torch.float32], ids=["w_same", "w_f32"])
@pytest.mark.parametrize("lead", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
def test_qwen3_5_rmsnorm_gated(assert_ulps, dtype, lead, w_dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    assert Qwen3_5RMSNormGated.kernel_layer_name == "RMSNormGated"
    ref = Qwen3_5RMSNormGated(128, eps=1e-6).to(w_dtype or dtype)
    randomize(ref)
    ours = kernelized(ref, "RMSNormGated")
    assert ours.forward.__func__.__qualname__ == "RMSNormGated.forward"
    x, z = inputs((*lead, 128), dtype), inputs((*lead, 128), dtype, seed=3)
    with torch.no_grad():
        want, got = ref(x, z), ours(x, z)
        assert our_op_calls(lambda: ours(x, z), "rms_norm_gated") == 1
    assert got.dtype == want.dtype == dtype
    assert_ulps(got, want, GATED_ULPS[dtype], rtol=FLIP_RTOL[dtype])


def test_gated_layer_refuses_other_activations():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    ref = Qwen3_5RMSNormGated(16)
    ref.activation = "sigmoid"
    ours = kernelized(ref, "RMSNormGated")
    with pytest.raises(NotImplementedError, match="silu gate only"):
        ours(torch.randn(2, 16), torch.randn(2, 16))


# ---------------------------------------------------------------------------------------------
# Llama / Qwen3 RMSNorm -> RMSNorm


@pytest.mark.parametrize("w_dtype", [None, torch.float32], ids=["w_same", "w_f32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("cls_path", ["llama.modeling_llama.LlamaRMSNorm", "qwen3.modeling_qwen3.Qwen3RMSNorm"])
def test_llama_qwen3_rmsnorm(assert_ulps, cls_path, dtype, w_dtype):
    import importlib

    mod, cls_name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.models.{mod}"), cls_name)
    assert cls.kernel_layer_name == "RMSNorm"
    ref = cls(1000, eps=1e-5).to(w_dtype or dtype)
    randomize(ref)
    ours = kernelized(ref, "RMSNorm")
    assert ours.forward.__func__.__qualname__ == "RMSNorm.forward"
    x = inputs((3, 5, 1000), dtype)
    with torch.no_grad():
        want, got = ref(x), ours(x)
        assert our_op_calls(lambda: ours(x), "rms_norm") == 1
    assert got.dtype == want.dtype  # promote(weight, x): float32 for a float32 weight
    assert_ulps(got, want, ULPS[got.dtype], rtol=FLIP_RTOL[dtype])


# ---------------------------------------------------------------------------------------------
# a whole (tiny) Qwen3.5 model


def tiny_qwen3_5(dtype):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    config = Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    randomize(model)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DT_IDS.get)
def test_tiny_qwen3_5_model(dtype):
    """Every norm of a Qwen3.5 text model swapped at once: 2 layers x 2 + the final norm + the
    attention's q/k norms are zero-centred, the linear-attention layer has one gated norm."""
    model = tiny_qwen3_5(dtype)
    ours = kernelized(model, "RMSNormZeroCentered", "RMSNormGated")
    names = {type(m).__name__ for m in ours.modules() if getattr(m.forward, "__func__", None) is not None
             and m.forward.__func__.__qualname__ in {"RMSNormZeroCentered.forward", "RMSNormGated.forward"}}
    assert names == {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"}
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 127]])
    with torch.no_grad():
        want = model(ids).logits
        got = ours(ids).logits
        assert our_op_calls(lambda: ours(ids), "rms_norm") == 7
        assert our_op_calls(lambda: ours(ids), "rms_norm_gated") == 1
    # float32: a few ulps per norm, carried through 2 layers (measured 7e-7 of the largest logit);
    # bf16: one flipped rounding in a norm moves a hidden value by up to 2^-7 relative, which later
    # layers mix into the logits: allow 2 bf16 ulps of the largest logit (measured: identical).
    rtol = {torch.float32: 5e-6, torch.bfloat16: 2.0**-6}[dtype]
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= rtol * scale


@pytest.mark.parametrize("cls_path, layer", [
    ("qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm", "RMSNormZeroCentered"),
    ("llama.modeling_llama.LlamaRMSNorm", "RMSNorm"),
    ("qwen3_5.modeling_qwen3_5.Qwen3_5RMSNormGated", "RMSNormGated"),
])
def test_torch_compile_kernelized_module(cls_path, layer):
    """A kernelized module traces in one graph (can_torch_compile = True)."""
    import importlib

    mod, cls_name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.models.{mod}"), cls_name)
    torch._dynamo.reset()
    ref = cls(64)
    randomize(ref)
    ours = kernelized(ref, layer)
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    args = [inputs((2, 64), torch.bfloat16)] + ([inputs((2, 64), torch.bfloat16, seed=5)] if layer == "RMSNormGated" else [])
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), ours(*args), rtol=0, atol=0)
        torch.testing.assert_close(compiled(*args), ref(*args), rtol=2**-7, atol=1e-6)


def test_layers_follow_kernels_rules(gn):
    """No constructor, no members beyond forward and the two flags, inference-only."""
    for name in gn.layers.__all__:
        cls = getattr(gn.layers, name)
        assert cls.__init__ is torch.nn.Module.__init__
        assert cls.has_backward is False and cls.can_torch_compile is True

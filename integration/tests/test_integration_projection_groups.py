"""A layer's sibling projections in one kernel call (`ggml_kernels_integration.projection_groups`):
each sibling gets exactly what transformers' own `GgufLinear.forward` computes for its input, the
shared call happens only for the layers and inputs it is made for, and anything else falls back to
the module's own forward."""

from __future__ import annotations

import pytest
import torch
from ggml_kernels_integration import projection_groups
from ggml_kernels_integration.patching import PatchSet
from torch import nn

from tools.testing.kernel_testing import load_kernel

K = 256
OWN_FORWARD: dict = {}  # transformers' GgufLinear.forward, as the fixture found it


@pytest.fixture(scope="module")
def quant():
    """The kernel package, with GgufLinear.forward patched as enable() patches it; transformers' own
    forward is put back afterwards."""
    from transformers.integrations.gguf import kernels as gguf_kernels
    from transformers.integrations.gguf.utils import GgufLinear

    resolved_before = gguf_kernels._gguf_kernel
    quant = load_kernel("ggml-org/ggml-quantization")
    gguf_kernels._gguf_kernel = gguf_kernels.GgufKernel(quant)  # what transformers' own forward calls
    patches = PatchSet()
    OWN_FORWARD["forward"] = GgufLinear.forward
    projection_groups.patch_forward(patches, quant)
    assert GgufLinear.forward is not OWN_FORWARD["forward"]
    yield quant
    gguf_kernels._gguf_kernel = resolved_before
    patches.restore()


def own_forward(module, x):
    """transformers' GgufLinear.forward, which never looks at a group."""
    return OWN_FORWARD["forward"](module, x)


# A prompt's product against transformers' own (the weight dequantized, a float32 matmul): ggml's
# path rounds the activations to 8 bits per block (~0.4 % of a block's largest value each), the
# dense path rounds x, W and the product to bfloat16 (2^-9 each); both sum K = 256 such terms.
FLOAT_PRODUCT_RTOL = 2e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error over the largest magnitude of `want`."""
    return ((got - want).abs().max() / want.abs().max()).item()


def linear(quant, out_features, ggml_type="Q4_K", seed=0, bias=False):
    from transformers.integrations.gguf.utils import GgufLinear

    t = quant.type_id(ggml_type)
    module = GgufLinear(K, out_features, t, bias=bias)
    w = torch.randn(out_features, K, generator=torch.Generator().manual_seed(seed))
    module.weight.data = quant.quantize(w, t)
    if bias:
        module.bias.data = torch.randn(out_features)
    return module


# Stand-ins named like the layer classes `SIBLINGS` lists (only the names and children matter).
class LlamaAttention(nn.Module):
    def __init__(self, quant, **kwargs):
        super().__init__()
        self.q_proj = linear(quant, 96, "Q4_K", 1, **kwargs)
        self.k_proj = linear(quant, 32, "Q4_K", 2)
        self.v_proj = linear(quant, 32, "Q6_K", 3)  # a Q4_K_M file keeps v in Q6_K


class LlamaMLP(nn.Module):
    def __init__(self, quant, **kwargs):
        super().__init__()
        self.gate_proj = linear(quant, 64, "Q4_K", 4)
        self.up_proj = linear(quant, 64, "Q4_K", 5, **kwargs)


class UnlistedAttention(LlamaAttention):
    pass


def our_calls(fn) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key.split("::")[1]: e.count for e in prof.key_averages() if e.key.startswith("_ggml_quantization")}


def test_install_groups_only_listed_layers_without_bias(quant):
    model = nn.ModuleList([LlamaAttention(quant), LlamaMLP(quant), UnlistedAttention(quant), LlamaMLP(quant, bias=True)])
    assert projection_groups.install(model, quant) == 2
    group = model[0].q_proj.__dict__[projection_groups.GROUP_ATTR]
    assert group.members == [model[0].q_proj, model[0].k_proj, model[0].v_proj]
    assert model[1].up_proj.__dict__[projection_groups.GROUP_ATTR].members == [model[1].gate_proj, model[1].up_proj]
    for module in (model[2].q_proj, model[3].gate_proj, model[3].up_proj):
        assert projection_groups.GROUP_ATTR not in module.__dict__
    # a plain attribute: not a submodule, not in the state dict
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    assert all("group" not in n for n, _ in model.named_modules())


@pytest.mark.parametrize("inference", [True, False])
def test_siblings_get_their_own_outputs_from_one_call(quant, inference):
    attn = LlamaAttention(quant)
    projection_groups.install(attn, quant)
    x = torch.randn(1, 1, K)
    with torch.inference_mode(inference), torch.no_grad():
        want = [own_forward(m, x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        got = []
        calls = our_calls(lambda: got.extend([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]))
    assert calls == {"mul_mat_group": 1}
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (1, 1, w.shape[-1])
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same ggml dot products


def test_any_member_first_and_a_repeated_call(quant):
    mlp = LlamaMLP(quant)
    projection_groups.install(mlp, quant)
    x = torch.randn(1, K)
    with torch.inference_mode():
        up, gate = mlp.up_proj(x), mlp.gate_proj(x)  # called in the other order
        again = mlp.gate_proj(x)  # a second call of the same member computes again
    torch.testing.assert_close(up, own_forward(mlp.up_proj, x), rtol=0, atol=0)
    torch.testing.assert_close(gate, own_forward(mlp.gate_proj, x), rtol=0, atol=0)
    torch.testing.assert_close(again, gate, rtol=0, atol=0)


def test_another_input_is_computed_not_taken_from_the_group(quant):
    attn = LlamaAttention(quant)
    projection_groups.install(attn, quant)
    x1, x2 = torch.randn(1, 1, K), torch.randn(1, 1, K)
    with torch.inference_mode():
        attn.q_proj(x1)
        k2 = attn.k_proj(x2)  # kept k(x1) must not be returned
        v1 = attn.v_proj(x1)  # the group was dropped by the call above: computed again, correctly
        k_same_values = attn.k_proj(x1.clone())  # equal values, another tensor: computed
    torch.testing.assert_close(k2, own_forward(attn.k_proj, x2), rtol=0, atol=0)
    assert not torch.equal(k2, own_forward(attn.k_proj, x1))
    torch.testing.assert_close(v1, own_forward(attn.v_proj, x1), rtol=0, atol=0)
    torch.testing.assert_close(k_same_values, own_forward(attn.k_proj, x1), rtol=0, atol=0)


def test_in_place_change_between_siblings_is_seen(quant):
    """Tensors outside inference mode carry a version counter: an in-place change after the first
    sibling's call makes the next one compute on the changed values."""
    mlp = LlamaMLP(quant)
    projection_groups.install(mlp, quant)
    x = torch.randn(1, K)
    with torch.no_grad():
        mlp.gate_proj(x)
        x.mul_(3.0)
        up = mlp.up_proj(x)
    torch.testing.assert_close(up, own_forward(mlp.up_proj, x), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [16, 129])
def test_prefill_rows_are_grouped_as_mul_mat_computes_them(quant, rows):
    """A prompt's rows share one call too (ggml-quantization's mul_mat_group: its K-quant weights'
    rows split over the threads together up to 128 rows, one product per weight above): each sibling
    gets what the package's mul_mat gives it alone, where transformers' own forward would dequantize
    the weight for a float matmul (enable() routes that to mul_mat too)."""
    attn = LlamaAttention(quant)
    projection_groups.install(attn, quant)
    x = torch.randn(1, rows, K)
    with torch.inference_mode():
        got = []
        calls = our_calls(lambda: got.extend([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]))
    assert calls.get("mul_mat_group") == 1
    for g, m in zip(got, (attn.q_proj, attn.k_proj, attn.v_proj), strict=True):
        assert g.shape == (1, rows, m.out_features)
        torch.testing.assert_close(g, quant.mul_mat(m.weight, x, m.ggml_type, m.out_features), rtol=0, atol=0)
        assert relative_error(g, own_forward(m, x)) < FLOAT_PRODUCT_RTOL


def test_prefill_group_takes_the_dense_path_where_mul_mat_would(quant):
    """Block-32 siblings at a prompt's rows: each output is the package's mul_mat of that weight, its
    dense path included (where this CPU has one); with `dense_prefill.set_enabled(False)` ggml's exact
    path, as `enable(dense_prefill=False)` asks."""
    from ggml_kernels_integration import dense_prefill

    class LlamaMLP(nn.Module):  # named like the layer class SIBLINGS lists
        def __init__(self):
            super().__init__()
            self.gate_proj = linear(quant, 64, "Q4_1", 11)
            self.up_proj = linear(quant, 64, "Q4_K", 12)

    mlp = LlamaMLP()
    projection_groups.install(mlp, quant)
    x = torch.randn(1, 64, K)
    try:
        for exact in (False, True):
            dense_prefill.set_enabled(not exact)
            with torch.inference_mode():
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            for g, m in ((gate, mlp.gate_proj), (up, mlp.up_proj)):
                want = quant.mul_mat(m.weight, x, m.ggml_type, m.out_features, exact=exact)
                torch.testing.assert_close(g, want, rtol=0, atol=0)
                assert relative_error(g, own_forward(m, x)) < FLOAT_PRODUCT_RTOL
    finally:
        dense_prefill.set_enabled(True)


def test_a_batch_of_decode_rows_is_grouped(quant):
    """Up to MAX_GEMV_ROWS rows (a batched decode step) share one call too."""
    mlp = LlamaMLP(quant)
    projection_groups.install(mlp, quant)
    x = torch.randn(3, 1, K)
    with torch.inference_mode():
        got = []
        calls = our_calls(lambda: got.extend([mlp.gate_proj(x), mlp.up_proj(x)]))
    assert calls == {"mul_mat_group": 1}
    for g, m in zip(got, (mlp.gate_proj, mlp.up_proj), strict=True):
        torch.testing.assert_close(g, own_forward(m, x), rtol=0, atol=0)


def test_threads_keep_their_own_outputs(quant):
    """Outputs kept for one thread are not handed to, nor dropped by, another thread's calls."""
    import threading

    attn = LlamaAttention(quant)
    projection_groups.install(attn, quant)
    x1, x2 = torch.randn(1, 1, K), torch.randn(1, 1, K)
    got = {}

    def run(name, fn):
        def body():
            with torch.inference_mode():
                got[name] = fn()

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()

    with torch.inference_mode():
        attn.q_proj(x1)  # this thread now keeps k(x1) and v(x1)
    run("other", lambda: (attn.q_proj(x2), attn.k_proj(x2), attn.v_proj(x2)))
    with torch.inference_mode():
        calls = our_calls(lambda: got.update(k1=attn.k_proj(x1), v1=attn.v_proj(x1)))
    assert calls == {}  # both taken from what this thread kept
    torch.testing.assert_close(got["k1"], own_forward(attn.k_proj, x1), rtol=0, atol=0)
    torch.testing.assert_close(got["v1"], own_forward(attn.v_proj, x1), rtol=0, atol=0)
    for out, m in zip(got["other"], (attn.q_proj, attn.k_proj, attn.v_proj), strict=True):
        torch.testing.assert_close(out, own_forward(m, x2), rtol=0, atol=0)


def real_llama_mlp(quant, act="silu"):
    """transformers' own LlamaMLP with packed gate/up/down, as a GGUF load leaves it."""
    from transformers import LlamaConfig
    from transformers.integrations.gguf.utils import GgufLinear
    from transformers.models.llama.modeling_llama import LlamaMLP as HfLlamaMLP

    mlp = HfLlamaMLP(LlamaConfig(hidden_size=K, intermediate_size=2 * K, hidden_act=act))
    mlp.gate_proj, mlp.up_proj = linear(quant, 2 * K, "Q4_K", 6), linear(quant, 2 * K, "Q4_K", 7)
    mlp.down_proj = GgufLinear(2 * K, K, quant.type_id("Q6_K"), bias=False)
    w = torch.randn(K, 2 * K, generator=torch.Generator().manual_seed(8))
    mlp.down_proj.weight.data = quant.quantize(w, quant.type_id("Q6_K"))
    return mlp


def test_gated_mlp_runs_a_decode_step_in_two_calls_bit_for_bit(quant):
    """A SiLU-gated MLP of GATED_MLPS: its class's forward (patched through the patch set, undone
    by restore) takes the fused path for decode rows: one group call and one mat-vec, the output
    equal to the MLP's own forward; prefill rows and other activations take the MLP's own forward."""
    from transformers.models.llama.modeling_llama import LlamaMLP as HfLlamaMLP

    own_mlp_forward = HfLlamaMLP.forward
    mlp, gelu_mlp = real_llama_mlp(quant), real_llama_mlp(quant, act="gelu")
    patches = PatchSet()
    try:
        assert projection_groups.install(nn.ModuleList([mlp, gelu_mlp]), quant, patches) == 2
        assert HfLlamaMLP.forward is not own_mlp_forward
        assert projection_groups.MLP_ATTR in mlp.__dict__ and projection_groups.MLP_ATTR not in gelu_mlp.__dict__
        with torch.inference_mode():
            for rows in (1, 3):
                x = torch.randn(rows, 1, K)
                got = []
                calls = our_calls(lambda x=x, got=got: got.append(mlp(x)))
                assert calls == {"mul_mat_group": 1, "mul_mat_vec": 1}
                torch.testing.assert_close(got[0], own_mlp_forward(mlp, x), rtol=0, atol=0)
            x = torch.randn(1, 16, K)  # prefill rows: the MLP's own forward (gate/up still grouped)
            calls = our_calls(lambda: mlp(x))
            assert "mul_mat_vec" not in calls
            torch.testing.assert_close(mlp(x), own_mlp_forward(mlp, x), rtol=0, atol=0)
            assert "mul_mat_vec" in our_calls(lambda: gelu_mlp(torch.randn(1, 1, K)))
    finally:
        patches.restore()
    assert HfLlamaMLP.forward is own_mlp_forward


@pytest.mark.parametrize("shape", [(1, 1, K), (1, 4, K), (2, 3, K), (5, K)], ids=str)
def test_permuted_input_runs_the_op_directly(quant, shape):
    """A decode step or short prompt of an ungrouped linear with an input permutation (Qwen3.5's
    out_proj), with any leading dims: the permutation applied, then the kernel's mat-vec: what
    transformers' own forward computes."""
    module = linear(quant, 64, "Q4_K", 10)
    module.input_permutation = torch.randperm(K, generator=torch.Generator().manual_seed(11))
    x = torch.randn(*shape)
    with torch.inference_mode():
        got = []
        calls = our_calls(lambda: got.append(module(x)))
        torch.testing.assert_close(got[0], own_forward(module, x), rtol=0, atol=0)
    assert calls == {"mul_mat_vec": 1}

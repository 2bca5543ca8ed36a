"""Packed linears in ggml-cpu's repacked layout (`ggml_kernels_integration.repacking`,
`enable(repack_weights=...)`): which modules are repacked, what each choice repacks, that they compute what the plain ones do,
that state_dict / load_state_dict keep speaking GGUF bytes, and a whole model against itself unrepacked.

Tolerance: a repacked weight's products differ from the plain ones only in the float32 order of the
per-block sums (ggml-quantization's tests/test_repack.py): 1e-5 of the output scale per product. In a
whole model such a difference can flip the rounding of an 8-bit activation in the next layer (as
any change of summation order does, see packages/ggml-quantization/tests/test_ops.py), which moves
outputs by ~1/127 of an activation: logits are compared as distributions (mean KL < 1e-4, the same
top-1 at every position, the same greedy tokens), as integration/tests/test_integration.py compares backends."""

from __future__ import annotations

import json

import pytest
import torch
from ggml_kernels_integration import repacking
from torch import nn

from tools.testing.kernel_testing import fresh_result, load_kernel

K = 256


@pytest.fixture(scope="module")
def quant():
    """The kernel package, resolved as the kernel transformers' GgufLinear.forward calls (put back after)."""
    from transformers.integrations.gguf import kernels as gguf_kernels

    resolved_before = gguf_kernels._gguf_kernel
    quant = load_kernel("ggml-org/ggml-quantization")
    gguf_kernels._gguf_kernel = gguf_kernels.GgufKernel(quant)
    yield quant
    gguf_kernels._gguf_kernel = resolved_before


def linear(quant, out_features, ggml_type, seed):
    from transformers.integrations.gguf.utils import GgufLinear

    t = quant.type_id(ggml_type)
    module = GgufLinear(K, out_features, t)
    w = torch.randn(out_features, K, generator=torch.Generator().manual_seed(seed))
    module.weight.data = quant.quantize(w, t)
    return module


class Tiny(nn.Module):
    def __init__(self, quant):
        super().__init__()
        self.q4k = linear(quant, 64, "Q4_K", 1)
        self.q4_0 = linear(quant, 32, "Q4_0", 2)
        self.q6k = linear(quant, 64, "Q6_K", 3)  # no repacked layout
        self.rows12 = linear(quant, 12, "Q4_K", 4)  # not whole groups of 8 rows
        self.tied = linear(quant, 16, "Q4_K", 5)
        self.embed = nn.Module()
        self.embed.weight = self.tied.weight  # a tied embedding reads it with get_rows


def test_repacked_ids_are_the_packages(quant):
    assert repacking.is_repacked(quant, quant.repacked_type("Q4_K")) and not repacking.is_repacked(quant, 12)
    assert repacking.base_type(quant, quant.repacked_type("Q4_K")) == repacking.base_type(quant, 12) == 12


def test_small_weights_stay_plain(quant):
    """Below MIN_REPACK_BYTES (a 1024-column Q4_K weight of fewer than ~1800 rows) nothing is repacked."""
    model = Tiny(quant)
    assert repacking.install(model, quant) == 0
    big = nn.Module()
    big.proj = linear(quant, 8192, "Q4_K", 6)  # 8192 x 144 bytes = 1.1 MiB
    assert repacking.install(big, quant) == 1


def test_install_repacks_what_it_should_and_products_agree(quant, monkeypatch):
    monkeypatch.setattr(repacking, "MIN_REPACK_BYTES", 0)  # these weights are small
    model = Tiny(quant)
    xs = [torch.randn(m, K, generator=torch.Generator().manual_seed(m)) for m in (1, 4, 40)]
    names = ("q4k", "q4_0", "q6k", "rows12", "tied")

    def product(module, x):  # prefills reach ggml-quantization's mul_mat through enable()'s routing
        return quant.mul_mat(module.weight, x, module.ggml_type, module.out_features)

    before = {n: [product(getattr(model, n), x) for x in xs] for n in names}
    plain_state = {k: v.clone() for k, v in model.state_dict().items()}
    assert repacking.install(model, quant) == 2
    assert model.q4k.ggml_type == 12 + quant.REPACKED and model.q4_0.ggml_type == 2 + quant.REPACKED
    assert [model.q6k.ggml_type, model.rows12.ggml_type, model.tied.ggml_type] == [14, 12, 12]
    for n in names:
        for x, y in zip(xs, before[n], strict=True):
            out = product(getattr(model, n), x)
            if len(x) <= 8:
                assert torch.equal(getattr(model, n)(x), out)  # transformers' own forward, a mat-vec
            assert ((out - y).abs().max() / y.abs().max()).item() < 1e-5, n
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain_state.items())  # GGUF bytes, not the layout
    fresh = Tiny(quant)
    repacking.install(fresh, quant)
    fresh.load_state_dict(plain_state)  # GGUF bytes in, repacked on the way
    assert torch.equal(fresh.q4k.weight, model.q4k.weight)
    assert torch.equal(fresh.q4k(xs[1]), model.q4k(xs[1]))
    assert repacking.unpack_all(quant) == 4  # both models; what disable() does: transformers' own path again
    assert model.q4k.ggml_type == 12 and torch.equal(model.q4k.weight, plain_state["q4k.weight"])
    own = model.q4k(xs[2])  # transformers' dequantize-and-matmul: float activations, not 8-bit ones
    assert ((own - before["q4k"][2]).abs().max() / own.abs().max()).item() < 2e-2


def test_enable_s_choice_picks_the_types(quant, monkeypatch):
    """`enable(repack_weights=...)`: "auto" repacks the types ggml-quantization measured faster
    repacked on this CPU, True every type this CPU's ggml repacks, False none."""
    import ggml_kernels_integration as gk

    monkeypatch.setattr(repacking, "MIN_REPACK_BYTES", 0)
    monkeypatch.setattr(quant, "faster_repacked_types", lambda: frozenset({12}))
    assert repacking.chosen_types(quant, "auto") == {12}
    assert repacking.chosen_types(quant, True) == quant.repacked_types()
    assert repacking.chosen_types(quant, False) == frozenset()
    for option, repacked in (("auto", {"q4k"}), (True, {"q4k", "q4_0"}), (False, set())):
        monkeypatch.setitem(gk._options, "repack_weights", option)
        model = Tiny(quant)
        gk._repack_if_asked(model, quant)
        assert {n for n in ("q4k", "q4_0", "q6k") if repacking.is_repacked(quant, getattr(model, n).ggml_type)} == repacked
        assert repacking.count_in(model) == len(repacked)  # what summary() reports
        names = {"q4k": "Q4_K", "q4_0": "Q4_0"}
        assert repacking.by_type(model, quant) == {names[n]: 1 for n in repacked}  # what bench records
    repacking.unpack_all(quant)
    monkeypatch.delattr(quant, "faster_repacked_types")  # a build from before the rule: nothing
    assert repacking.chosen_types(quant, "auto") == frozenset()


CODE = """
import json
import torch
from transformers import AutoModelForCausalLM
from tools.models import make_gguf
from tools.testing.kernel_testing import load_kernel
import ggml_kernels_integration as gk

quant = load_kernel("ggml-org/ggml-quantization")
path = make_gguf.ensure("qwen35-tiny", "Q4_K_M")
gk.repacking.MIN_REPACK_BYTES = 0  # the tiny model's weights are all small
gk.enable(repack_weights=False)
plain = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
gk.enable(repack_weights=True)
packed = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
repacked = sum(1 for m in packed.modules() if gk.repacking.is_repacked(quant, getattr(m, "ggml_type", 0)))
ids = torch.tensor([[5, 17, 3, 99, 250, 7, 31, 64, 12, 8, 200, 1]])
res = {"repacked": repacked}
with torch.inference_mode():
    for n in (1, 4, 12):
        a, b = plain(ids[:, :n]).logits[0].double(), packed(ids[:, :n]).logits[0].double()
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        res[f"kl_{n}"] = (la.exp() * (la - lb)).sum(-1).mean().item()
        res[f"top1_{n}"] = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    # greedy tokens: equal until a near-tie, where the plain model's top-2 margin is within the
    # logits' largest difference (random tiny weights give flat distributions)
    outs = [m.generate(ids[:, :4], max_new_tokens=16, do_sample=False, output_logits=True,
                       return_dict_in_generate=True) for m in (plain, packed)]
    first = next((i for i, (a, b) in enumerate(zip(*(o.sequences[0, 4:] for o in outs))) if a != b), None)
    if first is not None:
        la, lb = outs[0].logits[first][0], outs[1].logits[first][0]
        top = la.topk(2).values
        res["diverged_at_near_tie"] = bool(top[0] - top[1] <= (la - lb).abs().max())
    res["same_tokens"] = first is None or res["diverged_at_near_tie"]
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    batch = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), ids[0, :4]]), ids[0, :7]])
    batch_logits = packed(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    alone = packed(ids[:, :4]).logits[0]
    lp, la = batch_logits[0, 3:].double().log_softmax(-1), alone.double().log_softmax(-1)
    res["pad_kl"] = (la.exp() * (la - lp)).sum(-1).mean().item()
    res["pad_top1"] = bool(torch.equal(lp.argmax(-1), la.argmax(-1)))
sd_plain, sd_packed = plain.state_dict(), packed.state_dict()
res["state_dict_equal"] = all(torch.equal(sd_plain[k], sd_packed[k]) for k in sd_plain)
print("RESULT" + json.dumps(res))
"""


@pytest.mark.slow
def test_whole_model_repacked_equals_plain():
    res = fresh_result(CODE)
    assert res["repacked"] > 0
    for n in (1, 4, 12):
        assert res[f"kl_{n}"] < 1e-4 and res[f"top1_{n}"], json.dumps(res)
    assert res["same_tokens"] and res["state_dict_equal"], res
    # A padded batch against the prompt alone: ggml's repacked gemm takes rows 4 at a time and its
    # gemv the rest, whose activation quantizers round near-ties apart, so a row's result depends on
    # how many rows share the call (as in llama.cpp); equal as distributions, not bit for bit.
    assert res["pad_kl"] < 1e-4 and res["pad_top1"], res

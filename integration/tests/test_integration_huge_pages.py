"""`enable(huge_pages=True)` (the default): a packed model's weights moved into one mapping on
transparent huge pages after its load (ggml-quantization's `huge_pages`). The moved model computes
bit for bit what the same file loaded with `huge_pages=False` computes (the same bytes, the same
ops), its state dict is the same, and a tied weight stays tied."""

from __future__ import annotations

import pytest

from tools.testing.kernel_testing import fresh_result

CODE = """
import json
import torch
from transformers import AutoModelForCausalLM
from tools.models import make_gguf
from tools.testing.kernel_testing import load_kernel
import ggml_kernels_integration as gk

quant = load_kernel("ggml-org/ggml-quantization")
path = make_gguf.ensure("qwen35-tiny", "Q4_K_M")
models = {}
for on in (False, True):
    gk.enable(huge_pages=on)
    models[on] = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
params = {on: gk.packed_parameters(m) for on, m in models.items()}
storages = {on: {p.untyped_storage().data_ptr() for p in ps} for on, ps in params.items()}
ids = torch.tensor([[5, 17, 3, 99, 250, 7, 31, 64]])
with torch.inference_mode():
    logits = {on: m(ids).logits for on, m in models.items()}
    tokens = {on: m.generate(ids[:, :3], max_new_tokens=8, do_sample=False)[0].tolist() for on, m in models.items()}
sd = {on: m.state_dict() for on, m in models.items()}
tied = models[True].config.get_text_config().tie_word_embeddings
res = {
    "available": quant.huge_pages.available(),
    "packed": len(params[True]),
    "storages_off": len(storages[False]),
    "storages_on": len(storages[True]),
    "tied": tied,
    "still_tied": (not tied) or models[True].lm_head.weight is models[True].get_input_embeddings().weight,
    "logits_equal": bool(torch.equal(logits[False], logits[True])),
    "tokens_equal": tokens[False] == tokens[True],
    "state_dict_equal": sd[False].keys() == sd[True].keys() and all(torch.equal(sd[False][k], sd[True][k]) for k in sd[False]),
}
print("RESULT" + json.dumps(res))
"""


@pytest.mark.slow
def test_weights_on_huge_pages_compute_the_same():
    res = fresh_result(CODE)
    assert res["packed"] > 1 and res["storages_off"] == res["packed"], res
    assert res["storages_on"] == (1 if res["available"] else res["packed"]), res
    assert res["still_tied"] and res["logits_equal"] and res["tokens_equal"] and res["state_dict_equal"], res

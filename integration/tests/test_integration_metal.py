"""transformers through the Metal path, end to end: `enable(backend="metal-emu")` runs the tiny
Qwen3.5 dense and MoE files (Q4_K_M mix, tools/models/make_gguf.py) and the real SmolLM2-135M Q4_1
with every kernel call on the emulated-Metal builds (upstream's Metal host code and kernels, run on
the CPU), against transformers alone (every weight dequantized to float32) and against the CPU
backend (`enable()`), each backend in its own fresh process.

What is expected, and why the bounds are what they are:
- Metal vs float32 transformers: upstream's Metal mat-vec kernels take float32 activations
  (no 8-bit rounding, unlike ggml-cpu) and its mat-mat kernels round both tiles to half
  (2^-11 relative per product), flash attention holds Q in half: all much finer than the CPU
  backend's 8-bit activations, so Metal must be at least as close to float32 as the CPU backend's
  bound (integration/tests/test_integration.py: mean KL 0.012 / 0.03 / 0.02 for dense / MoE / SmolLM2), and
  take the same top-1 at >= 90 % of positions.
- Metal vs the CPU backend: their gap is the CPU's 8-bit activation rounding, so the same bounds.
- 16 greedy tokens are generated on the Metal path (a cached decode: the vec flash-attention and
  mat-vec kernels), and each of its steps' logits agrees with an uncached forward over the same
  tokens: top-1 identical, within 2 % of the logits' range (the forward's mat-mat kernels round both
  tiles to half where the decode's mat-vecs sum float32 products, and a MoE router passes that on
  through its expert weights; measured 0.52 / 0.92 / 0.19 % for dense / MoE / SmolLM2).
- Every Metal kernel the model needs was dispatched (the test lists them per model), every package
  module reports the metal-emu backend, and no op ran on a CPU build (the profiler sees only the
  `_<package>_metal_emu_<hash>` namespaces of our ops).
- `enable(backend="mps-emu")`, the MPS device layer on its Linux twin (the fake Metal framework
  executes each dispatch on the same emulated device), gives the metal-emu backend's results bit
  for bit: the prompt's logits, the 16 greedy tokens and each decode step's logits, with the same
  Metal kernels dispatched the same number of threadgroups, and no op on another build.
"""

from __future__ import annotations

import json

import pytest

from tools.testing.kernel_testing import fresh_process

pytestmark = pytest.mark.slow  # whole models through the emulator, each in a fresh process

CODE = """
import hashlib, json, os
import numpy as np, torch
from tools.models import make_gguf, smollm2
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.gguf import kernels as gguf_kernels

path = smollm2.gguf_path() if CONFIG == "smollm2" else make_gguf.ensure(CONFIG, "Q4_K_M")
tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
ids = tok("The quick brown fox jumps over the lazy dog. Once upon a time")["input_ids"][:12]
x = torch.tensor([ids])
res = {}
if BACKEND is None:  # transformers alone
    os.environ.pop("LOCAL_KERNELS", None)
    gguf_kernels._gguf_kernel = False
else:
    import ggml_kernels_integration as gk
    gk.enable(backend=BACKEND)
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
with torch.inference_mode(), prof:
    res["logits"] = model(x).logits[0].tolist()
    if BACKEND is not None and gk.locate.BACKENDS[BACKEND].metal:
        gk.reset_metal_dispatches()
        out = model.generate(x, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
        res["gen"] = out.sequences[0, len(ids):].tolist()
        cached = torch.stack(out.logits, 1)[0]
        uncached = model(out.sequences).logits[0, len(ids) - 1 : -1]
        res["decode_logits_sha256"] = hashlib.sha256(cached.contiguous().numpy().tobytes()).hexdigest()
        res["cache_rel"] = ((cached - uncached).abs().max() / uncached.abs().max()).item()
        res["cache_top1"] = bool(torch.equal(cached.argmax(-1), uncached.argmax(-1)))
        res["dispatches"] = gk.metal_dispatches()
        res["backends"] = sorted({m.info()["backend"] for m in gk._loaded_packages()})
res["namespaces"] = sorted({e.key.split("::")[0] for e in prof.key_averages() if e.key.startswith("_") and "::" in e.key})
print("RESULT" + json.dumps(res))
"""

# Metal kernels every model needs (prefixes of upstream's kernel names), and per family
COMMON_KERNELS = ("kernel_get_rows_", "kernel_mul_mv_", "kernel_mul_mm_", "kernel_rms_norm",
                  "kernel_flash_attn_ext_vec_", "kernel_flash_attn_ext_f32_", "kernel_set_rows_")
QWEN35_KERNELS = ("kernel_gated_delta_net_", "kernel_ssm_conv_")
MOE_KERNELS = ("kernel_topk_moe_", "kernel_mul_mv_id_", "kernel_mul_mm_id_")
LLAMA_KERNELS = ("kernel_concat_f32",)  # the rotary_pos_emb function kernel (rotate_half)

CASES = {  # config: (kernels, max mean KL vs float32 transformers and vs the CPU backend)
    "qwen35-tiny": (COMMON_KERNELS + QWEN35_KERNELS, 0.012),
    "qwen35moe-tiny": (COMMON_KERNELS + QWEN35_KERNELS + MOE_KERNELS, 0.03),
    "smollm2": (COMMON_KERNELS + LLAMA_KERNELS, 0.02),
}


def run_backend(config: str, backend: str | None) -> dict:
    proc = fresh_process(f"CONFIG = {config!r}\nBACKEND = {backend!r}\n" + CODE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[6:])


@pytest.fixture(scope="module", params=list(CASES))
def runs(request):
    return request.param, {backend: run_backend(request.param, backend) for backend in (None, "cpu", "metal-emu")}


@pytest.fixture(scope="module")
def twin(runs):
    """The MPS twin's run of the same model, beside the other backends' (`runs`)."""
    config, res = runs
    return res, run_backend(config, "mps-emu")


def compare(a, b) -> dict:
    import torch

    la, lb = torch.tensor(a, dtype=torch.float64).log_softmax(-1), torch.tensor(b, dtype=torch.float64).log_softmax(-1)
    kl = (la.exp() * (la - lb)).sum(-1)
    return {"top1": (la.argmax(-1) == lb.argmax(-1)).double().mean().item(), "kl_mean": kl.mean().item()}


def test_every_kernel_ran_on_the_emulated_metal_device(runs):
    config, res = runs
    metal = res["metal-emu"]
    assert metal["backends"] == ["metal-emu"]
    ours = [ns for ns in metal["namespaces"] if ns.startswith(("_ggml_", "_topk_"))]
    assert ours and all("_metal_emu_" in ns for ns in ours), metal["namespaces"]
    dispatched = metal["dispatches"]
    for prefix in CASES[config][0]:
        assert any(kernel.startswith(prefix) for kernel in dispatched), (prefix, sorted(dispatched))


def test_logits_agree_with_transformers_alone_and_the_cpu_backend(runs):
    config, res = runs
    bound = CASES[config][1]
    for other in (None, "cpu"):
        stats = compare(res[other]["logits"], res["metal-emu"]["logits"])
        assert stats["kl_mean"] <= bound and stats["top1"] >= 0.9, (other, stats)


def test_greedy_decode_on_the_metal_path(runs):
    _, res = runs
    metal = res["metal-emu"]
    assert len(metal["gen"]) == 16
    assert metal["cache_top1"] and metal["cache_rel"] < 0.02, metal["cache_rel"]


def test_the_mps_twin_gives_metal_emus_results_bit_for_bit(twin):
    res, mps = twin
    metal = res["metal-emu"]
    for key in ("logits", "gen", "decode_logits_sha256", "dispatches"):
        assert mps[key] == metal[key], key  # float32 values survive JSON exactly
    ours = [ns for ns in mps["namespaces"] if ns.startswith(("_ggml_", "_topk_"))]
    assert ours and not any("_cpu_" in ns or "_metal_emu_" in ns for ns in ours), mps["namespaces"]

"""`enable(compile_decode=True)` (`ggml_kernels_integration.compiled_decode`): `generate()`'s decode
steps on a static cache through torch.compile give what the eager steps give, a failed compile falls
back to them with one warning, and bad options are refused before anything changes.

Each model runs in a fresh process (enable() patches transformers for the whole process) on the tiny
Qwen3.5 dense and MoE files (Q4_K_M mix, tools/models/make_gguf.py) and a tiny llama file written here
(SmolLM2's layout, Q8_0 / Q4_0 weights from gguf-py's quantizers). What is compared, and the bounds:
- compiled against eager on the same static cache: the same greedy tokens and logits within 1e-5 of
  their range. The graph runs the same kernels on the same inputs (our ops are opaque to inductor)
  and inductor only fuses the float32 torch code between them; measured: bit-identical on all three.
- compiled against the eager default (transformers' dynamic cache): the same first token, and every
  step's logits within 3 % of their range. The static cache changes the prefill, not the decode
  steps: transformers gives its prefill attention a mask over the whole cache instead of running it
  causal, and that alone moves the Qwen3.5 tiny's first logits by 1.7 % (0.0 on the steps after it);
  the tiny llama's steps carry it on through every layer's keys and values. 3 %: about twice that.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.testing.kernel_testing import fresh_process

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LOAD = """
import json, os, sys, time, warnings
import torch
import ggml_kernels_integration as gk
from ggml_kernels_integration import compiled_decode
from transformers import AutoModelForCausalLM
from tools.models import make_gguf

path = PATH or str(make_gguf.ensure(CONFIG, "Q4_K_M"))
gk.enable(report_loads=False, compile_decode=True)
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
x = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(0))
KW = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)

def gen(**kwargs):
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), **KW, **kwargs)
    return out.sequences[0].tolist(), torch.stack(out.logits, 1)[0], type(out.past_key_values).__name__

def rel(a, b):
    return ((a - b).abs().amax(-1) / b.abs().amax(-1)).tolist()  # per step
"""

COMPILED = LOAD + """
tokens, logits, cache = gen()
start = time.perf_counter()
again = gen()
again_s = time.perf_counter() - start
rec = compiled_decode.record(model)
gk.enable(compile_decode=False)
static = gen(cache_implementation="static")
dynamic = gen()
print("RESULT" + json.dumps({
    "cache": cache, "static_cache": static[2], "dynamic_cache": dynamic[2],
    "compiles": len(rec.compiles), "compile_s": list(rec.compiles.values()), "failure": rec.failure,
    "again_same": again[0] == tokens, "again_s": again_s,
    "same_tokens_static": tokens == static[0], "rel_static": rel(logits, static[1]),
    "first_token_dynamic": tokens[10] == dynamic[0][10], "same_tokens_dynamic": tokens == dynamic[0],
    "rel_dynamic": rel(logits, dynamic[1]),
    "summary": gk.report.describe(gk.summary(model)),
}))
"""

FALLBACK = LOAD + """
def failing_backend(graph, example_inputs):
    raise RuntimeError("no compiler today")

compiled_decode.COMPILE_CONFIG["backend"] = failing_backend
# the caller's own choices are left alone: nothing compiled, nothing recorded
chosen = gen(disable_compile=True)
untouched = compiled_decode.record(model) is None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = gen()
    second = gen()
ours = [str(w.message) for w in caught if "ggml-kernels" in str(w.message)]
gk.enable(compile_decode=False)
static = gen(cache_implementation="static")
print("RESULT" + json.dumps({
    "untouched": untouched, "chosen_cache": chosen[2], "warnings": ours,
    "failure": compiled_decode.record(model).failure, "second_cache": second[2],
    "first_same": first[0] == static[0] and first[1].equal(static[1]), "second_same": second[0] == chosen[0],
    "summary": gk.report.describe(gk.summary(model)),
}))
"""


def write_tiny_llama(path) -> None:
    """A 2-block llama (SmolLM2's layout: GQA, tied embedding) of hidden size 64, random weights:
    Q8_0 embedding, Q4_0 attention, Q8_0 MLP (gguf-py quantizes both)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    hidden, ff, heads, kv_heads, vocab, blocks = 64, 128, 4, 2, 256, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(blocks)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name, shape, qtype=None, std=None):
        values = rng.normal(0, std if std is not None else shape[-1] ** -0.5, shape).astype(np.float32)
        if qtype is None:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, quants.quantize(values, qtype), raw_shape=shape, raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), Q.Q8_0, std=1.0)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(blocks):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), Q.Q4_0)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), Q.Q4_0)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), Q.Q4_0)
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), Q.Q4_0)
        add(f"blk.{i}.ffn_gate.weight", (ff, hidden), Q.Q8_0)
        add(f"blk.{i}.ffn_up.weight", (ff, hidden), Q.Q8_0)
        add(f"blk.{i}.ffn_down.weight", (hidden, ff), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run(script: str, config: str, tmp_path_factory) -> dict:
    path = None
    if config == "llama-tiny":
        path = tmp_path_factory.mktemp("llama") / "llama-tiny.gguf"
        write_tiny_llama(path)
    proc = fresh_process(f"CONFIG = {config!r}\nPATH = {str(path) if path else ''!r}\n" + script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[6:])


@pytest.fixture(scope="module", params=["qwen35-tiny", "qwen35moe-tiny", "llama-tiny"])
def compiled(request, tmp_path_factory):
    return request.param, run(COMPILED, request.param, tmp_path_factory)


@pytest.mark.slow  # a compile of each model: 20-90 s on 2 shared cores
def test_compiled_steps_equal_eager_steps_on_the_static_cache(compiled):
    _, res = compiled
    assert res["cache"] == res["static_cache"] == "StaticCache", res
    assert res["failure"] is None
    assert res["same_tokens_static"], res
    assert max(res["rel_static"]) < 1e-5, res["rel_static"]


@pytest.mark.slow
def test_compiled_steps_agree_with_the_eager_default(compiled):
    _, res = compiled
    assert res["dynamic_cache"] == "DynamicCache"  # compile_decode=False leaves generate() as it was
    assert res["first_token_dynamic"], res
    assert max(res["rel_dynamic"]) < 0.03, res["rel_dynamic"]


@pytest.mark.slow
def test_compiled_once_per_shape_and_reported(compiled):
    _, res = compiled
    assert res["compiles"] == 1 and res["again_same"], res  # the second generate() reuses the graph
    assert res["again_s"] < min(res["compile_s"]), res
    assert "compiled decode steps (batch 1 x " in res["summary"], res["summary"]


def test_a_failed_compile_falls_back_to_eager_with_one_warning(tmp_path_factory):
    res = run(FALLBACK, "qwen35-tiny", tmp_path_factory)
    assert res["untouched"] and res["chosen_cache"] == "DynamicCache", res
    assert len(res["warnings"]) == 1 and "decoding eagerly instead" in res["warnings"][0], res["warnings"]
    assert "no compiler today" in res["failure"], res
    assert res["first_same"], res  # the failed generate() finished eagerly on its static cache
    assert res["second_cache"] == "DynamicCache" and res["second_same"], res  # later ones: eager default
    assert "compiled decode failed, eager instead" in res["summary"], res["summary"]


@pytest.mark.parametrize("value", ["auto", 1, None, "True"])
def test_bad_compile_decode_values_are_refused_before_anything_changes(value):
    import ggml_kernels_integration as gk
    from ggml_kernels_integration import compiled_decode

    was_enabled, was_on = gk.is_enabled(), compiled_decode.is_enabled()
    with pytest.raises(ValueError, match="compile_decode must be True or False"):
        gk.enable(compile_decode=value)
    assert gk.is_enabled() == was_enabled and compiled_decode.is_enabled() == was_on

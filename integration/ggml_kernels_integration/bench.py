"""End-to-end measurements of one backend on one GGUF file, in this process.

Backends:
    kernels            transformers + ggml-kernels (`enable()`): weights stay packed, our kernels compute;
                       the layout this CPU's default picks (`repack_weights="auto"`)
    kernels-plain      the same with `enable(repack_weights=False)` (GGUF's plain layout everywhere)
    kernels-repacked   the same with `enable(repack_weights=True)` (ggml-cpu's repacked layout wherever
                       it has one)
    kernels-compiled   the same with `enable(compile_decode=True)`: prompts go into a static cache and
                       decode steps run compiled, as its generate() does; the compile (in the warm-ups,
                       once per shape) is reported as compile_s, not timed
    transformers-f32   transformers alone: every weight dequantized to dense float32 at load
    transformers-bf16  the same in bfloat16
    llama.cpp          llama-cpp-python (the llama.cpp build the tests use as oracle) on the same file

Measure one backend per process: `enable()` patches transformers for the whole process and cannot be
undone, transformers caches its kernel choice process-wide, and the peak RSS is one backend's only
in a process of its own. `python -m ggml_kernels_integration bench` and tools/bench/bench_e2e.py call
`run()`.

What is measured, with the same token ids for every backend (`prompt_ids`):
    load_s           from_pretrained (model only, no tokenizer) or Llama(...), wall time
    prefill_tok_s    one forward pass over a prompt of each length with a fresh cache, logits of the
                     last position only (as llama.cpp computes them); median of `repeats` after a warm-up
    decode_tok_s     `decode_tokens` greedy steps of one token each with the cache, after a prompt of
                     the shortest length (that prefill is not timed); median of `repeats` after a warm-up
    peak_rss_mib     the process's peak resident memory (ru_maxrss) after the timed runs; also
                     rss_at_start_mib (before loading: interpreter and imports), load_peak_rss_mib
                     (peak right after loading) and rss_after_load_mib (resident right after loading)
    first_token_ms   time to first token after a short prompt (`FIRST_TOKEN_PROMPTS` tokens): one forward
                     over the prompt with a fresh cache and the greedy token from the last logits (the
                     prefill above, timed as a chat turn's wait); median of `repeats` after a warm-up
    generate_tok_s   what a generate() user gets: `GENERATE_TOKENS` greedy tokens after a
                     `GENERATE_PROMPT_TOKENS`-token prompt through the library's own generation loop
                     (transformers' `model.generate`, llama-cpp-python's `Llama.generate`), prompt
                     included, tokens per second of the whole call (stopping early only at an end-of-
                     text token); median of `repeats` after a warm-up
    kernel_calls     transformers backends: our ops the profiler saw in one extra, untimed pass
                     (`PROFILED_PROMPT_TOKENS`-token prefill + `PROFILED_DECODE_STEPS` decode steps)
    dense_prefill    kernels backends: whether block-32 prefill matmuls took `dense_prefill` (a CPU
                     with bfloat16 dot products, not switched off)
    compile_s        kernels-compiled: seconds of each compile of the decode step, by "batch x cache
                     positions" (its first call: a stored step's load, where it was loaded)
    loaded           kernels-compiled: the "batch x cache positions" whose step was loaded from the
                     stored steps (a package, `packaged_steps`, or a dynamo step,
                     `stored_steps`) instead of compiled
"""

from __future__ import annotations

import logging
import os
import random
import resource
import statistics
import time
from pathlib import Path

BACKENDS = ("kernels", "kernels-plain", "kernels-repacked", "kernels-compiled", "transformers-f32", "transformers-bf16", "llama.cpp")
TRANSFORMERS_DTYPES = {"kernels": "float32", "kernels-plain": "float32", "kernels-repacked": "float32", "kernels-compiled": "float32",
                       "transformers-f32": "float32", "transformers-bf16": "bfloat16"}
DEFAULT_PROMPT_TOKENS = (64, 512)
DEFAULT_DECODE_TOKENS = 128
DEFAULT_REPEATS = 3
MAX_REPEATS = 1000
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS: the most threads one of its graphs runs on
PROFILED_PROMPT_TOKENS = 16  # > 8 rows: the prefill matmul path (mul_mat), not mat-vec
PROFILED_DECODE_STEPS = 4
PROMPT_SEED = 0
DECODE_WARMUP_STEPS = 4
FIRST_TOKEN_PROMPTS = (4, 16, 64)
GENERATE_PROMPT_TOKENS = 12
GENERATE_TOKENS = 32


# ---------------------------------------------------------------------------------------------
# process setup shared with the CLI


def silence_kernel_mapping_warnings() -> None:
    """Hide the kernels library's "No kernel mapping found for layer ..." warning, which it logs once
    per module of the model (logger `kernels.layer.layer`, a child of `kernels`)."""
    logging.getLogger("kernels").setLevel(logging.ERROR)


# our backends' enable(repack_weights=...)
REPACK_WEIGHTS = {"kernels": "auto", "kernels-plain": False, "kernels-repacked": True, "kernels-compiled": "auto"}


def setup_transformers(kernels_on: bool, repack_weights: bool | str = "auto", compile_decode: bool | str = False) -> None:
    """Make this process load GGUF files with our kernels (`enable()`: packed weights, repacked with
    `repack_weights`, decode steps compiled with `compile_decode`) or with transformers alone (every
    weight dequantized to a dense tensor at load). Process-wide and final: call once, before the first
    `from_pretrained`."""
    if kernels_on:
        import ggml_kernels_integration as gk

        gk.enable(report_loads=False, repack_weights=repack_weights, compile_decode=compile_decode)
    else:
        silence_kernel_mapping_warnings()
        os.environ.pop("LOCAL_KERNELS", None)
        from transformers.integrations.gguf import kernels as gguf_kernels

        gguf_kernels._gguf_kernel = False  # "no kernel": transformers dequantizes every weight


def check_gguf(path: Path) -> None:
    """`ggml_kernels_integration.check_gguf` where the package has it: a clear ValueError for a file
    that is not a usable GGUF model."""
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    import ggml_kernels_integration as gk

    if hasattr(gk, "check_gguf"):
        gk.check_gguf(path)


def load_transformers_model(path: Path, dtype_name: str):
    """(model in eval mode, load seconds) of a GGUF file, as set up by `setup_transformers`."""
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype_name))
    return model.eval(), time.perf_counter() - start


def default_threads() -> int:
    """torch's intra-op thread count, which our kernels use too; llama.cpp is given the same."""
    import torch

    return torch.get_num_threads()


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float | None:
    """Resident memory of this process now (Linux /proc), None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def count_our_kernel_calls(profiler) -> dict[str, int]:
    """`package::op` -> calls, for the ops of our packages in a torch profiler's trace.

    Our ops live in namespaces `_<package>_cpu_<build hash>` (e.g. `_ggml_quantization_cpu_1a2b::mul_mat`)."""
    calls: dict[str, int] = {}
    for event in profiler.key_averages():
        namespace, sep, op = event.key.partition("::")
        if sep and namespace.startswith("_") and "_cpu_" in namespace:
            package = namespace[1:].rsplit("_cpu_", 1)[0]
            calls[f"{package}::{op}"] = calls.get(f"{package}::{op}", 0) + event.count
    return dict(sorted(calls.items()))


# ---------------------------------------------------------------------------------------------
# measurements


def prompt_ids(n_tokens: int, vocab_size: int, seed: int = PROMPT_SEED) -> list[int]:
    """`n_tokens` deterministic pseudo-random token ids in [0, vocab_size): the same for every backend
    (and every prompt length shares its first tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n_tokens)]


def _median_rate(n_tokens: int, seconds: list[float]) -> float:
    return n_tokens / statistics.median(seconds)


class TransformersRunner:
    """Prefill and greedy decode steps of a transformers model, timed by the caller."""

    def __init__(self, model):
        self.model = model

    def prefill(self, ids: list[int]):
        """One forward pass over `ids` with a new cache: (cache, next greedy token)."""
        import torch

        out = self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    def decode(self, cache, token, steps: int):
        for _ in range(steps):
            out = self.model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return cache, token

    def generate(self, ids: list[int], new_tokens: int) -> int:
        """transformers' greedy `generate`; returns how many tokens it made."""
        import torch

        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
        return out.shape[1] - len(ids)


class StaticCompiledRunner(TransformersRunner):
    """Prefill into a `StaticCache` of `positions` (reset first, as generate() starts a new one), then
    decode steps on the compiled forward generate() uses (`enable(compile_decode=True)`)."""

    def __init__(self, model, positions: int):
        from transformers import StaticCache

        from . import compiled_decode

        super().__init__(model)
        self.cache = StaticCache(config=model.config, max_cache_len=compiled_decode.cache_positions(positions))
        self.step = compiled_decode.compiled_call(model)
        self.position = 0

    def prefill(self, ids: list[int]):
        """The prompt's forward through the compiled call where prompts are packaged (as generate()
        sends it there, `compiled_decode.prompt_in_one_chunk`), else the model's own."""
        import torch

        from . import packaged_steps

        self.cache.reset()
        forward = self.step if packaged_steps.prompts_enabled() else self.model
        out = forward(input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True, logits_to_keep=1,
                      cache_position=torch.arange(len(ids)))
        self.position = len(ids)
        return self.cache, out.logits[:, -1].argmax(-1, keepdim=True)

    def decode(self, cache, token, steps: int):
        import torch

        from . import stored_steps

        with stored_steps.one_generation():
            for _ in range(steps):
                out = self.step(input_ids=token, past_key_values=cache, use_cache=True,
                                cache_position=torch.tensor([self.position]))
                self.position, token = self.position + 1, out.logits[:, -1].argmax(-1, keepdim=True)
        return cache, token


class LlamaCppRunner:
    """The same two steps through llama-cpp-python's low-level eval (greedy on the last logits)."""

    def __init__(self, llm):
        import numpy as np

        self.llm, self.np = llm, np

    def _greedy(self) -> int:
        import llama_cpp

        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def prefill(self, ids: list[int]):
        self.llm.reset()
        self.llm.eval(ids)
        return None, self._greedy()

    def decode(self, cache, token, steps: int):
        for _ in range(steps):
            self.llm.eval([token])
            token = self._greedy()
        return cache, token

    def generate(self, ids: list[int], new_tokens: int) -> int:
        """llama-cpp-python's `Llama.generate` (greedy: temperature 0); returns how many tokens it made."""
        made = 0
        for token in self.llm.generate(ids, temp=0.0, reset=True):
            made += 1
            if made == new_tokens or token == self.llm.token_eos():
                break
        return made


def time_prefill_and_decode(runner, vocab_size: int, prompt_tokens, decode_tokens: int, repeats: int) -> dict:
    """Prefill tokens/s per prompt length and decode tokens/s, medians over `repeats` after a warm-up."""
    prefill = {}
    for n in prompt_tokens:
        ids = prompt_ids(n, vocab_size)
        runner.prefill(ids)  # warm-up: first-call allocations, thread pools, lazy kernel loads
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.prefill(ids)
            seconds.append(time.perf_counter() - start)
        prefill[str(n)] = _median_rate(n, seconds)

    decode_prompt = min(prompt_tokens)
    ids = prompt_ids(decode_prompt, vocab_size)
    runner.decode(*runner.prefill(ids), min(DECODE_WARMUP_STEPS, decode_tokens))
    seconds = []
    for _ in range(repeats):
        cache, token = runner.prefill(ids)
        start = time.perf_counter()
        runner.decode(cache, token, decode_tokens)
        seconds.append(time.perf_counter() - start)
    return {
        "prefill_tok_s": prefill,
        "decode_prompt_tokens": decode_prompt,
        "decode_tok_s": _median_rate(decode_tokens, seconds),
    }


def time_first_token_and_generate(runner, vocab_size: int, repeats: int) -> dict:
    """Time to first token after each of FIRST_TOKEN_PROMPTS, and generate() tokens/s (module docstring)."""
    first = {}
    for n in FIRST_TOKEN_PROMPTS:
        ids = prompt_ids(n, vocab_size)
        runner.prefill(ids)  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.prefill(ids)
            seconds.append(time.perf_counter() - start)
        first[str(n)] = 1e3 * statistics.median(seconds)
    ids = prompt_ids(GENERATE_PROMPT_TOKENS, vocab_size)
    runner.generate(ids, 4)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        made = runner.generate(ids, GENERATE_TOKENS)
        rates.append(made / (time.perf_counter() - start))
    return {"first_token_ms": first, "generate_tok_s": statistics.median(rates),
            "generate": {"prompt_tokens": GENERATE_PROMPT_TOKENS, "new_tokens": GENERATE_TOKENS}}


def ggml_versions() -> dict:
    """The ggml version and CPU level (x64, haswell, skylakex, zen4) our kernels run; after `enable()`."""
    import kernels

    from . import locate

    quant = kernels.get_kernel(locate.QUANTIZATION, version=1, **locate.backend_kwargs())
    info = quant.info()
    return {"ggml": info["ggml"], "ggml_cpu_level": info["cpu_variant"]}


def repacked_linears(model) -> dict[str, int]:
    """GGUF type name -> how many of the model's linears hold it in ggml-cpu's repacked layout."""
    import kernels

    from . import locate, repacking

    return repacking.by_type(model, kernels.get_kernel(locate.QUANTIZATION, version=1, **locate.backend_kwargs()))


def dense_prefill_active() -> bool:
    """Whether prefill matmuls on block-32 weights take ggml_kernels_integration.dense_prefill here."""
    from ggml_kernels_integration import dense_prefill

    return dense_prefill.native_bf16() and dense_prefill._state["enabled"]


def _bench_transformers(path: Path, backend: str, prompt_tokens, decode_tokens: int, repeats: int) -> dict:
    import torch
    import transformers

    ours, compiled = backend.startswith("kernels"), backend == "kernels-compiled"
    setup_transformers(kernels_on=ours, repack_weights=REPACK_WEIGHTS.get(backend, False), compile_decode=compiled)
    model, load_s = load_transformers_model(path, TRANSFORMERS_DTYPES[backend])
    after_load = {"load_peak_rss_mib": peak_rss_mib(), "rss_after_load_mib": current_rss_mib()}
    weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    vocab_size = model.config.get_text_config().vocab_size
    if compiled:  # a cache long enough for the longest prompt and its decode steps, warm-ups included
        longest = max(*prompt_tokens, *FIRST_TOKEN_PROMPTS, PROFILED_PROMPT_TOKENS)
        runner = StaticCompiledRunner(model, longest + decode_tokens + DECODE_WARMUP_STEPS + PROFILED_DECODE_STEPS)
    else:
        runner = TransformersRunner(model)
    with torch.inference_mode():
        timings = time_prefill_and_decode(runner, vocab_size, prompt_tokens, decode_tokens, repeats)
        timings.update(time_first_token_and_generate(runner, vocab_size, repeats))
        peak = peak_rss_mib()  # before the profiled pass, whose trace takes memory of its own
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler:
            runner.decode(*runner.prefill(prompt_ids(PROFILED_PROMPT_TOKENS, vocab_size)), PROFILED_DECODE_STEPS)
    return {
        "load_s": load_s,
        **after_load,
        **timings,
        "peak_rss_mib": peak,
        "weights_mib": weight_bytes / 2**20,
        "kernel_calls": count_our_kernel_calls(profiler),
        "profiled": f"{PROFILED_PROMPT_TOKENS}-token prefill + {PROFILED_DECODE_STEPS} decode steps",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     **(ggml_versions() if ours else {})},
        **({"dense_prefill": dense_prefill_active(), "repacked_linears": repacked_linears(model)} if ours else {}),
        **(compile_record(model) if compiled else {}),
    }


def compile_record(model) -> dict:
    """kernels-compiled: compile_s ("batch x cache positions" -> seconds of that compile of the decode
    step), prompt_packages ("first-last" tokens -> seconds of that prompt package's export, 0 where it
    was loaded) and compile_failure (why it decoded eagerly instead, None when it did not)."""
    from . import compiled_decode

    rec = compiled_decode.record(model)
    compiles = rec.compiles if rec else {}
    loaded = rec.loaded_shapes() if rec else set()
    packaged = rec.packaged if rec else None
    prompts = {**dict.fromkeys(packaged.prompt_loaded, 0.0), **packaged.prompt_exported} if packaged else {}
    return {"compile_s": {f"{batch} x {positions}": seconds for (batch, positions), seconds in compiles.items()},
            "loaded": [f"{batch} x {positions}" for batch, positions in sorted(loaded)],
            "prompt_packages": {f"{first}-{last}": seconds for (_, _, first, last), seconds in sorted(prompts.items())},
            "compile_failure": rec.failure if rec else None}


def describe_compiles(result: dict) -> str:
    """kernels-compiled: one line on its decode step's compiles (or why it decoded eagerly)."""
    if result.get("compile_failure"):
        return f"compiling the decode step failed, decoded eagerly: {result['compile_failure']}"
    loaded = result.get("loaded", [])
    shapes = ", ".join(f"batch {shape} positions: {s:.1f} s{' (loaded from the stored steps)' if shape in loaded else ''}"
                       for shape, s in result.get("compile_s", {}).items())
    prompts = result.get("prompt_packages") or {}
    packaged = (f"; prompts' forwards packaged for {', '.join(prompts)} tokens ({sum(prompts.values()):.1f} s "
                "exporting here)") if prompts else ""
    return f"decode step compiled once per model and shape, not timed ({shapes}){packaged}"


def _bench_llama_cpp(path: Path, prompt_tokens, decode_tokens: int, repeats: int, threads: int) -> dict:
    import llama_cpp

    n_ctx = max(*prompt_tokens, *FIRST_TOKEN_PROMPTS, GENERATE_PROMPT_TOKENS + GENERATE_TOKENS) + decode_tokens
    n_ctx += DECODE_WARMUP_STEPS + PROFILED_DECODE_STEPS
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                          n_batch=max(512, max(prompt_tokens)), verbose=False)
    load_s = time.perf_counter() - start
    after_load = {"load_peak_rss_mib": peak_rss_mib(), "rss_after_load_mib": current_rss_mib()}
    runner = LlamaCppRunner(llm)
    timings = time_prefill_and_decode(runner, llm.n_vocab(), prompt_tokens, decode_tokens, repeats)
    timings.update(time_first_token_and_generate(runner, llm.n_vocab(), repeats))
    return {
        "load_s": load_s,
        **after_load,
        **timings,
        "peak_rss_mib": peak_rss_mib(),
        "weights_mib": llama_cpp.llama_model_size(llm.model) / 2**20,
        "kernel_calls": None,
        "versions": {"llama-cpp-python": llama_cpp.__version__},
    }


def run(path, backend: str, prompt_tokens=DEFAULT_PROMPT_TOKENS, decode_tokens: int = DEFAULT_DECODE_TOKENS,
        repeats: int = DEFAULT_REPEATS, threads: int | None = None) -> dict:
    """Measure `backend` on the GGUF file `path` in this process; a JSON-ready dict (module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if not prompt_tokens or min(prompt_tokens) < 1 or decode_tokens < 1 or repeats < 1:
        raise ValueError("prompt lengths, decode tokens and repeats must be at least 1")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be 1 to {MAX_THREADS}, got {threads}")
    path = Path(path)
    check_gguf(path)
    rss_at_start = peak_rss_mib()  # the interpreter and the libraries imported so far
    if threads is None:
        threads = default_threads()
    prompt_tokens = sorted(set(prompt_tokens))
    if backend == "llama.cpp":
        measured = _bench_llama_cpp(path, prompt_tokens, decode_tokens, repeats, threads)
    else:
        import torch

        torch.set_num_threads(threads)
        measured = _bench_transformers(path, backend, prompt_tokens, decode_tokens, repeats)
    return {
        "model": path.name,
        "gguf": str(path),
        "backend": backend,
        "threads": threads,
        "repeats": repeats,
        "decode_tokens": decode_tokens,
        "rss_at_start_mib": rss_at_start,
        **measured,
    }


def format_result(result: dict) -> str:
    """A few human-readable lines for one `run()` result."""
    prefill = ", ".join(f"{n} tok: {rate:.1f}" for n, rate in result["prefill_tok_s"].items())
    lines = [
        f"{result['model']} on {result['backend']} ({result['threads']} threads, median of {result['repeats']})",
        f"  load {result['load_s']:.2f} s, weights {result['weights_mib']:.0f} MiB, "
        f"peak RSS {result['peak_rss_mib']:.0f} MiB ({result['rss_at_start_mib']:.0f} before loading, "
        f"{result['load_peak_rss_mib']:.0f} peak while loading, {result['rss_after_load_mib'] or 0:.0f} resident after)",
        f"  prefill tok/s: {prefill}",
        f"  decode tok/s: {result['decode_tok_s']:.1f} ({result['decode_tokens']} greedy tokens "
        f"after {result['decode_prompt_tokens']})",
    ]
    if result.get("first_token_ms"):
        first = ", ".join(f"{n} tok: {ms:.1f}" for n, ms in result["first_token_ms"].items())
        gen = result["generate"]
        lines.append(f"  first token ms: {first}")
        lines.append(f"  generate() tok/s: {result['generate_tok_s']:.1f} ({gen['new_tokens']} tokens after "
                     f"{gen['prompt_tokens']}, the prompt included)")
    if result.get("compile_failure") or result.get("compile_s"):
        lines.append(f"  {describe_compiles(result)}")
    if "repacked_linears" in result:
        repacked = ", ".join(f"{n} {name}" for name, n in result["repacked_linears"].items())
        lines.append(f"  weights: {'repacked linears: ' + repacked if repacked else 'plain layout'}")
    if result.get("kernel_calls") is not None:
        calls = ", ".join(f"{op} x{n}" for op, n in result["kernel_calls"].items()) or "none"
        lines.append(f"  our kernels in a {result['profiled']}: {calls}")
    return "\n".join(lines)

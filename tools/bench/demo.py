"""The main job: GGUF models run by transformers on our kernels, next to transformers alone and llama.cpp.

1. Model files (made if missing): a Qwen3.5-0.8B-shaped Q4_K_M file (random weights, tools/models/make_gguf.py)
   and the real SmolLM2-135M-Instruct Q4_1 (arch llama, tools/models/smollm2.py).
2. SmolLM2 answers a question with greedy decoding through our kernels (`python -m
   ggml_kernels_integration generate --chat`), next to transformers alone and llama.cpp.
3. Each model on each backend (transformers f32, ours, ours with compiled decode steps, llama.cpp) in
   a process of its own (`python -m ggml_kernels_integration bench`): prefill and decode tokens/s,
   time to first token after 4 / 16 / 64-token prompts, generate() tokens/s, peak memory, which of
   our kernels ran (torch profiler), and the seconds the compiled row spent compiling (not timed).

    python -m tools.bench.demo [--threads N] [--prompt-tokens 64] [--decode-tokens 32]

Short on purpose (a few minutes on 2 cores); tools/bench/bench_e2e.py is the full benchmark.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ggml_kernels_integration.bench import (
    FIRST_TOKEN_PROMPTS,
    GENERATE_PROMPT_TOKENS,
    GENERATE_TOKENS,
    describe_compiles,
)

from tools.bench import bench_e2e
from tools.models import make_gguf, smollm2

QUESTION = "What is the capital of France? Answer in one sentence."
ANSWER_TOKENS = 24
DEMO_MODELS = {
    "qwen35-0.8b": ("Qwen3.5-0.8B shapes, random weights, Q4_K_M", lambda: make_gguf.ensure("qwen35-0.8b", "Q4_K_M")),
    "smollm2-135m": ("SmolLM2-135M-Instruct, real weights, Q4_1", smollm2.gguf_path),
}
DEMO_BACKENDS = ("transformers-f32", "kernels", "kernels-compiled", "llama.cpp")
BACKEND_LABELS = {"transformers-f32": "transformers f32", "transformers-bf16": "transformers bf16",
                  "kernels": "ggml kernels (ours)", "kernels-compiled": "ours, compiled decode",
                  "llama.cpp": "llama.cpp"}


def _log(message: str) -> None:
    print(f"  ... {message}", file=sys.stderr, flush=True)


def cli_generate(path: Path, kernels_on: bool, threads: int) -> tuple[str, str]:
    """(answer text, summary line) of `ggml-kernels generate --chat` on SmolLM2 in a fresh process;
    ("FAILED: <why>", "") if that process failed."""
    command = [sys.executable, "-m", "ggml_kernels_integration", "generate", "--gguf", str(path), "--chat",
               "--prompt", QUESTION, "--max-new-tokens", str(ANSWER_TOKENS), "--threads", str(threads)]
    if not kernels_on:
        command.append("--no-kernels")
    proc = bench_e2e.run_isolated(command, timeout=1800)
    if isinstance(proc, str):
        return _failed(proc), ""
    summary = next((line for line in reversed(proc.stderr.splitlines()) if line.startswith("prompt ")), "")
    return proc.stdout.strip(), summary


def llama_cpp_answer(path: Path, threads: int) -> str:
    """llama.cpp's greedy answer to the same chat turn, in a process of its own; "FAILED: <why>" if it failed."""
    command = [sys.executable, "-m", "tools.bench.llama_cpp_chat", "--gguf", str(path), "--prompt", QUESTION,
               "--max-tokens", str(ANSWER_TOKENS), "--threads", str(threads)]
    proc = bench_e2e.run_isolated(command, timeout=1800)
    return _failed(proc) if isinstance(proc, str) else proc.stdout.strip()


def _failed(reason: str) -> str:
    return "FAILED: " + bench_e2e.error_summary({"error": reason})


def _answer(text: str) -> str:
    return text if text.startswith("FAILED: ") else repr(text)


def chat_section(threads: int) -> list[str]:
    path = smollm2.gguf_path()
    _log("SmolLM2 chat: our kernels")
    ours, ours_summary = cli_generate(path, kernels_on=True, threads=threads)
    _log("SmolLM2 chat: transformers alone")
    alone, alone_summary = cli_generate(path, kernels_on=False, threads=threads)
    _log("SmolLM2 chat: llama.cpp")
    reference = llama_cpp_answer(path, threads)
    same = "" if reference.startswith("FAILED: ") else f"  ({'same text as ours' if reference == ours else 'differs from ours'})"
    return [
        f"SmolLM2-135M-Instruct (Q4_1) asked {QUESTION!r}, greedy, up to {ANSWER_TOKENS} tokens:",
        f"  ours              {_answer(ours)}",
        f"  transformers f32  {_answer(alone)}",
        f"  llama.cpp         {_answer(reference)}{same}",
        f"  ours:  {ours_summary}",
        f"  alone: {alone_summary}",
    ]


def _kernel_summary(calls: dict) -> str:
    """`package::op xN` grouped by package: `ggml_quantization: mul_mat x210, mul_mat_vec x845; ...`."""
    by_package: dict[str, list[str]] = {}
    for name, count in calls.items():
        package, op = name.split("::")
        by_package.setdefault(package, []).append(f"{op} x{count}")
    return "; ".join(f"{package}: {', '.join(ops)}" for package, ops in by_package.items()) or "none"


def _against(row: dict, llama: dict) -> str:
    """First token after each short prompt and generate(), llama.cpp's time over the row's."""
    short = ", ".join(f"{llama['first_token_ms'][str(n)] / row['first_token_ms'][str(n)]:.2f}x after {n}"
                      for n in FIRST_TOKEN_PROMPTS)
    return f"first token {short}; generate() {row['generate_tok_s'] / llama['generate_tok_s']:.2f}x"


def bench_section(settings: dict, threads: int) -> tuple[list[str], str]:
    n_prompt, n_decode = settings["prompt_tokens"][0], settings["decode_tokens"]
    first = "/".join(str(n) for n in FIRST_TOKEN_PROMPTS)
    lines = [f"prefill {n_prompt} tokens, then {n_decode} greedy decode tokens (tok/s, median of {settings['repeats']}); "
             f"first token after {first}-token prompts (ms); generate(): {GENERATE_TOKENS} tokens after "
             f"{GENERATE_PROMPT_TOKENS}, the prompt included (tok/s); each backend in a process of its own",
             f"  {'model / backend':28s} {'prefill':>8s} {'decode':>8s} {'first token ms':>18s} {'generate':>9s} "
             f"{'peak RSS':>9s} {'weights':>8s} {'load':>6s}"]
    ggml = ""
    for model, (description, make_path) in DEMO_MODELS.items():
        path = make_path()
        lines.append(f"{model} ({description})")
        rows = {}
        for backend in DEMO_BACKENDS:
            _log(f"bench {model} on {backend}")
            row = bench_e2e.measure(path, backend, settings, threads)
            rows[backend] = row
            if "error" in row:
                lines.append(f"  {BACKEND_LABELS[backend]:28s} FAILED: {bench_e2e.error_summary(row)}")
                continue
            firsts = "/".join(f"{row['first_token_ms'][str(n)]:.0f}" for n in FIRST_TOKEN_PROMPTS)
            lines.append(f"  {BACKEND_LABELS[backend]:28s} {row['prefill_tok_s'][str(n_prompt)]:8.1f} "
                         f"{row['decode_tok_s']:8.1f} {firsts:>18s} {row['generate_tok_s']:9.1f} "
                         f"{row['peak_rss_mib']:5.0f} MiB {row['weights_mib']:4.0f} MiB {row['load_s']:5.1f}s")
        ours = rows.get("kernels", {})
        if "error" not in ours:
            ratio = bench_e2e.comparisons({b: r for b, r in rows.items() if "error" not in r})["kernels"]
            lines.append(f"  ours: decode {bench_e2e.fmt_value(ratio['decode_vs_f32'], '.1f', 'x')} transformers f32 and "
                         f"{bench_e2e.fmt_value(ratio['decode_vs_llama_cpp'], '.2f', 'x')} llama.cpp; "
                         f"{bench_e2e.fmt_value(ratio['memory_f32_over_this'], '.1f', 'x')} less peak memory than f32")
            llama = rows.get("llama.cpp", {})
            if "error" not in llama:
                lines.append(f"  ours against llama.cpp (speed, above 1: ours is faster): {_against(ours, llama)}")
            compiled = rows.get("kernels-compiled", {})
            if "error" not in compiled and "error" not in llama:
                lines.append(f"  compiled decode (`enable(compile_decode=True)`; by default where its packages are stored, or for generate() calls of 4096+ new tokens) against llama.cpp: "
                             f"decode {compiled['decode_tok_s'] / llama['decode_tok_s']:.2f}x, {_against(compiled, llama)}; "
                             f"{describe_compiles(compiled)}")
            lines.append(f"  our kernels in a {ours['profiled']}: {_kernel_summary(ours['kernel_calls'])}")
            versions = ours.get("versions", {})
            ggml = f"ggml {versions.get('ggml', '?')}, CPU level '{versions.get('ggml_cpu_level', '?')}'"
    return lines, ggml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for every backend (default: torch's)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from ggml_kernels_integration import bench

    start = time.perf_counter()
    threads = args.threads or bench.default_threads()
    print("model files:", file=sys.stderr)
    for _, make_path in DEMO_MODELS.values():
        print(f"  {make_path()}", file=sys.stderr)  # made here if missing (a minute for the 0.8B file)
    settings = {"prompt_tokens": [args.prompt_tokens], "decode_tokens": args.decode_tokens, "repeats": args.repeats}
    chat = chat_section(threads)
    table, ggml = bench_section(settings, threads)
    print()
    print(f"ggml-kernels demo: {ggml}, {threads} threads")
    print()
    print("\n".join(chat))
    print()
    print("\n".join(table))
    print(f"\n(demo took {time.perf_counter() - start:.0f} s; full benchmark: tools/bench/bench_e2e.py, nox -s bench-e2e)")


if __name__ == "__main__":
    main()

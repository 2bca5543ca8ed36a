"""Where a decode step's time goes: torch's profiler over whole-model decode steps, by kind.

Loads a GGUF file with `enable()`, prefills `--prompt-tokens`, then profiles `--steps` greedy decode
steps (eager on transformers' dynamic cache, or `--compiled`: the compiled steps of
`enable(compile_decode=True)` on a static cache, compiled before anything is timed) and prints, per
step: the wall time, the self time of each of our ops, the other torch ops together, dynamo's guard
check and the compiled graph's own code (`--compiled`), and what no op accounts for (Python:
transformers' modules, our glue, the profiler's own share). Unprofiled steps are timed first, so the
profiler's overhead shows as the difference of the two wall times.

    python -m tools.bench.step_profile --gguf qwen35-0.8b.Q4_K_M.gguf --threads 1
    python -m tools.bench.step_profile --gguf SmolLM2-135M-Instruct.Q4_1.gguf --compiled
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

# profiler rows that are not ops: dynamo's guard check before a compiled step, the compiled graph's
# own code (inductor's kernels and its calls of our ops), their wrappers
DYNAMO_ROWS = {"TorchDynamo Cache Lookup": "dynamo guard check", "## Call CompiledFxGraph": "compiled graph's own code"}
WRAPPER_ROWS = ("Torch-Compiled Region", "Pregraph bytecode", "AOTDispatcher Runtime Wrapper")


def _kind(key: str) -> str | None:
    """The line a profiler row adds to: one of ours (`namespace::op`), another torch op, dynamo's,
    or None for rows that only wrap others."""
    for prefix, label in DYNAMO_ROWS.items():
        if key.startswith(prefix):
            return label
    if key.startswith(WRAPPER_ROWS):
        return None
    namespace, _, op = key.partition("::")
    if namespace.startswith("_ggml_"):
        return f"{re.sub(r'_[a-z]+_[0-9a-f]+$', '', namespace).lstrip('_')}.{op}"  # _<package>_<build>_<hash>
    return "other torch ops"


def breakdown(events, steps: int) -> dict[str, tuple[float, float]]:
    """{line: (calls per step, self ms per step)} from the profiler's key averages."""
    lines: dict[str, list[float]] = {}
    for e in events:
        kind = _kind(e.key)
        if kind is not None:
            calls, ms = lines.setdefault(kind, [0.0, 0.0])
            lines[kind] = [calls + e.count / steps, ms + e.self_cpu_time_total / 1e3 / steps]
    return {k: (v[0], v[1]) for k, v in sorted(lines.items(), key=lambda kv: -kv[1][1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--compiled", action="store_true", help="compiled decode steps on a static cache")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's)")
    args = ap.parse_args()

    import torch
    from ggml_kernels_integration import bench
    from torch.profiler import ProfilerActivity, profile

    if args.threads:
        torch.set_num_threads(args.threads)
    bench.setup_transformers(kernels_on=True)
    model, _ = bench.load_transformers_model(args.gguf, "float32")
    ids = bench.prompt_ids(args.prompt_tokens, model.config.get_text_config().vocab_size)
    positions = args.prompt_tokens + 2 * args.steps + 16
    runner = bench.StaticCompiledRunner(model, positions) if args.compiled else bench.TransformersRunner(model)
    with torch.inference_mode():
        runner.decode(*runner.prefill(ids), 4)  # warm-up (and the compile)
        cache, token = runner.prefill(ids)
        start = time.perf_counter()
        cache, token = runner.decode(cache, token, args.steps)
        plain_ms = (time.perf_counter() - start) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            runner.decode(cache, token, args.steps)
            profiled_ms = (time.perf_counter() - start) / args.steps * 1e3
    lines = breakdown(prof.key_averages(), args.steps)
    accounted = sum(ms for _, ms in lines.values())
    print(f"{args.gguf.name}, {'compiled' if args.compiled else 'eager'} decode steps after {args.prompt_tokens} "
          f"tokens, {torch.get_num_threads()} threads: {plain_ms:.2f} ms per step ({profiled_ms:.2f} ms profiled, "
          f"{args.steps} steps)")
    print(f"  {'':40s} {'calls':>7s} {'ms':>8s}")
    for kind, (calls, ms) in lines.items():
        print(f"  {kind:40s} {calls:7.1f} {ms:8.3f}")
    print(f"  {'outside any op (Python)':40s} {'':7s} {profiled_ms - accounted:8.3f}")


if __name__ == "__main__":
    main()

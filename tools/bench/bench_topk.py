"""topk's MoE routing side by side with transformers' eager router, the pure-PyTorch reference and
the same routing as ggml graphs.

    python -m tools.bench.bench_topk                 # full table (~1-2 min on 2 cores)
    python -m tools.bench.bench_topk --quick         # fewer calls per cell (~20 s)
    python -m tools.bench.bench_topk --markdown --json bench.json

For each (tokens, experts, logits dtype), k = 8, renormalised (Qwen3.5-MoE routes so), it times:

  ours       topk.softmax_top_k(logits, 8): the fused op (softmax, top-k, renormalisation in one
             pass per token row, token rows over torch's threads)
  ggml       topk.top_k_ggml(logits, 8, True, True): ggml-cpu's soft_max_ext -> top_k -> get_rows ->
             sum_rows -> div as one-op graphs per slice of rows (plus ordering the k it returns)
  eager      what transformers' SoftmaxTopKRouter (Qwen3_5MoeTopKRouter.forward) runs after its
             router linear: softmax(float32) -> torch.topk -> divide by the sum -> cast back
  reference  topk.reference.softmax_top_k: the pure-PyTorch reference (eager plus the input checks
             and the +inf handling, hence slower)
  module / module+ours
             the whole router module forward *including the router linear* (hidden 2048, Qwen3.5-35B-A3B's
             size), transformers' own and kernelized with our layer: what a model sees

The routing columns exclude the router linear (the logits are given). Each number is the median of
single-call timings over --rounds interleaved rounds of >= --min-time seconds each, so that load from
another process on the machine hits every column alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tools import REPO

PACKAGE = REPO / "packages" / "topk"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernel is a local build; nothing to fetch

import torch  # noqa: E402

from tools.bench.benchutil import keep_freed_memory  # noqa: E402

TOKENS = [1, 512]
EXPERTS = [64, 128, 256]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
K = 8
HIDDEN = 2048

HEADERS = ["tokens", "experts", "dtype", "ours µs", "ggml µs", "eager µs", "reference µs", "eager / ours",
           "module µs", "module+ours µs", "module / module+ours"]


def load_kernel():
    from kernels import get_local_kernel

    if not any((PACKAGE / "build").glob("torch*-cpu-*")):
        sys.exit("topk is not built: run `python -m tools.build topk`")
    return get_local_kernel(PACKAGE, backend="cpu")


def eager_routing(router_logits: torch.Tensor, top_k: int):
    """The routing part of transformers' softmax top-k router forward, op for op."""
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    values, indices = torch.topk(probs, top_k, dim=-1)
    values /= values.sum(dim=-1, keepdim=True)
    return values.to(router_logits.dtype), indices


def router_modules(kernel, experts: int, dtype: torch.dtype):
    """transformers' Qwen3.5-MoE router (random weights) and a copy kernelized with our layer."""
    try:
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

        from tools.testing.kernel_testing import (
            variant_dir,  # the CPU build for this torch, whatever torch's backend
        )
    except ImportError:
        return None, None
    cfg = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=K, num_hidden_layers=1)
    orig = Qwen3_5MoeTopKRouter(cfg)
    with torch.no_grad():
        orig.weight.normal_(0, 0.02)
    orig = orig.to(dtype).eval()
    mapping = {"SoftmaxTopKRouter": {"cpu": LocalLayerRepository(repo_path=variant_dir("topk"), layer_name="SoftmaxTopKRouter")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        ours = kernelize(copy.deepcopy(orig), device="cpu", mode=Mode.INFERENCE)
    return orig, ours


def time_cell(fns: dict, rounds: int, min_time: float, min_calls: int) -> dict[str, float]:
    """Median single-call time (µs) of each callable, over interleaved rounds."""
    samples = {name: [] for name in fns}
    for f in fns.values():  # warm up: caches, thread pool, allocator
        t_end = time.perf_counter() + 0.05
        while time.perf_counter() < t_end:
            f()
    for _ in range(rounds):
        for name, f in fns.items():
            got, t_end = 0, time.perf_counter() + min_time / rounds
            while got < min_calls or time.perf_counter() < t_end:
                t = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t)
                got += 1
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer calls per cell (~20 s)")
    p.add_argument("--json", metavar="PATH", help="also write the raw results here")
    p.add_argument("--markdown", action="store_true", help="print the table as GitHub markdown")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per cell (default 5, quick 3)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of timed calls per column and cell (default 1.0, quick 0.25)")
    args = p.parse_args(argv)
    from tabulate import tabulate

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    rounds = args.rounds or (3 if args.quick else 5)
    min_time = args.min_time or (0.25 if args.quick else 1.0)
    k = load_kernel()
    torch.set_grad_enabled(False)

    rows, raw = [], []
    for tokens in TOKENS:
        for experts in EXPERTS:
            for dname, dtype in DTYPES.items():
                gen = torch.Generator().manual_seed(tokens * 1000 + experts)
                logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
                hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
                # the kernel and the eager router must agree before anything is timed
                w, i = k.softmax_top_k(logits, K)
                ew, ei = eager_routing(logits, K)
                assert torch.equal(i, ei), "ours and eager chose different experts"
                fns = {
                    "ours": lambda: k.softmax_top_k(logits, K),
                    "ggml": lambda: k.top_k_ggml(logits, K, True, True),
                    "eager": lambda: eager_routing(logits, K),
                    "reference": lambda: k.reference.softmax_top_k(logits, K),
                }
                orig, ours_mod = router_modules(k, experts, dtype)
                if orig is not None:
                    fns["module"] = lambda: orig(hidden)
                    fns["module+ours"] = lambda: ours_mod(hidden)
                min_calls = 200 if tokens == 1 else 20
                t = time_cell(fns, rounds, min_time, min_calls)
                raw.append({"tokens": tokens, "experts": experts, "k": K, "dtype": dname, "times_us": t})
                mod = t.get("module"), t.get("module+ours")
                rows.append([
                    tokens, experts, dname, f"{t['ours']:.1f}", f"{t['ggml']:.1f}", f"{t['eager']:.1f}",
                    f"{t['reference']:.1f}", f"{t['eager'] / t['ours']:.2f}x",
                    f"{mod[0]:.1f}" if mod[0] else "-", f"{mod[1]:.1f}" if mod[1] else "-",
                    f"{mod[0] / mod[1]:.2f}x" if mod[0] else "-",
                ])
                print(f"  {tokens} tokens, {experts} experts, {dname}: done", file=sys.stderr)

    title = (f"topk routing, k={K}, renormalised; torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"{platform.processor() or platform.machine()}, ggml CPU level {k.info()['cpu_variant']}; "
             f"median µs per call (routing columns: logits given; module columns: router linear "
             f"{HIDDEN} -> experts included)")
    print(title)
    print(tabulate(rows, headers=HEADERS, tablefmt="github" if args.markdown else "simple",
                   colalign=("right",) * len(HEADERS)))
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "cells": raw}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

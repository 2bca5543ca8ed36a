"""ggml-norm's zero-centred RMS norm side by side with transformers' eager module and the
pure-PyTorch reference, at Qwen3.5 hidden sizes, for decode (1 token) and prefill (512 tokens).

    python -m tools.bench.bench_norm                 # full table (~1 min on 2 cores)
    python -m tools.bench.bench_norm --quick         # fewer timings per cell (~15 s)
    python -m tools.bench.bench_norm --markdown --json bench.json
    python -m tools.bench.bench_norm --threads 1     # single-threaded: steadier on a busy machine

For each (dtype, hidden, tokens) it times, on the same threads:

  ours        ggml_norm.rms_norm(x, w, eps, zero_centered=True): the op alone
  ours layer  transformers' Qwen3_5RMSNorm kernelized (kernels.kernelize) onto our
              RMSNormZeroCentered layer: what a model runs per norm with the kernel
  tf eager    transformers' Qwen3_5RMSNorm as is (no kernel)
  reference   ggml_norm.reference.rms_norm (the package's pure-PyTorch reference)

and the ratios tf eager / ours layer and tf eager / ours (> 1: ours is faster). Each number is the
median of single-call timings, taken in interleaved rounds so that load from elsewhere (this is
a shared 2-core machine) hits every column alike; rerun if the spread looks large.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

from tools import REPO

PACKAGE = REPO / "packages" / "ggml-norm"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernel is a local build; nothing to fetch

import torch  # noqa: E402

from tools.bench.benchutil import keep_freed_memory  # noqa: E402

HIDDEN = [1024, 2560, 4096]
TOKENS = [1, 512]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
EPS = 1e-6
COLUMNS = ["ours", "ours layer", "tf eager", "reference"]


def load_kernel():
    from kernels import get_local_kernel

    if not any((PACKAGE / "build").glob("torch*-cpu-*")):
        sys.exit("ggml-norm is not built: run `python -m tools.build ggml-norm`")
    return get_local_kernel(PACKAGE, backend="cpu")


def kernelized(module):
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    from tools.testing.kernel_testing import (
        variant_dir,  # the CPU build for this torch, whatever torch's backend
    )

    swapped = copy.deepcopy(module)
    repo = LocalLayerRepository(repo_path=variant_dir("ggml-norm"), layer_name="RMSNormZeroCentered")
    with use_kernel_mapping({"RMSNormZeroCentered": {"cpu": repo}}, inherit_mapping=False):
        kernelize(swapped, device="cpu", mode=Mode.INFERENCE)
    assert swapped.forward.__func__.__qualname__ == "RMSNormZeroCentered.forward"
    return swapped


def time_cells(fns: dict, rounds: int, seconds: float, min_calls: int) -> dict[str, float]:
    """Median single-call time (µs) of each fn, over `rounds` interleaved rounds."""
    samples = {name: [] for name in fns}
    for fn in fns.values():  # warm up: allocator, torch's threads, ggml's per-thread state
        for _ in range(10):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t_end, got = time.perf_counter() + seconds, 0
            while got < min_calls or time.perf_counter() < t_end:
                t = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t)
                got += 1
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer timings per cell")
    ap.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads(THREADS) first (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()

    from tabulate import tabulate
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    k = load_kernel()
    rounds, seconds, min_calls = (3, 0.05, 20) if args.quick else (7, 0.15, 50)
    rows, cells = [], []
    with torch.no_grad():
        for dname, dtype in DTYPES.items():
            for hidden in HIDDEN:
                for tokens in TOKENS:
                    gen = torch.Generator().manual_seed(hidden + tokens)
                    module = Qwen3_5RMSNorm(hidden, eps=EPS)
                    module.weight.copy_(torch.randn(hidden, generator=gen) * 0.1)
                    module = module.to(dtype)
                    ours_layer = kernelized(module)
                    x = torch.randn(1, tokens, hidden, generator=gen).to(dtype)
                    w = module.weight
                    fns = {
                        "ours": lambda: k.rms_norm(x, w, EPS, True),
                        "ours layer": lambda: ours_layer(x),
                        "tf eager": lambda: module(x),
                        "reference": lambda: k.reference.rms_norm(x, w, EPS, True),
                    }
                    torch.testing.assert_close(ours_layer(x), module(x), rtol=2**-7, atol=1e-5)
                    t = time_cells(fns, rounds, seconds, min_calls)
                    cells.append({"dtype": dname, "hidden": hidden, "tokens": tokens, "us": t})
                    rows.append([dname, hidden, tokens, *(f"{t[c]:.1f}" for c in COLUMNS),
                                 f"{t['tf eager'] / t['ours layer']:.2f}x", f"{t['tf eager'] / t['ours']:.2f}x"])
                    print(f"  {dname} h={hidden} t={tokens}: " + ", ".join(f"{c} {t[c]:.1f}" for c in COLUMNS),
                          file=sys.stderr)

    headers = ["dtype", "hidden", "tokens", *(f"{c} µs" for c in COLUMNS), "eager/layer", "eager/ours"]
    print(f"\nggml-norm rms_norm (zero-centred, Qwen3_5RMSNorm) - {torch.get_num_threads()} torch threads, "
          f"ggml CPU variant {k.info()['cpu_variant']}; median of single calls")
    print(tabulate(rows, headers=headers, tablefmt="github" if args.markdown else "simple", disable_numparse=True))
    if args.json:
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "info": k.info(), "cells": cells}, indent=1))


if __name__ == "__main__":
    main()

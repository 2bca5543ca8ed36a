"""ggml-attn side by side with transformers' attention paths on this CPU.

Decode (one query) against caches of 128, 512, 4096 and 16384 keys, and a 512-token causal prefill, at
Qwen3.5's full-attention head layout (0.8B: 8 query / 2 KV heads; 4B: 16 / 4; head dim 256), in
float32. Columns: ggml-attn; transformers' `sdpa` (torch SDPA with GQA), its `eager` path
(repeat_kv + matmul + softmax), and the pure-PyTorch reference (float32 compute).

    python -m tools.bench.bench_attn [--quick] [--markdown]
"""

from __future__ import annotations

import argparse
import os

from tools.bench.benchutil import fmt_time, keep_freed_memory, median_time
from tools.testing import kernel_testing

LAYOUTS = {"0.8B": (8, 2, 256), "4B": (16, 4, 256)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cases, shorter timing")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import torch
    from tabulate import tabulate
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.set_num_threads(args.threads)
    keep_freed_memory()
    kernel_testing.point_hub_ids_at_local_builds()
    ga = kernel_testing.load_kernel("ggml-org/ggml-attn")

    class Module(torch.nn.Module):  # what transformers' attention functions read off the layer
        def __init__(self, hq, hkv):
            super().__init__()
            self.num_key_value_groups = hq // hkv
            self.is_causal = True
            self.training = False

    cases = [("decode", 1, n) for n in (128, 512, 4096, 16384)] + [("prefill", 512, 512)]
    layouts = dict(LAYOUTS)
    if args.quick:
        cases, layouts = [cases[0], cases[1], cases[3]], {"0.8B": LAYOUTS["0.8B"]}
    min_time = 0.1 if args.quick else 0.3
    rows = []
    for name, (hq, hkv, d) in layouts.items():
        module = Module(hq, hkv)
        for kind, sq, skv in cases:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, hq, sq, d, generator=g)
            k, v = torch.randn(1, hkv, skv, d, generator=g), torch.randn(1, hkv, skv, d, generator=g)
            scale = d**-0.5
            t_ours = median_time(lambda: ga.flash_attn_forward(module, q, k, v, None, scaling=scale), min_time)
            t_sdpa = median_time(lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale, is_causal=sq > 1), min_time)
            causal_mask = None
            if sq > 1:
                visible = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
                causal_mask = torch.zeros(1, 1, sq, skv).masked_fill(~visible, float("-inf"))
            t_eager = median_time(lambda: eager_attention_forward(module, q, k, v, causal_mask, scaling=scale), min_time)
            t_ref = median_time(lambda: ga.reference.flash_attn(q, k, v, causal=True, compute_dtype=torch.float32), min_time)
            kv_bytes = 2 * k.numel() * 4
            rows.append([name, kind, sq, skv, fmt_time(t_ours), f"{kv_bytes / t_ours / 1e9:.1f}", fmt_time(t_sdpa),
                         fmt_time(t_eager), fmt_time(t_ref), f"{t_sdpa / t_ours:.2f}x", f"{t_eager / t_ours:.2f}x"])
    headers = ["layout", "case", "queries", "keys", "ggml-attn", "KV GB/s", "sdpa", "eager", "reference",
               "vs sdpa", "vs eager"]
    print(f"\nggml-attn, float32, {args.threads} threads, batch 1 (ratios > 1: ggml-attn is faster)")
    print(tabulate(rows, headers, tablefmt="github" if args.markdown else "simple"))


if __name__ == "__main__":
    main()

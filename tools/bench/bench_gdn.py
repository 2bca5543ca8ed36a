"""ggml-gated-delta-net side by side with transformers' eager Qwen3.5 linear attention and the
package's pure-PyTorch reference.

    python -m tools.bench.bench_gdn                 # full table (~1-2 min on 2 cores)
    python -m tools.bench.bench_gdn --quick         # a small subset (< 30 s)
    python -m tools.bench.bench_gdn --markdown --json bench.json

Shapes: Qwen3.5-0.8B's linear-attention block as far as it can be inferred here (no checkpoint is
available offline): hidden 1024, 16 key heads x 128, 16 value heads x 128, conv kernel 4, batch 1.
The full run adds 32 value heads (Qwen3.5's larger models' ratio) as a second shape.

Rows:
  layer decode     the whole Qwen3_5GatedDeltaNet forward for 1 token on a cache (float32 nn.Linear
                   projections on all sides, so the difference is the linear-attention core)
  layer prefill    the same for 512 tokens from an empty cache
  op decode/prefill  gated_delta_net alone (q/k L2-normalised in the op), T = 1 / 512
Columns:
  ours             this package: kernelized layer (kernels' kernelize) / the op
  transformers     transformers 5.22.2's eager module with its torch fallbacks (causal_conv1d_update /
                   causal_conv1d_fn, torch_recurrent_gated_delta_rule for decode, the chunked
                   torch_chunk_gated_delta_rule for prefill), q/k repeated with repeat_interleave
  reference        the package's reference.py (plain per-token loops) in our layer's forward; the
                   512-token prefill loop is skipped with --quick (~1 s a call)

Each number is the median of single-call timings, taken in interleaved rounds (every column timed
in each round) so that load from another process on the box hits every column alike.
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

PACKAGE = REPO / "packages" / "ggml-gated-delta-net"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernel is a local build; nothing to fetch

import torch  # noqa: E402

from tools.bench.benchutil import keep_freed_memory  # noqa: E402

HIDDEN, HK, D, KERNEL = 1024, 16, 128, 4
PREFILL = 512


def load_kernel():
    from kernels import get_local_kernel

    if not any((PACKAGE / "build").glob("torch*-cpu-*")):
        sys.exit("ggml-gated-delta-net is not built: run `python -m tools.build ggml-gated-delta-net`")
    return get_local_kernel(PACKAGE, backend="cpu")


def quiet_transformers():
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("kernels").setLevel(logging.ERROR)


def make_config(hv: int):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=HK,
        linear_num_value_heads=hv, linear_key_head_dim=D, linear_value_head_dim=D, linear_conv_kernel_dim=KERNEL,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584, vocab_size=1024,
    )


class RefOps:
    """The reference's functions under the op names and signatures the layer calls."""

    def __init__(self, ref):
        self.ref = ref

    def causal_conv1d(self, x, w, state, bias, activation):
        return self.ref.causal_conv1d(x, w, state, activation, bias=bias)

    def causal_conv1d_(self, x, w, state, bias, activation):  # decode: the rolling state in place
        y, new_state = self.ref.causal_conv1d(x, w, state, activation, bias=bias)
        state.copy_(new_state)
        return y

    def gates(self, A_log, a, dt_bias, b):
        return self.ref.gates(A_log, a, dt_bias, b)

    def gated_delta_net(self, q, k, v, g, beta, state, l2, scale):
        return self.ref.gated_delta_net(q, k, v, g, beta, state, l2_normalize_qk=l2, scale=scale)

    def gated_delta_net_(self, q, k, v, g, beta, state, l2, scale):  # decode: the state in place
        out, new_state = self.gated_delta_net(q, k, v, g, beta, state, l2, scale)
        state.copy_(new_state)
        return out

    def gated_rms_norm(self, x, z, w, eps):
        return self.ref.gated_rms_norm(x, z, w, eps)


def layer_impls(k, hv: int, tokens: int, with_reference: bool):
    """Callables running one forward of each implementation (each on its own cache)."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    from transformers import DynamicCache
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = make_config(hv)
    torch.manual_seed(0)
    tf = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    ours = copy.deepcopy(tf)
    from tools.testing.kernel_testing import variant_dir

    repo = LocalLayerRepository(repo_path=variant_dir("ggml-gated-delta-net"), layer_name="Qwen3_5GatedDeltaNet")
    with use_kernel_mapping({"Qwen3_5GatedDeltaNet": {"cpu": repo}}):
        kernelize(ours, device="cpu", mode=Mode.INFERENCE)
    forward = k.layers.Qwen3_5GatedDeltaNet.forward
    ref_ops = RefOps(k.reference)

    def reference_forward(x, cache):
        saved = k.layers.ops
        k.layers.ops = ref_ops  # the layer's forward with the reference functions in place of the ops
        try:
            return forward(tf, x, cache_params=cache)
        finally:
            k.layers.ops = saved

    x = torch.randn(1, tokens, HIDDEN)
    impls = {"ours": lambda c: ours(x, cache_params=c), "transformers": lambda c: tf(x, cache_params=c)}
    if with_reference:
        impls["reference"] = lambda c: reference_forward(x, c)
    out = {}
    for name, fn in impls.items():
        if tokens == 1:  # decode on a cache that holds a 32-token prompt
            cache = DynamicCache(config=config)
            with torch.no_grad():
                (ours if name == "ours" else tf)(torch.randn(1, 32, HIDDEN), cache_params=cache)
            out[name] = (lambda fn=fn, cache=cache: fn(cache))
        else:  # prefill from an empty cache, as generate() does
            out[name] = (lambda fn=fn: fn(DynamicCache(config=config)))
    return out


def op_impls(k, hv: int, tokens: int, with_reference: bool):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    gen = torch.Generator().manual_seed(1)
    q, kk = torch.randn(1, tokens, HK, D, generator=gen), torch.randn(1, tokens, HK, D, generator=gen)
    v = torch.randn(1, tokens, hv, D, generator=gen)
    g, beta = -torch.rand(1, tokens, hv, generator=gen), torch.rand(1, tokens, hv, generator=gen)
    state = torch.randn(1, hv, D, D, generator=gen) * 0.1
    hf_fn = hf.torch_recurrent_gated_delta_rule if tokens == 1 else hf.torch_chunk_gated_delta_rule

    def transformers_op():
        qi, ki = q.repeat_interleave(hv // HK, 2), kk.repeat_interleave(hv // HK, 2)
        return hf_fn(qi, ki, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    impls = {
        "ours": lambda: k.gated_delta_net(q, kk, v, g, beta, state, l2_normalize_qk=True),
        "transformers": transformers_op,
    }
    if with_reference:
        impls["reference"] = lambda: k.reference.gated_delta_net(q, kk, v, g, beta, state, l2_normalize_qk=True)
    return impls


def time_impls(impls: dict, rounds: int, min_time: float, min_calls: int) -> dict[str, float]:
    samples = {name: [] for name in impls}
    with torch.no_grad():
        for fn in impls.values():  # warmup: thread pools, allocator, caches
            fn()
            fn()
        for _ in range(rounds):
            for name, fn in impls.items():
                t_end, got = time.perf_counter() + min_time / rounds, 0
                while got < max(1, min_calls // rounds) or time.perf_counter() < t_end:
                    t = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t)
                    got += 1
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small subset that runs in under 30 s")
    p.add_argument("--json", metavar="PATH", help="also write the raw results here")
    p.add_argument("--markdown", action="store_true", help="print the table as GitHub markdown")
    p.add_argument("--threads", type=int, default=None, help="threads for every implementation (default: torch's)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of timed calls per column and row (default 1, quick 0.3)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per row (default 4)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    args.threads = torch.get_num_threads()
    if args.min_time is None:
        args.min_time = 0.3 if args.quick else 1.0

    from tabulate import tabulate

    quiet_transformers()
    k = load_kernel()
    info = k.info()
    print(f"ggml-gated-delta-net, ggml {info['ggml']} ({info['cpu_variant']}), torch {torch.__version__}, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}", file=sys.stderr)
    load0 = os.getloadavg()[0]
    if load0 > 0.5:
        print(f"warning: load average {load0:.2f} before starting: other processes share these cores, expect noise",
              file=sys.stderr)

    value_heads = [16] if args.quick else [16, 32]
    plan = []
    for hv in value_heads:
        plan += [("layer decode", hv, 1), ("layer prefill", hv, PREFILL), ("op decode", hv, 1), ("op prefill", hv, PREFILL)]
    columns = ["ours", "transformers", "reference"]
    rows, raw = [], []
    t0 = time.perf_counter()
    for what, hv, tokens in plan:
        with_ref = tokens == 1 or not args.quick
        make = layer_impls if what.startswith("layer") else op_impls
        impls = make(k, hv, tokens, with_ref)
        slow = tokens > 1  # prefill calls take 10-1000 ms: fewer of them
        times = time_impls(impls, args.rounds, args.min_time * (2 if slow else 1), 8 if slow else 200)
        raw.append({"case": what, "value_heads": hv, "tokens": tokens, "ms": times})
        cell = lambda c: f"{times[c]:.3f}" if c in times else "skipped"  # noqa: E731
        ratio = lambda c: f"{times[c] / times['ours']:.2f}x" if c in times else "-"  # noqa: E731
        rows.append([f"{what} (T={tokens})", f"{HK}x{D} / {hv}x{D}", *[cell(c) for c in columns],
                     ratio("transformers"), ratio("reference")])
        print(f"  [{time.perf_counter() - t0:5.1f} s] {rows[-1][0]}, Hv={hv} done", file=sys.stderr)

    headers = ["case", "k / v heads", "ours ms", "transformers ms", "reference ms", "transformers / ours", "reference / ours"]
    print(f"\nggml-gated-delta-net: Qwen3.5 linear attention (hidden {HIDDEN}, conv kernel {KERNEL}), batch 1, float32, "
          f"{args.threads} threads; median of single-call times")
    print(tabulate(rows, headers=headers, tablefmt="github" if args.markdown else "simple", disable_numparse=True))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "info": info, "results": raw}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A decode step's (or a short prompt's) products alone, in the step's order: ours against ggml's
own op, alternating.

Takes a GGUF file's packed linears (its real bytes, each weight in a fresh allocation, as the loader
holds them) and times one forward's worth of products over `--rows` activation rows (1: a decode
step, the default; more: a prompt of that many tokens, whose output head still takes one row, as
`logits_to_keep=1` asks) in the order a forward runs them, each weight read once per forward (so
from memory, as in the model, not from the cache):
- ours as the integration calls them: a block's siblings that read one activation (q/k/v, gate/up,
  Qwen3.5's linear-attention inputs) in one `mul_mat_group`, every other weight one `mul_mat_vec`
  (one row) or `mul_mat` (more), through the package's functions, so with its dense-prefill policy;
- ggml's own `GGML_OP_MUL_MAT`, one one-op graph per weight on a persistent threadpool (llama-cpp-
  python's libggml through tools/testing/ggml_ctypes.py), which is what llama.cpp runs per weight.
Rounds alternate the two sides (the order swapped every round) and report each side's median ms per
step and the median of ggml's time / ours (above 1 ours is faster), per group kind and in all. What
a whole step adds beyond its products (attention, norms, Python) is `step_profile`'s to show.

    python -m tools.bench.step_products --gguf SmolLM2-135M-Instruct.Q4_1.gguf --threads 2
    python -m tools.bench.step_products --gguf qwen35-0.8b.Q4_K_M.gguf --rows 16
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

from tools import REPO

# per block, in the order a step calls them: (kind, tensor names read from one activation)
STEP_GROUPS = (
    ("attn q/k/v", ("attn_q", "attn_k", "attn_v")),
    ("linear-attn inputs", ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")),
    ("attn output", ("attn_output",)),
    ("linear-attn output", ("ssm_out",)),
    ("ffn gate/up", ("ffn_gate", "ffn_up")),
    ("ffn down", ("ffn_down",)),
)
HEAD = "output head"
DENSE_TYPES = {0, 1}  # F32 / F16: norms and such, not products


def packed_linears(path: Path):
    """[(kind, [(blocks, ggml_type, cols, rows), ...]), ...] in step order, then the output head."""
    import gguf
    import torch

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def weight(name):
        t = tensors.get(name + ".weight")
        if t is None or int(t.tensor_type) in DENSE_TYPES or len(t.shape) != 2:
            return None
        rows = int(t.shape[1])
        blocks = torch.empty(rows, t.data.size // rows, dtype=torch.uint8)  # torch's aligned allocation
        blocks.numpy()[...] = t.data.reshape(rows, -1)
        return blocks, int(t.tensor_type), int(t.shape[0]), int(t.shape[1])

    blocks = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"blk\.(\d+)\.", n))})
    step = []
    for b in blocks:
        for kind, names in STEP_GROUPS:
            found = [w for n in names if (w := weight(f"blk.{b}.{n}")) is not None]
            if found:
                step.append((kind, found))
    head = weight("output") or weight("token_embd")  # tied: the embedding table is the head
    step.append((HEAD, [head]))
    return step


def rows_of(kind: str, rows: int) -> int:
    """Activation rows of a group's products: the output head takes the last token's alone."""
    return 1 if kind == HEAD else rows


def activations(step, rows: int, seed: int = 0) -> list:
    """One float32 activation (rows_of(kind, rows), columns) per group of `step`, both sides' input."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows_of(kind, rows), ws[0][2], generator=gen) for kind, ws in step]


def ours(kernel, step, xs):
    """One call per group, as the integration makes them: mul_mat_group for siblings, mul_mat_vec
    (one row) or mul_mat alone. Each call returns the group's outputs (a list of tensors)."""
    calls = []
    for (kind, ws), x in zip(step, xs, strict=True):
        if len(ws) > 1:
            args = ([w[0] for w in ws], x, [w[1] for w in ws], [w[3] for w in ws])
            calls.append((kind, lambda args=args: kernel.mul_mat_group(*args)))
        else:
            b, t, _, n = ws[0]
            one = kernel.mul_mat_vec if x.shape[0] == 1 else kernel.mul_mat
            calls.append((kind, lambda one=one, b=b, x=x, t=t, n=n: [one(b, x, t, n)]))
    return calls


def _compute(graphs):
    for g in graphs:
        g.compute()
    return graphs


def ggml_ops(step, threads: int, xs):
    """One ggml graph per weight, run one after the other for a group. Each call returns the group's
    graphs (`output()` reads a result)."""
    from tools.testing import ggml_ctypes

    calls = []
    for (kind, ws), x in zip(step, xs, strict=True):
        graphs = []
        for b, t, cols, _ in ws:
            g = ggml_ctypes.MulMat(b.numpy(), t, cols, x.shape[0], threads, borrow=True)
            g.set_input(x.numpy())
            graphs.append(g)
        calls.append((kind, lambda graphs=graphs: _compute(graphs)))
    return calls


def run_step(calls) -> dict[str, float]:
    """ms per kind for one step's calls."""
    ms: dict[str, float] = {}
    for kind, call in calls:
        t0 = time.perf_counter()
        call()
        ms[kind] = ms.get(kind, 0.0) + (time.perf_counter() - t0) * 1e3
    return ms


def alternate(sides: dict, rounds: int) -> dict[str, list[dict[str, float]]]:
    """Each side's ms per kind in every round, after 3 warm-up steps each; the order swaps every round."""
    for calls in sides.values():
        for _ in range(3):
            run_step(calls)
    got: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got[name].append(run_step(sides[name]))
    return got


def table(kinds, got: dict[str, list[dict[str, float]]]) -> list[str]:
    """Lines per kind and in all: each side's median ms, the median of ggml / ours and its quartiles."""
    lines = [f"  {'':22s} {'ours ms':>8s} {'ggml ms':>8s} {'ggml / ours':>12s}  (quartiles)"]
    for kind in [*dict.fromkeys(kinds), "all"]:
        def ms(rnd, kind=kind):
            return sum(rnd.values()) if kind == "all" else rnd[kind]
        o = [ms(rnd) for rnd in got["ours"]]
        g = [ms(rnd) for rnd in got["ggml"]]
        ratios = sorted(b / a for a, b in zip(o, g, strict=True))
        q = len(ratios) // 4
        lines.append(f"  {kind:22s} {statistics.median(o):8.2f} {statistics.median(g):8.2f} "
                     f"{statistics.median(ratios):11.2f}x  ({ratios[q]:.2f}-{ratios[-1 - q]:.2f})")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True, help="a GGUF file (a bare name: in the model cache)")
    ap.add_argument("--threads", type=int, default=None, help="torch's and ggml's threads (default: torch's)")
    ap.add_argument("--rows", type=int, default=1, help="activation rows: 1 a decode step, more a prompt's tokens")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.rounds < 1:
        ap.error("--rows and --rounds must be at least 1")

    import torch
    from kernels import get_local_kernel

    from tools.models import make_gguf

    path = args.gguf if args.gguf.exists() else make_gguf.default_dir() / args.gguf
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = get_local_kernel(REPO / "packages" / "ggml-quantization", backend="cpu")
    step = packed_linears(path)
    xs = activations(step, args.rows)
    got = alternate({"ours": ours(kernel, step, xs), "ggml": ggml_ops(step, torch.get_num_threads(), xs)},
                    args.rounds)
    products = sum(len(ws) for _, ws in step)
    what = "one decode step's" if args.rows == 1 else f"a {args.rows}-token prompt's"
    print(f"{path.name}: {what} {products} products in {len(step)} calls (ours) / {products} "
          f"graphs (ggml), {torch.get_num_threads()} threads, {args.rounds} alternating rounds")
    print("\n".join(table([k for k, _ in step], got)))


if __name__ == "__main__":
    main()

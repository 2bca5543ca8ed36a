"""One-row products on 4 KiB pages against transparent huge pages, ours and ggml's own op, in one
process, alternating.

    python -m tools.bench.huge_pages_ab Q4_K 9216 2560 [--threads N] [--rounds R]

The weight is quantized from random values and copied until the copies overflow the last-level
cache (as the package benchmark streams them); one set of copies is torch's memory, the other
`huge_pages.place`'s. ggml's graphs (`ggml_ctypes.MulMat`, borrowing the memory) read the very same
copies as ours, so each column differs from its neighbour by the pages alone. Prints each
implementation's median and best ms per call over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tools import REPO

COPY_BYTES = 256 << 20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("type")
    ap.add_argument("rows", type=int)
    ap.add_argument("cols", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kernels import get_local_kernel

    from tools.testing import ggml_ctypes

    q = get_local_kernel(REPO / "packages" / "ggml-quantization", backend="cpu")
    t, n, k = int(q.GGMLType[args.type]), args.rows, args.cols
    gen = torch.Generator().manual_seed(0)
    w = q.quantize(torch.randn(n, k, generator=gen) / k**0.5, t)
    x = torch.randn(1, k, generator=gen)
    count = max(1, COPY_BYTES // w.numel())
    small = [w[torch.randperm(n, generator=gen)] for _ in range(count)]
    memories = {"4 KiB pages": small, "huge pages": q.huge_pages.place(small)}
    calls: dict[str, list[Callable[[], object]]] = {}
    for label, copies in memories.items():
        graphs = [ggml_ctypes.MulMat(c.numpy(), t, k, 1, args.threads, borrow=True) for c in copies]
        for g in graphs:
            g.set_input(x.numpy())
        calls[f"ours, {label}"] = [lambda c=c: q.mul_mat_vec(c, x, t, n) for c in copies]
        calls[f"ggml, {label}"] = [g.compute for g in graphs]
    print(f"{args.type} {n}x{k}, one row, {args.threads} thread(s), {count} copies; huge pages "
          f"{'available' if q.huge_pages.available() else 'NOT available: both columns on small pages'}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds):
        for name in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            start = time.perf_counter()
            for call in calls[name]:
                call()
            times[name].append((time.perf_counter() - start) / len(calls[name]) * 1e3)
            ggml_ctypes.pause_threadpools()
    for name, ms in times.items():
        print(f"  {name:22s} median {statistics.median(ms):.3f} ms  best {min(ms):.3f} ms")


if __name__ == "__main__":
    main()

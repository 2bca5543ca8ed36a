"""ggml-quantization's matrix products side by side with ggml's own op, transformers' CPU path and
the memory roofline.

    python -m tools.bench.bench_quantization                 # full table (~5-10 min on 2 cores)
    python -m tools.bench.bench_quantization --quick         # a small subset (< 1 min)
    python -m tools.bench.bench_quantization --markdown --json bench.json

For each (weight shape N x K, ggml type, M activation rows) it times, on the same threads:

  ours      ggml-quantization: mul_mat_vec for M <= 8, mul_mat above (a one-op ggml graph on
            our persistent ggml threadpool)
  ggml      ggml's own GGML_OP_MUL_MAT, built and run through llama-cpp-python's libggml
            (tools/testing/ggml_ctypes.py): one-op graph planned once, only ggml_graph_compute timed
  tf f32 / tf bf16
            what transformers 5.x runs per forward on CPU when it has no kernel: it dequantizes
            the whole GGUF at load and keeps dense weights, so each token is a dense
            F.linear (float32 by default, bfloat16 if the model is loaded in it)
  tf unpack (M > 8 only)
            what transformers runs per forward on CPU *with* the kernel installed: GgufLinear
            keeps the blocks packed, calls the kernel's gemv only for M <= 8, and above that
            dequantizes the packed weight with its own torch code on every call, then matmuls
  roofline  weight bytes / measured DRAM read bandwidth: the fastest any M=1 product can be

Weights are streamed from memory, as in a real decode: every cell cycles through enough copies
of its weight to overflow the last-level cache (--hot times one cache-resident copy instead).
Each number is the median (--stat) of single-call timings over >= --min-time seconds after a
warmup, taken in --rounds interleaved rounds so that load from elsewhere hits every column alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools import REPO

PACKAGE = REPO / "packages" / "ggml-quantization"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernel is a local build; nothing to fetch

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tools.bench.benchutil import keep_freed_memory  # noqa: E402
from tools.testing import ggml_ctypes  # noqa: E402

# Qwen3.5 linear shapes, (rows = out features N, cols = in features K)
MATVEC_SHAPES = [(1024, 1024), (3584, 1024), (1024, 3584), (2560, 9216), (9216, 2560)]
MATMAT_SHAPES = [(3584, 1024), (1024, 3584), (9216, 2560)]
TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]
MATVEC_M = [1, 8]
MATMAT_M = [64, 512]

QUICK_MATVEC_SHAPES = [(1024, 1024), (2560, 9216)]
QUICK_MATMAT_SHAPES = [(1024, 3584)]
QUICK_TYPES = ["Q4_0", "Q4_K"]
QUICK_MATVEC_M = [1]
QUICK_MATMAT_M = [64]

MAX_COPIES = 256
# after our calls, our ggml threadpool's workers keep polling for ~0.2 s (ggml's poll level 50);
# let them fall asleep before timing anything else, so no implementation pays for another's spin
SETTLE_AFTER_OURS_S = 0.3
SETTLE_S = 0.03
NOISY = 0.10  # other processes' share of the CPU above which a cell is timed again (--retries)


@dataclass
class Cell:
    rows: int
    cols: int
    type: str
    m: int
    weight_bytes: int
    copies: int
    times_us: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    other_load: float | None = None  # CPU share other processes used while this cell was timed


# ---- helpers ---------------------------------------------------------------------------------

def load_kernel():
    from tools.testing import kernel_testing

    kernel_testing.point_hub_ids_at_local_builds()
    return kernel_testing.load_kernel("ggml-org/ggml-quantization")


def llc_bytes() -> int:
    """Largest CPU cache, from sysfs (32 MiB when it cannot be read)."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            s = f.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            best = max(best, int(s.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or (32 << 20)


def measure_bandwidth(gib: float, repeats: int = 5) -> float:
    """DRAM read bandwidth in GB/s: full reads of a buffer far larger than cache, done two ways (a
    sum and a dot product, on torch's threads); the better way's median of `repeats` reads."""
    n = int(gib * (1 << 30)) // 4
    buf = torch.rand(n, dtype=torch.float32)  # random: pages of equal bytes could be deduplicated
    best = math.inf
    for read in (lambda: buf.sum(), lambda: torch.dot(buf, buf)):
        read()  # fault the pages in, start torch's threads
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            read()
            times.append(time.perf_counter() - t)
        best = min(best, statistics.median(times))
    return n * 4 / best / 1e9


class Timer:
    """Single-call timings of one implementation, cycling through `fns` (one per weight copy)."""

    def __init__(self, fns):
        self.fns, self.i, self.samples = fns, 0, []

    def warmup(self, seconds: float) -> None:
        # every copy once (pages faulted, caches in steady state), and at least `seconds`
        t_end = time.perf_counter() + seconds
        while self.i < max(len(self.fns), 2) or time.perf_counter() < t_end:
            self.fns[self.i % len(self.fns)]()
            self.i += 1

    def run(self, seconds: float, min_calls: int) -> None:
        n, got = len(self.fns), 0
        t_end = time.perf_counter() + seconds
        while got < min_calls or time.perf_counter() < t_end:
            f = self.fns[self.i % n]
            self.i += 1
            t = time.perf_counter()
            f()
            self.samples.append(time.perf_counter() - t)
            got += 1

    def stat(self, how: str) -> float:
        s = sorted(self.samples)
        return statistics.median(s) if how == "median" else s[0] if how == "min" else s[len(s) // 10]


class OtherLoad:
    """Share of the machine's CPU time that other processes used since start(): /proc/stat's busy
    time minus this process's own. Noise from outside shows up here, so each cell reports it."""

    def __init__(self):
        self.ok = Path("/proc/stat").exists()
        self.ncpu = os.cpu_count() or 1

    @staticmethod
    def _busy_s() -> float:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        if self.ok:
            self.t0, self.b0, self.p0 = time.perf_counter(), self._busy_s(), time.process_time()

    def stop(self) -> float | None:
        if not self.ok:
            return None
        wall = time.perf_counter() - self.t0
        others = (self._busy_s() - self.b0) - (time.process_time() - self.p0)
        return max(0.0, others / (wall * self.ncpu))


def n_copies(nbytes: int, rotate_bytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(rotate_bytes / max(1, nbytes))))


def transformers_linear_cls(kernel):
    """transformers' GgufLinear, wired to this kernel the way transformers wires the Hub one."""
    try:
        import transformers.integrations.gguf.kernels as tk
        from transformers.integrations.gguf.utils import GgufLinear
    except ImportError:
        return None
    tk._gguf_kernel = tk.GgufKernel(kernel)
    return GgufLinear


# ---- one cell --------------------------------------------------------------------------------

def run_cell(k, GgufLinear, rows, cols, type_name, m, args, rotate_bytes) -> Cell:
    t = int(k.GGMLType[type_name])
    gen = torch.Generator().manual_seed(rows * 31 + cols)
    w = torch.randn(rows, cols, generator=gen)
    q = k.quantize(w, t)
    del w
    wbytes = q.numel()
    copies = n_copies(wbytes, rotate_bytes)
    # copies hold their rows in different orders: byte-identical pages could be merged by the host
    # (KSM and the like) and would then be read from cache, not memory
    qs = [q] + [q[torch.randperm(rows, generator=gen)] for _ in range(copies - 1)]
    x = torch.randn(m, cols, generator=gen)
    cell = Cell(rows, cols, type_name, m, wbytes, copies)
    impls: dict[str, tuple[list, float]] = {}  # name -> (one callable per copy, settle seconds after)
    keep = []  # what the callables need alive

    # ours
    op = k.mul_mat_vec if m <= 8 else k.mul_mat
    impls["ours"] = ([lambda b=b: op(b, x, t, rows) for b in qs], SETTLE_AFTER_OURS_S)

    # ggml's own op
    if ggml_ctypes.available():
        graphs = [ggml_ctypes.MulMat(b.numpy(), t, cols, m, args.threads) for b in qs]
        for g in graphs:
            g.set_input(x.numpy())
        keep.append(graphs)
        impls["ggml"] = ([g.compute for g in graphs], SETTLE_S)

    # transformers without a kernel: dense weights made at load, F.linear per call
    dense = k.dequantize(q, t, rows, cols, torch.float32)
    for name, dtype in (("tf_f32", torch.float32), ("tf_bf16", torch.bfloat16)):
        d0 = dense.to(dtype)
        nd = n_copies(d0.numel() * d0.element_size(), rotate_bytes)
        ds = [d0] + [d0[torch.randperm(rows, generator=gen)] for _ in range(nd - 1)]
        xd = x.to(dtype)
        impls[name] = ([lambda d=d, xd=xd: F.linear(xd, d) for d in ds], SETTLE_S)
    del dense

    # transformers with the kernel, M > 8: GgufLinear unpacks with its own torch code per call
    if m > 8 and GgufLinear is not None:
        mods = []
        for b in qs[:4]:  # compute-bound: a few copies are plenty
            lin = GgufLinear(cols, rows, t)
            lin.weight = torch.nn.Parameter(b, requires_grad=False)
            mods.append(lin)

        def unpack(lin):
            with torch.inference_mode():
                return lin(x)

        impls["tf_unpack"] = ([lambda lin=lin: unpack(lin) for lin in mods], SETTLE_S)

    # interleaved rounds, so a burst of load from elsewhere on the machine hits every column alike
    timers = {name: Timer(fns) for name, (fns, _) in impls.items()}
    per_round = args.min_time / args.rounds
    load = OtherLoad()
    load.start()
    for r in range(args.rounds):
        for name, (_, settle) in impls.items():
            if r == 0:
                timers[name].warmup(args.min_time / 5)
            timers[name].run(per_round, min_calls=2)
            time.sleep(settle)
    cell.other_load = load.stop()
    for name, tm in timers.items():
        cell.times_us[name] = tm.stat(args.stat) * 1e6
        cell.calls[name] = len(tm.samples)

    for g in keep[0] if keep else []:
        g.close()
    del impls, timers, keep, qs, q
    gc.collect()
    return cell


# ---- report ----------------------------------------------------------------------------------

def fmt_us(v):
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def fmt_x(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}x"


def rows_for_table(cells: list[Cell], bw: float):
    out = []
    for c in cells:
        tt = c.times_us
        ours = tt["ours"]
        roof = c.weight_bytes / (bw * 1e9) * 1e6

        def ratio(name):
            return tt[name] / ours if name in tt else None

        out.append([
            f"{c.rows}x{c.cols}", c.type, c.m, f"{c.weight_bytes / 1e6:.2f}",
            fmt_us(ours), f"{c.weight_bytes / ours / 1e3:.1f}",
            fmt_us(tt.get("ggml")), f"{c.weight_bytes / tt['ggml'] / 1e3:.1f}" if "ggml" in tt else "-",
            fmt_x(ratio("ggml")),
            fmt_us(tt.get("tf_f32")), fmt_us(tt.get("tf_bf16")), fmt_us(tt.get("tf_unpack")),
            fmt_x(ratio("tf_f32"), 1), fmt_x(ratio("tf_bf16"), 1), fmt_x(ratio("tf_unpack"), 1),
            fmt_us(roof), f"{100 * roof / ours:.0f}%",
            "-" if c.other_load is None else f"{100 * c.other_load:.0f}%",
        ])
    return out


HEADERS = [
    "W (NxK)", "type", "M", "W MB",
    "ours us", "ours GB/s", "ggml us", "ggml GB/s", "ours/ggml speed",
    "tf f32 us", "tf bf16 us", "tf unpack us",
    "vs tf f32", "vs tf bf16", "vs tf unpack",
    "roofline us", "ours % roof", "others' CPU",
]

LEGEND = """\
ours/ggml speed = ggml time / ours time (target >= 0.90x). vs tf * = transformers time / ours time
(target >= 10x at M=1). tf f32 / tf bf16: transformers on CPU without a kernel dequantizes at load and
runs a dense F.linear per call. tf unpack (M > 8): transformers on CPU with the kernel keeps the
weight packed and dequantizes it with torch ops on every call before the matmul. roofline = weight
bytes / measured DRAM read bandwidth; GB/s = weight bytes / time. others' CPU = share of the machine
that other processes used while the cell ran: above ~10% its numbers are noise, not kernels."""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small subset that runs in under a minute")
    p.add_argument("--json", metavar="PATH", help="also write the raw results here")
    p.add_argument("--markdown", action="store_true", help="print the table as GitHub markdown")
    p.add_argument("--threads", type=int, default=None, help="threads for every implementation (default: torch's)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of timed calls per cell (default 0.2, quick 0.1)")
    p.add_argument("--hot", action="store_true", help="time one cache-resident weight copy instead of streaming")
    p.add_argument("--retries", type=int, default=None,
                   help="re-time a cell up to this many times while other processes used > 10%% of the CPU "
                        "(default 2, quick 0)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per cell (default 4)")
    p.add_argument("--stat", choices=["median", "p10", "min"], default="median",
                   help="statistic of the single-call times (default median; p10/min resist load from elsewhere)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    args.threads = torch.get_num_threads()
    if args.min_time is None:
        args.min_time = 0.1 if args.quick else 0.2
    if args.retries is None:
        args.retries = 0 if args.quick else 2

    from tabulate import tabulate

    t_start = time.perf_counter()
    k = load_kernel()
    GgufLinear = transformers_linear_cls(k)
    bw_gib = 0.5 if args.quick else 1.0
    bw = measure_bandwidth(bw_gib)
    llc = llc_bytes()
    rotate_bytes = 0 if args.hot else max(4 * llc, 64 << 20)
    print(f"ggml-quantization {k.info()['ggml']} ({k.info()['cpu_variant']}), torch {torch.__version__}, "
          f"{args.threads} threads, {platform.processor() or platform.machine()}", file=sys.stderr)
    print(f"DRAM read bandwidth {bw:.1f} GB/s (median of 5 reads of a {bw_gib:g} GiB buffer, better of sum/dot); "
          f"LLC {llc >> 20} MiB; weights {'cache-resident (--hot)' if args.hot else f'cycled over >= {rotate_bytes >> 20} MiB of copies'}",
          file=sys.stderr)
    load0 = os.getloadavg()[0]
    if load0 > 0.5:
        print(f"warning: load average {load0:.2f} before starting: other processes share these cores, expect noise",
              file=sys.stderr)
    if not ggml_ctypes.available():
        print(f"no ggml column: {ggml_ctypes.unavailable_reason()}", file=sys.stderr)
    if GgufLinear is None:
        print("no tf unpack column: transformers is not installed", file=sys.stderr)

    mv_shapes, mm_shapes = (QUICK_MATVEC_SHAPES, QUICK_MATMAT_SHAPES) if args.quick else (MATVEC_SHAPES, MATMAT_SHAPES)
    types = QUICK_TYPES if args.quick else TYPES
    mv_m, mm_m = (QUICK_MATVEC_M, QUICK_MATMAT_M) if args.quick else (MATVEC_M, MATMAT_M)
    plan = [(s, ty, m) for m in mv_m for s in mv_shapes for ty in types]
    plan += [(s, ty, m) for m in mm_m for s in mm_shapes for ty in types]

    cells = []
    for i, ((rows, cols), ty, m) in enumerate(plan, 1):
        c = None
        for _ in range(1 + max(0, args.retries)):  # keep the attempt least disturbed from outside
            attempt = run_cell(k, GgufLinear, rows, cols, ty, m, args, rotate_bytes)
            if c is None or (attempt.other_load or 0) < (c.other_load or 0):
                c = attempt
            if c.other_load is None or c.other_load <= NOISY:
                break
        cells.append(c)
        ratio = c.times_us["ggml"] / c.times_us["ours"] if "ggml" in c.times_us else float("nan")
        busy = "" if c.other_load is None else f", others' CPU {100 * c.other_load:.0f}%"
        print(f"[{i}/{len(plan)}] {rows}x{cols} {ty} M={m}: ours {c.times_us['ours']:.1f} us, "
              f"ours/ggml {ratio:.2f}x{busy}", file=sys.stderr)

    # once more at the end: a shared machine's bandwidth varies, and the roofline wants the best
    bw_end = measure_bandwidth(bw_gib)
    print(f"DRAM read bandwidth at the end {bw_end:.1f} GB/s (start {bw:.1f}); roofline uses the higher",
          file=sys.stderr)
    bw = max(bw, bw_end)
    table = tabulate(rows_for_table(cells, bw), headers=HEADERS, tablefmt="github" if args.markdown else "simple",
                     disable_numparse=True, colalign=["left", "left"] + ["right"] * (len(HEADERS) - 2))
    print(table)
    print()
    print(LEGEND)
    ratios = [c.times_us["ggml"] / c.times_us["ours"] for c in cells if "ggml" in c.times_us]
    if ratios:
        slow = [c for c in cells if "ggml" in c.times_us and c.times_us["ggml"] / c.times_us["ours"] < 0.9]
        print(f"\nours/ggml: geometric mean {math.exp(statistics.fmean(math.log(r) for r in ratios)):.2f}x, "
              f"min {min(ratios):.2f}x; {len(slow)} of {len(ratios)} cells below 0.90x"
              + ("".join(f"\n  below: {c.rows}x{c.cols} {c.type} M={c.m}" for c in slow)))
    def geo(xs):
        return math.exp(statistics.fmean(math.log(v) for v in xs))

    for col in ("tf_f32", "tf_bf16"):
        sp = [c.times_us[col] / c.times_us["ours"] for c in cells if c.m == 1 and col in c.times_us]
        if sp:
            print(f"M=1 speedup vs {col}: geometric mean {geo(sp):.1f}x, range {min(sp):.1f}x-{max(sp):.1f}x")
    noisy = [c for c in cells if c.other_load is not None and c.other_load > NOISY]
    if noisy:
        print(f"{len(noisy)} cells ran while other processes used > {NOISY:.0%} of the CPU; their numbers are unreliable")
    elapsed = time.perf_counter() - t_start
    print(f"({elapsed:.0f} s; {args.stat} of single calls; load average {load0:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end, DRAM {bw:.1f} GB/s)")

    if args.json:
        payload = {
            "meta": {
                "ggml": k.info(), "oracle": ggml_ctypes.info() if ggml_ctypes.available() else None,
                "torch": torch.__version__, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
                "bandwidth_gbs": bw, "llc_bytes": llc, "rotate_bytes": rotate_bytes, "min_time_s": args.min_time,
                "quick": args.quick, "elapsed_s": elapsed, "stat": args.stat, "rounds": args.rounds,
                "loadavg_start": load0, "loadavg_end": os.getloadavg()[0],
                "transformers_path": "M<=8: kernel gemv; without a kernel: dense weights made at load (tf_f32/tf_bf16); "
                                     "M>8 with the kernel on CPU: per-call torch dequantize + matmul (tf_unpack)",
            },
            "cells": [dict(asdict(c), roofline_us=c.weight_bytes / (bw * 1e9) * 1e6) for c in cells],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

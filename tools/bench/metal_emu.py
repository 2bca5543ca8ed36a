"""Time per call of ops on the emulated Metal device (upstream's host code and translated kernels,
each GPU thread a fiber; tools/build/metal_runtime.py). Verification, not speed: these numbers say
how big a shape a test can afford, nothing about a Mac.

    python -m tools.bench.metal_emu [--calls 5]      # a markdown table on stdout

`nox -s bench` writes it to bench-results/metal-emu.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np

from tools.testing.metal_host import MetalHost

F32, Q4_K, I32 = 0, 12, 26


def workloads(host: MetalHost) -> dict:
    """name -> graph builder, on random data (the kernel each takes is in the table)."""
    rng = np.random.default_rng(0)
    k, n = 1024, 256
    w = host.quantize(Q4_K, rng.standard_normal((n, k)).astype(np.float32))
    experts = host.quantize(Q4_K, rng.standard_normal((4 * n, k)).astype(np.float32))
    x = {rows: rng.standard_normal((rows, k)).astype(np.float32).tobytes() for rows in (1, 4, 32)}
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(32)]).astype(np.int32).tobytes()
    return {
        f"rms_norm {k} x 32": lambda g: g.rms_norm(g.input(F32, x[32], k, 32)),
        f"Q4_K {n}x{k} mat-vec, 1 row": lambda g: g.mul_mat(g.input(Q4_K, w, k, n), g.input(F32, x[1], k, 1)),
        f"Q4_K {n}x{k} mat-vec-ext, 4 rows": lambda g: g.mul_mat(g.input(Q4_K, w, k, n), g.input(F32, x[4], k, 4)),
        f"Q4_K {n}x{k} mat-mat, 32 rows": lambda g: g.mul_mat(g.input(Q4_K, w, k, n), g.input(F32, x[32], k, 32)),
        f"Q4_K MoE 4 experts {n}x{k}, 32 tokens x 2": lambda g: g.mul_mat_id(
            g.input(Q4_K, experts, k, n, 4), g.input(F32, x[32], k, 1, 32), g.input(I32, ids, 2, 32)),
        f"get_rows Q4_K {n}x{k}, 4 rows": lambda g: g.get_rows(
            g.input(Q4_K, w, k, n), g.input(I32, np.array([0, 5, 9, 255], np.int32).tobytes(), 4)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    host = MetalHost()
    rows = []
    for name, build in workloads(host).items():
        found = host.compute(build)  # warm-up, and the kernels it takes
        if found.error:
            raise SystemExit(f"{name}: {found.error}")
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            host.compute(build)
            times.append(time.perf_counter() - t)
        kernels = ", ".join(dict.fromkeys(d["kernel"] for d in found.dispatches))
        grid = sum(d["grid"][0] * d["grid"][1] * d["grid"][2] for d in found.dispatches)
        rows.append(f"| {name} | {kernels} | {grid} | {statistics.median(times) * 1e3:.1f} |")
    print(f"{datetime.date.today()}, {platform.machine()} {platform.system()}; median ms per call over {args.calls} "
          "calls (graph build, transfers and the emulated dispatches) (`python -m tools.bench.metal_emu`)\n")
    print("| workload | kernels | threadgroups | ms |\n|---|---|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

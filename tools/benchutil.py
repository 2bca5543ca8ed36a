"""Timing helpers shared by the benchmark scripts (tools/bench_*.py) and the demo."""

from __future__ import annotations

import statistics
import time


def median_time(fn, min_time: float = 0.3, min_runs: int = 5, max_runs: int = 10_000) -> float:
    """Median wall time of fn() in seconds, after one warm-up call, over at least `min_runs` runs
    and `min_time` seconds. Medians resist the noise of a shared 2-core machine."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"

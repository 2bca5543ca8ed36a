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


def keep_freed_memory() -> None:
    """Make glibc keep freed memory for reuse (no mmap below 32 MiB, no trimming of the heap's top),
    for the whole process; call once before timing.

    A benchmark alternates implementations whose outputs and temporaries (MiBs at prefill sizes)
    differ, and that defeats glibc's adaptive mmap threshold: every call then gets fresh pages from
    the system. Measured (scratch A/B, not kept): transformers' eager RMSNorm at 512x2560 float32
    3.4 ms in tools/bench/bench_norm.py against 0.22 ms in a process of its own; an ours+eager pair 3402 us
    by default, 652 us with these settings; transformers' unpacking matmul 1024x3584 Q4_K M=64 in
    tools/bench/bench_quantization.py 20.2 -> 7.3 ms. In a model the sizes repeat and glibc settles (~4 page
    faults a decode step on SmolLM2, no change in tokens/s with these settings), so the tables
    measure kernels, not the allocator. No-op where the C library has no mallopt."""
    import ctypes

    m_trim_threshold, m_mmap_threshold = -1, -3
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(m_trim_threshold, 1 << 30)
        libc.mallopt(m_mmap_threshold, 32 << 20)
    except (AttributeError, OSError):
        pass

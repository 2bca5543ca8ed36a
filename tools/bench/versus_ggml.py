"""Ours against ggml's own op, in one process, alternating: what `nox -s bench` writes to
bench-results/versus-ggml.md, and the verdict of `nox -s bench -- --check`.

Every package benchmark script (packages/<name>/benchmarks/benchmark*.py) names its Benchmark classes
`<Op>` for the package's kernel and `<Op>_ggml` for ggml's own op (llama-cpp-python's libggml through
tools/testing/ggml_ctypes.py, or a package's graph of ggml ops). Each pair is timed on every workload
both define. Both are set up as kernels' runner sets them up (the kernel loaded once per package by
`kernels.get_local_kernel` on the package folder, the class's seed, setup_<workload>), both outputs
are checked against verify_<workload> with the runner's tolerance (so a wrong ggml graph fails
loudly), both are warmed up, and then timed in alternating rounds: a round is k calls of one side
timed, then k calls of the other, and the order is swapped every round, so a neighbour's load or a
clock change lands on both sides. Reported per workload: the median over rounds of
(ggml's time / ours) -- above 1 ours is faster -- and each side's median ms per call.

--controls also times each side against a second instance of itself (A/A: the same class set up
again, reading the same weight copies), in the same alternating rounds: the ratio that the harness
alone gives on this machine for that workload, printed beside each ggml / ours. A pair of sides
that run the same code reads 1.00x only within that spread; the verdict still judges ggml / ours.

    python -m tools.bench.versus_ggml [PACKAGE ...] [--check] [--quick] [--controls] [--threads N]
        [--rounds R] [--only REGEX] [--output FILE]

--check is a benchmark verdict for a maintainer on a new CPU, not a test: it exits 1 when a product
(ggml-quantization) or norm (ggml-norm) workload is below 0.95x ggml; the other ops are reported and
not judged. --quick (or GGML_KERNELS_BENCH_QUICK=1) runs the scripts' quick workloads and fewer,
shorter rounds. Both sides run on torch's thread count (`--threads` sets it), which the ggml classes
pass to their graphs. --only REGEX times the workloads whose `<Op>.<workload>` it matches (searched),
e.g. the 40 one-to-eight-row products on two shapes:
`--only 'MulMatVec[.]q(4_0|4_1|4_k|6_k|8_0)_(9216x2560|2560x9216)_m[1248]$'`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tools import REPO

GGML_SUFFIX = "_ggml"
# package -> what its workloads are, for the packages --check judges
JUDGED = {"ggml-quantization": "product", "ggml-norm": "norm"}
THRESHOLD = 0.95
ATOL = 1e-2  # kernels' runner's tolerance for verify_*
QUICK_ENV = "GGML_KERNELS_BENCH_QUICK"


@dataclass
class Settings:
    rounds: int = 9
    warmup: int = 3
    block_ms: float = 20.0  # each side's k calls of a round last about this long
    max_calls: int = 2000
    controls: bool = False  # also each side against itself (A/A)


QUICK = Settings(rounds=5, warmup=2, block_ms=8.0)


# ---- pairing ---------------------------------------------------------------------------------

def workloads(cls: type) -> set[str]:
    """The workloads a Benchmark class times: its benchmark_<workload> methods."""
    return {name.removeprefix("benchmark_") for name in dir(cls)
            if name.startswith("benchmark_") and callable(getattr(cls, name))}


@dataclass
class Pair:
    op: str
    ours: type
    ggml: type
    workloads: list[str]


def pair_classes(classes: Iterable[type]) -> list[Pair]:
    """Every `<Op>` with its `<Op>_ggml`, on the workloads both define (sorted by op)."""
    by_name = {cls.__name__: cls for cls in classes}
    pairs = []
    for name in sorted(by_name):
        op = name.removesuffix(GGML_SUFFIX)
        if op == name or op not in by_name:
            continue
        shared = sorted(workloads(by_name[op]) & workloads(by_name[name]))
        if shared:
            pairs.append(Pair(op, by_name[op], by_name[name], shared))
    return pairs


# ---- timing ----------------------------------------------------------------------------------

@dataclass
class Timing:
    """ms per call of each side, one value per round."""

    ours_ms: list[float] = field(default_factory=list)
    ggml_ms: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Median over rounds of ggml's time / ours (above 1: ours is faster)."""
        return statistics.median(g / o for o, g in zip(self.ours_ms, self.ggml_ms, strict=True))

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours_ms)

    @property
    def ggml_median(self) -> float:
        return statistics.median(self.ggml_ms)


def _block_ms(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) * 1000 / calls


def alternate(ours: Callable[[], object], ggml: Callable[[], object], rounds: int, calls: int,
              clock: Callable[[], float] = time.perf_counter,
              between: Callable[[], object] = lambda: None) -> Timing:
    """`rounds` rounds of `calls` calls of each side, ours first in even rounds, ggml's first in odd;
    `between()` after every block, untimed."""
    timing = Timing()
    for r in range(rounds):
        sides = [(ours, timing.ours_ms), (ggml, timing.ggml_ms)]
        for fn, times in sides if r % 2 == 0 else reversed(sides):
            times.append(_block_ms(fn, calls, clock))
            between()
    return timing


def idle_ggml_threads() -> None:
    """ggml's side leaves no worker spinning into the next block (ggml_ctypes.pause_threadpools): with
    several threads, its threadpool's polling workers would otherwise hold a core for up to ~100 ms
    after each of its blocks, during ours."""
    try:
        from tools.testing import ggml_ctypes
    except ImportError:
        return
    ggml_ctypes.pause_threadpools()


def calls_per_block(ms_per_call: float, settings: Settings) -> int:
    """k: enough calls for a block of about settings.block_ms (at least 1)."""
    if ms_per_call <= 0 or not math.isfinite(ms_per_call):
        return settings.max_calls
    return max(1, min(settings.max_calls, math.ceil(settings.block_ms / ms_per_call)))


# ---- verdict ---------------------------------------------------------------------------------

@dataclass
class Row:
    package: str
    op: str
    workload: str
    ours_ms: float
    ggml_ms: float
    ratio: float
    rounds: int = 0
    calls: int = 0
    ours_aa: float | None = None  # --controls: a second instance of ours / ours (median over rounds)
    ggml_aa: float | None = None  # ... and of ggml's / ggml's

    @property
    def judged(self) -> bool:
        return self.package in JUDGED

    def verdict(self, threshold: float = THRESHOLD) -> str:
        if not self.judged:
            return "-"
        return "ok" if self.ratio >= threshold else f"BELOW {threshold:.2f}x"


def below(rows: Iterable[Row], threshold: float = THRESHOLD) -> list[Row]:
    """The judged rows under the threshold."""
    return [r for r in rows if r.judged and r.ratio < threshold]


def exit_code(rows: Iterable[Row], threshold: float = THRESHOLD) -> int:
    return 1 if below(rows, threshold) else 0


# ---- running a package -----------------------------------------------------------------------

def load_script(path: Path) -> list[type]:
    """The Benchmark classes a script defines, imported as the runner imports it (cwd: the package)."""
    from kernels.benchmark import Benchmark

    name = f"versus_ggml_{path.parent.parent.name.replace('-', '_')}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    cwd = os.getcwd()
    os.chdir(path.parent.parent)
    try:
        spec.loader.exec_module(module)
    finally:
        os.chdir(cwd)
    return [obj for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, Benchmark) and obj is not Benchmark and obj.__module__ == name]


def prepared(cls: type, kernel, workload: str):
    """An instance set up for `workload` as kernels' runner sets one up, and its timed call."""
    import torch

    instance = cls()
    instance.kernel, instance.device = kernel, "cpu"
    if instance.seed is not None:
        torch.manual_seed(instance.seed)
        random.seed(instance.seed)
    setup = getattr(instance, f"setup_{workload}", None)
    (setup or instance.setup)()
    return instance, getattr(instance, f"benchmark_{workload}")


def verify(instance, workload: str, call: Callable[[], object]) -> None:
    """One call, its output against verify_<workload> (if the class has one), as the runner checks."""
    import torch

    check = getattr(instance, f"verify_{workload}", None)
    if check is None:
        return
    call()
    expected = check()
    if not torch.allclose(instance.out, expected, atol=ATOL):
        worst = (instance.out.float() - expected.float()).abs().max().item()
        raise RuntimeError(f"{type(instance).__name__}.{workload}: output differs from verify_{workload} "
                           f"(max |difference| {worst:.3g}, atol {ATOL})")


def measure(pair: Pair, kernel, workload: str, settings: Settings) -> Row:
    ours, run_ours = prepared(pair.ours, kernel, workload)
    ggml, run_ggml = prepared(pair.ggml, kernel, workload)
    verify(ours, workload, run_ours)
    verify(ggml, workload, run_ggml)
    # k from each side's fastest warm-up call: one preempted call must not shrink every block to 1 call
    warm = [min(_block_ms(fn, 1, time.perf_counter) for _ in range(settings.warmup)) for fn in (run_ours, run_ggml)]
    calls = calls_per_block(max(warm), settings)
    idle_ggml_threads()
    timing = alternate(run_ours, run_ggml, settings.rounds, calls, between=idle_ggml_threads)
    row = Row("", pair.op, workload, timing.ours_median, timing.ggml_median, timing.ratio, settings.rounds, calls)
    if settings.controls:
        row.ours_aa = self_ratio(pair.ours, kernel, workload, run_ours, settings, calls)
        row.ggml_aa = self_ratio(pair.ggml, kernel, workload, run_ggml, settings, calls)
    return row


def self_ratio(cls: type, kernel, workload: str, run: Callable[[], object], settings: Settings, calls: int) -> float:
    """A/A: a second instance of cls set up for `workload`, warmed up as measure() warms the pair,
    timed against `run` (the first) in the same alternating rounds; the median of its time / the first's."""
    _, run_again = prepared(cls, kernel, workload)
    for _ in range(settings.warmup):
        run_again()
    idle_ggml_threads()
    return alternate(run, run_again, settings.rounds, calls, between=idle_ggml_threads).ratio


def selected(pair: Pair, only: re.Pattern | None) -> list[str]:
    """The pair's workloads whose `<Op>.<workload>` `only` matches (all where it is None)."""
    return [w for w in pair.workloads if only is None or only.search(f"{pair.op}.{w}")]


def scripts(package: str) -> list[Path]:
    return sorted((REPO / "packages" / package / "benchmarks").glob("benchmark*.py"))


def run_package(package: str, settings: Settings, log=sys.stderr, only: re.Pattern | None = None) -> list[Row]:
    """Every (op, workload) pair of the package's scripts (`only`'s: `selected`), measured."""
    from kernels import get_local_kernel

    # the CPU build, also under a CUDA build of torch (whose default backend would be its CUDA one)
    kernel = get_local_kernel(REPO / "packages" / package, backend="cpu")
    rows = []
    for script in scripts(package):
        for pair in pair_classes(load_script(script)):
            for workload in selected(pair, only):
                row = measure(pair, kernel, workload, settings)
                row.package = package
                controls = "" if row.ours_aa is None else f", A/A ours {row.ours_aa:.2f}x, ggml {row.ggml_aa:.2f}x"
                print(f"  {package} {pair.op}.{workload}: ours {row.ours_ms:.4f} ms, ggml {row.ggml_ms:.4f} ms, "
                      f"ggml / ours {row.ratio:.2f}x ({row.rounds} rounds of {row.calls}){controls}", file=log, flush=True)
                rows.append(row)
    return rows


# ---- report ----------------------------------------------------------------------------------

def machine() -> dict[str, str]:
    """CPU model, cores and logical CPUs (from /proc/cpuinfo where there is one), torch's threads."""
    import torch

    model, cores = "", set()
    try:
        entry: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            key, _, value = line.partition(":")
            if key.strip():
                entry[key.strip()] = value.strip()
                continue
            model = model or entry.get("model name", "")
            if entry:
                cores.add((entry.get("physical id"), entry.get("core id", len(cores))))
            entry = {}
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"cpu": model or "unknown CPU", "cores": str(len(cores) or os.cpu_count()), "cpus": str(os.cpu_count()),
            "threads": str(torch.get_num_threads()), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "load": f"{load:.1f}"}


def _ms(v: float) -> str:
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def markdown(rows: list[Row], info: dict[str, str], command: str, threshold: float = THRESHOLD) -> str:
    controls = any(r.ours_aa is not None for r in rows)
    lines = [f"{info['date']}, {info['cpu']} ({info['cores']} cores, {info['cpus']} logical CPUs), "
             f"{info['threads']} threads for both, torch {info['torch']}, load average {info['load']} at the start "
             f"(`{command}`). Median over alternating rounds of ggml's time / ours (above 1: ours is faster) and "
             f"each side's median ms per call; products and norms are judged against {threshold:.2f}x."
             + (" A/A: each side against a second instance of itself, the harness's own spread." if controls else ""),
             ""]
    head = "| op | workload | ours ms | ggml ms | ggml / ours | verdict |" + (" ours A/A | ggml A/A |" if controls else "")
    for package in dict.fromkeys(r.package for r in rows):
        judged = JUDGED.get(package)
        lines += [f"**{package}**" + (f" ({judged}s judged)" if judged else " (reported, not judged)"), "",
                  head, "|---|---|---:|---:|---:|---|" + ("---:|---:|" if controls else "")]
        lines += [_table_row(r, threshold, controls) for r in rows if r.package == package]
        lines.append("")
    return "\n".join(lines)


def _table_row(r: Row, threshold: float, controls: bool) -> str:
    line = f"| {r.op} | {r.workload} | {_ms(r.ours_ms)} | {_ms(r.ggml_ms)} | {r.ratio:.2f}x | {r.verdict(threshold)} |"
    if controls:
        line += "".join(f" {'-' if aa is None else f'{aa:.2f}x'} |" for aa in (r.ours_aa, r.ggml_aa))
    return line


def summary(rows: list[Row], threshold: float = THRESHOLD) -> str:
    judged, low = [r for r in rows if r.judged], below(rows, threshold)
    head = f"versus ggml: {len(judged)} judged workloads, {len(low)} below {threshold:.2f}x"
    return "\n".join([head, *(f"  BELOW: {r.package} {r.op}.{r.workload} {r.ratio:.2f}x" for r in low)])


# ---- command line ----------------------------------------------------------------------------

def packages_with_benchmarks() -> list[str]:
    return sorted(p.parent.name for p in (REPO / "packages").glob("*/benchmarks"))


def _pattern(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m tools.bench.versus_ggml", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", help="packages (default: every package with benchmarks/)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a judged workload is below the threshold")
    ap.add_argument("--quick", action="store_true", help=f"the scripts' quick workloads ({QUICK_ENV}=1), fewer rounds")
    ap.add_argument("--threads", type=int, help="torch's (and so ggml's) thread count (default: torch's)")
    ap.add_argument("--rounds", type=int, help="alternating rounds per workload (default 9, quick 5)")
    ap.add_argument("--controls", action="store_true",
                    help="also time each side against a second instance of itself (A/A), beside each ratio")
    ap.add_argument("--threshold", type=float, default=THRESHOLD, help="the verdict's ggml / ours floor (0.95)")
    ap.add_argument("--output", type=Path, help="write the markdown here too")
    ap.add_argument("--command", help="the command quoted in the caption (default: this one)")
    ap.add_argument("--only", type=_pattern, metavar="REGEX", help="the workloads whose <Op>.<workload> it matches")
    args = ap.parse_args(argv)
    unknown = set(args.packages) - set(packages_with_benchmarks())
    if unknown:
        ap.error(f"no benchmarks/ in packages/{', '.join(sorted(unknown))}")
    if args.threads is not None and not 1 <= args.threads <= 512:
        ap.error(f"--threads must be 1-512, got {args.threads}")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quick = args.quick or os.environ.get(QUICK_ENV) == "1"
    if quick:
        os.environ[QUICK_ENV] = "1"  # the scripts read it when imported
    settings = QUICK if quick else Settings()
    if args.rounds:
        settings = replace(settings, rounds=args.rounds)
    if args.controls:
        settings = replace(settings, controls=True)
    import torch

    from tools.testing import ggml_ctypes

    if args.threads:
        torch.set_num_threads(args.threads)
    packages = args.packages or packages_with_benchmarks()
    if not ggml_ctypes.available() and any(p in JUDGED for p in packages):
        print(f"versus ggml: ggml's own ops are unavailable ({ggml_ctypes.unavailable_reason()})", file=sys.stderr)
        return 2
    info = machine()
    rows = [row for package in packages for row in run_package(package, settings, only=args.only)]
    unjudged = [p for p in packages if p in JUDGED and not any(r.package == p for r in rows)]
    if unjudged:
        print(f"versus ggml: nothing to judge in {', '.join(unjudged)} (no <Op>_ggml class pairs, or none --only matches)", file=sys.stderr)
        return 2
    command = args.command or "python -m tools.bench.versus_ggml " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(rows, info, command.strip(), args.threshold)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table)
    print(table)
    print(summary(rows, args.threshold))
    return exit_code(rows, args.threshold) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())

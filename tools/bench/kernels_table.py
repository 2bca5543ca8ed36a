"""Markdown tables from the JSON of kernels' own benchmark runner, one table per op: a row per
workload, a column per implementation, and each comparison's time over ours.

A package's benchmark script (packages/<name>/benchmarks/benchmark*.py) names its Benchmark classes
`<Op>` for this package's kernel and `<Op>_<implementation>` for what it is compared with (ggml's own
op, transformers' module or function, the package's reference); the workloads they share line up in
one row.

    kernels benchmark ./packages/topk --output bench-results/topk.json
    python -m tools.bench.kernels_table bench-results/topk.json [--stat min_ms]

`nox -s bench` runs both for every package and writes bench-results/<package>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

OURS = "ours"
STATS = ("mean_ms", "min_ms", "q1_ms")


def split_name(workload: str) -> tuple[str, str, str]:
    """'MulMatVec_ggml.q4_k_1024x1024_m1' -> ('MulMatVec', 'ggml', 'q4_k_1024x1024_m1')."""
    cls, workload = workload.split(".", 1)
    op, _, implementation = cls.partition("_")
    return op, implementation or OURS, workload


def collect(results: list[dict], stat: str = "mean_ms") -> dict[str, dict[str, dict[str, float]]]:
    """op -> workload -> implementation -> time (ms), in the order the runner wrote them."""
    ops: dict[str, dict[str, dict[str, float]]] = {}
    for r in results:
        op, implementation, workload = split_name(r["workload"])
        ops.setdefault(op, {}).setdefault(workload, {})[implementation] = r["timingResults"][stat]
    return ops


def implementations(rows: dict[str, dict[str, float]]) -> list[str]:
    """ours first, then the others in alphabetical order."""
    names = sorted({name for times in rows.values() for name in times} - {OURS})
    return [OURS, *names]


def _ms(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _ratio(theirs: float | None, ours: float | None) -> str:
    return "-" if theirs is None or not ours else f"{theirs / ours:.2f}x"


def table(op: str, rows: dict[str, dict[str, float]]) -> list[list[str]]:
    """Header and rows for one op: workload, each implementation's ms, then <implementation> / ours."""
    names = implementations(rows)
    others = [n for n in names if n != OURS]
    header = ["workload", *(f"{n} ms" for n in names), *(f"{n} / ours" for n in others)]
    body = []
    for workload, times in rows.items():
        body.append([workload, *(_ms(times.get(n)) for n in names),
                     *(_ratio(times.get(n), times.get(OURS)) for n in others)])
    return [header, *body]


def markdown(payload: dict, stat: str = "mean_ms", command: str | None = None) -> str:
    machine = payload["machineInfo"]
    lines = [f"{datetime.date.today().isoformat()}, torch {machine['pytorchVersion']}, {machine['cpu']}, "
             f"{machine['os']}; {stat.removesuffix('_ms')} ms per call over "
             f"{payload['results'][0]['timingResults']['iterations']} calls"
             + (f" (`{command}`)" if command else "") + "; x / ours above 1: ours is faster.", ""]
    for op, rows in collect(payload["results"], stat).items():
        header, *body = table(op, rows)
        lines += [f"**{op}**", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.kernels_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, nargs="+", help="kernels benchmark --output files")
    ap.add_argument("--stat", choices=STATS, default="mean_ms", help="which of the runner's statistics (default mean)")
    ap.add_argument("--command", help="the command that made the JSON, quoted in the caption")
    args = ap.parse_args(argv)
    for path in args.json:
        print(markdown(json.loads(path.read_text()), args.stat, args.command))


if __name__ == "__main__":
    main()

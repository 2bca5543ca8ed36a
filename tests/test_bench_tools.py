"""Every per-package benchmark tool (tools/bench/bench_*.py, what `nox -s bench` runs) still runs.

Nothing else executes them, and one had rotted unnoticed: bench_gdn.py's pure-PyTorch stand-in for
the ops lacked the in-place decode ops the layer learned later, so its first table row raised. Each
tool runs here in its `--quick` form (6-26 s each on 2 cores) and must exit 0 and print its table;
the times themselves are not checked (speed is shown by the benchmarks, never asserted in tests).
Several tools also compare outputs before timing (bench_norm.py: ours against transformers' module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools" / "bench"
# tool -> the implementations its table must name in its header
TABLE_COLUMNS = {
    "bench_norm.py": ("ours", "tf eager", "reference"),
    "bench_gdn.py": ("ours", "transformers", "reference"),
    "bench_topk.py": ("ours", "ggml", "eager", "reference"),
    "bench_attn.py": ("ggml-attn", "sdpa", "eager", "reference"),
    "bench_quantization.py": ("ours", "ggml", "tf f32", "tf unpack"),
}


def test_every_tool_is_listed():
    tools = {p.name for p in TOOLS.glob("bench_*.py")} - {"bench_e2e.py"}  # whole models: tests/test_cli.py
    assert tools == set(TABLE_COLUMNS)


@pytest.mark.parametrize("tool", sorted(TABLE_COLUMNS))
def test_tool_runs_quick(tool):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", f"tools.bench.{Path(tool).stem}", "--quick", "--markdown"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) >= 3, proc.stdout[-3000:]  # header, separator, at least one row
    header = table[0]
    for column in TABLE_COLUMNS[tool]:
        assert column in header, header
    cells = [cell.strip().lower() for line in table[2:] for cell in line.split("|")]
    assert "nan" not in cells and "inf" not in cells, proc.stdout[-3000:]

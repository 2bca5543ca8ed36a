"""Every package's benchmarks (packages/<name>/benchmarks/benchmark*.py, what `nox -s bench` runs) run
under kernels' own runner, as users run them: `kernels benchmark <package folder>`.

Each runs in its quick form (GGML_KERNELS_BENCH_QUICK=1: a few workloads, 2 timed calls each). The
runner checks every checked implementation's output against the script's reference and exits
non-zero on a mismatch; here it must exit 0, every implementation the script compares must have run,
and the markdown table made from its JSON must hold only finite numbers. The times themselves are
not checked (speed is shown by the benchmarks, never asserted in tests); bench-e2e's verdicts are
checked on made-up rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import REPO
from tools.bench import kernels_table

# package -> {op: implementations its benchmarks compare}; the ggml columns (ggml's own ops, but
# topk's) need llama.cpp's libggml (llama-cpp-python, which nox installs)
IMPLEMENTATIONS = {
    "ggml-attn": {"FlashAttn": {"ours", "ggml", "sdpa", "eager", "reference"}},
    "ggml-gated-delta-net": {"GatedDeltaNet": {"ours", "ggml", "transformers"}, "GatedDeltaNetInPlace": {"ours", "ggml"},
                             "CausalConv1d": {"ours", "ggml"},
                             "Layer": {"ours", "transformers"}},
    "ggml-norm": {"RMSNormZeroCentered": {"ours", "ggml", "layer", "transformers", "reference"},
                  "RMSNormGated": {"ours", "ggml"}, "L2Norm": {"ours", "ggml"}},
    "ggml-quantization": {"MulMatVec": {"ours", "ggml", "huge_pages", "tf_f32", "tf_bf16"},
                          "MulMat": {"ours", "exact", "ggml", "tf_f32", "tf_bf16", "tf_unpack"}, "MulMatGroup": {"ours"},
                          "MulMatId": {"ours", "ggml"}},
    "topk": {"SoftmaxTopK": {"ours", "ggml", "eager", "reference"}, "Router": {"ours", "transformers"}},
}


def test_every_package_is_listed():
    assert {p.parent.name for p in (REPO / "packages").glob("*/benchmarks")} == set(IMPLEMENTATIONS)


@pytest.mark.slow
@pytest.mark.skipif(bool(torch.version.cuda), reason="kernels' runner loads a package folder by torch's "
                    "backend, and our builds are CPU builds (a CUDA torch wants a cu* variant)")
@pytest.mark.parametrize("package", sorted(IMPLEMENTATIONS))
def test_benchmarks_run_under_kernels_runner(package, tmp_path):
    result = tmp_path / "result.json"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", GGML_KERNELS_BENCH_QUICK="1", PYTHONPATH=path)
    runner = Path(sys.executable).with_name("kernels")
    proc = subprocess.run([str(runner), "benchmark", f"./packages/{package}", "--iterations", "2", "--warmup", "1",
                           "--output", str(result)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(result.read_text())
    assert all(r.get("verified", True) for r in payload["results"])
    ops = kernels_table.collect(payload["results"])
    for op, expected in IMPLEMENTATIONS[package].items():
        assert set(kernels_table.implementations(ops[op])) == expected, op
    cells = [cell.strip().lower() for line in kernels_table.markdown(payload).splitlines() if line.startswith("|")
             for cell in line.split("|")]
    assert not {"nan", "inf", "nanx", "infx"} & set(cells), kernels_table.markdown(payload)


def test_e2e_short_prompt_targets_follow_the_acceptance():
    """bench-e2e's verdicts: the first token after 4 tokens is held to 0.9x llama.cpp (Q4_K files
    keep the plain layout), after 16 and 64 tokens and generate() to 1x; a median of the rounds."""
    from tools.bench import bench_e2e

    def round_(ours_ms: float, gen: float) -> dict:
        times = {"kernels": {str(n): ours_ms for n in (4, 16, 64)}, "llama.cpp": {str(n): 10.0 for n in (4, 16, 64)}}
        return {"model_name": "m", "first_token": times, "generate": {"kernels": gen, "llama.cpp": 100.0}}

    (line,) = bench_e2e.short_prompt_lines("m", [round_(10.5, 99.0), round_(11.0, 101.0), round_(10.6, 100.0)])
    cells = line.split(": ", 1)[1].split("; ")
    assert [cell.rsplit(" ", 1)[1] for cell in cells] == ["PASS", "MISS", "MISS", "PASS"], line
    assert "(>= 0.9x)" in cells[0] and "(>= 1x)" in cells[1] and "(>= 1x)" in cells[3], line

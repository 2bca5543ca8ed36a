"""The command line (`python -m ggml_kernels_integration`): generate streams text and ends with its
summary line, with and without our kernels; bench prints one JSON result; a bad file is one clear
error line and exit status 2, before anything is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ggml_kernels_integration  # noqa: F401, E402  (installed by nox: missing, these tests fail, not skip)
import pytest

from tools.models import make_gguf

pytestmark = pytest.mark.slow  # a fresh process per command, whole models


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "ggml_kernels_integration", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def tiny():
    return str(make_gguf.ensure("qwen35-tiny", "Q4_K_M", log=lambda message: None))


@pytest.mark.parametrize("kernels", [True, False])
def test_generate(tiny, kernels):
    proc = cli("generate", "--gguf", tiny, "--prompt", "Once upon a time", "--max-new-tokens", "6",
               *(() if kernels else ("--no-kernels",)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()  # the streamed text (random weights: gibberish, but some)
    summary = proc.stderr.strip().splitlines()[-1]
    assert "prefill" in summary and "decode" in summary and "peak RSS" in summary
    assert summary.endswith("kernels: on" if kernels else "kernels: off")
    assert "loading the model" in proc.stderr  # the progress stages


def test_bench_json(tiny):
    proc = cli("bench", "--gguf", tiny, "--backend", "kernels", "--prompt-tokens", "9", "--decode-tokens", "3",
               "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["backend"] == "kernels" and res["decode_tok_s"] > 0 and res["prefill_tok_s"]["9"] > 0
    assert res["kernel_calls"].get("ggml_quantization::mul_mat_vec", 0) > 0


def test_bad_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    proc = cli("generate", "--gguf", str(bad), "--prompt", "x")
    assert proc.returncode == 2
    assert "not a GGUF file" in proc.stderr and "Traceback" not in proc.stderr

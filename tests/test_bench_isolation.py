"""The demo and bench-e2e run every backend (llama.cpp included) in a process of its own: a backend
that crashes (a segmentation fault in native code, as llama.cpp's AMX build did on an Intel Xeon) is
one `FAILED: killed by SIGSEGV` row, never the end of the run."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from tools.bench import bench_e2e, demo


@pytest.fixture
def crashing_python(tmp_path, monkeypatch) -> Path:
    """sys.executable replaced by a program that dies of SIGSEGV, whatever it is asked to run."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'about to crash' >&2\nkill -SEGV $$\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    return fake


def test_run_isolated_names_the_signal():
    proc = bench_e2e.run_isolated([sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(signal.SIGSEGV)})"])
    assert isinstance(proc, str) and proc.startswith("killed by SIGSEGV")


def test_run_isolated_returns_a_failed_run_s_error_output():
    proc = bench_e2e.run_isolated([sys.executable, "-c", "raise SystemExit('no such model')"])
    assert proc == "no such model"


def test_run_isolated_returns_the_process_when_it_succeeds():
    proc = bench_e2e.run_isolated([sys.executable, "-c", "print('ok')"])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok"


def test_a_crashing_backend_is_a_failed_bench_row(crashing_python, tmp_path):
    row = bench_e2e.measure(tmp_path / "model.gguf", "llama.cpp", bench_e2e.QUICK, threads=1)
    assert bench_e2e.error_summary(row) == "killed by SIGSEGV: about to crash"


def test_a_crashing_chat_backend_is_a_failed_demo_row(crashing_python, tmp_path):
    assert demo.llama_cpp_answer(tmp_path / "model.gguf", threads=1) == "FAILED: killed by SIGSEGV: about to crash"
    answer, summary = demo.cli_generate(tmp_path / "model.gguf", kernels_on=True, threads=1)
    assert answer.startswith("FAILED: killed by SIGSEGV") and summary == ""

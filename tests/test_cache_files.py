"""tools/build/files.py's `made_once`: a cache file that several processes ask for at the same time
(test processes side by side on an empty cache) is written once, whole, and every process gets it."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from tools.build import files
from tools.models import make_gguf

WRITERS = 4


def _slow_write(tmp: Path) -> None:
    """Writes in pieces, slowly enough that the processes overlap; notes each write in a log."""
    with open(tmp.parent / "writes.log", "a") as log:
        log.write(f"{tmp.name}\n")
    with open(tmp, "wb") as f:
        for _ in range(20):
            f.write(b"x" * 4096)
            f.flush()
            time.sleep(0.01)


def _ask(path: str, start, results) -> None:
    start.wait()
    wrote = files.made_once(Path(path), Path.exists, _slow_write)
    results.put((wrote, Path(path).read_bytes() == b"x" * 4096 * 20))


def test_processes_asking_at_once_share_one_write(tmp_path):
    path = tmp_path / "model.gguf"
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(WRITERS), ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(path), start, results)) for _ in range(WRITERS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(got) == [(False, True)] * (WRITERS - 1) + [(True, True)]  # one writer, all see it whole
    assert len((tmp_path / "writes.log").read_text().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model.gguf.lock", "writes.log"]


def test_a_failed_write_leaves_neither_the_file_nor_its_part(tmp_path):
    path = tmp_path / "model.gguf"

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.made_once(path, Path.exists, fail)
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf.lock"]
    assert files.made_once(path, Path.exists, lambda tmp: tmp.write_bytes(b"whole"))  # the next try writes it
    assert path.read_bytes() == b"whole"


def test_generated_models_are_written_once_and_found_current(tmp_path):
    pytest.importorskip("gguf")
    logs: list[str] = []
    first = make_gguf.ensure("qwen35-tiny", "Q8_0", tmp_path, log=logs.append)
    assert any(line.startswith("wrote ") for line in logs)
    logs.clear()
    assert make_gguf.ensure("qwen35-tiny", "Q8_0", tmp_path, log=logs.append) == first
    assert logs == []  # current: not written again
    assert not list(tmp_path.glob("*.part"))

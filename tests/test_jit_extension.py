"""tools/testing/jit_extension: a build folder that a killed build left locked is built in, not
waited on forever (torch's own lock file has no owner to outlive); a living build is waited for."""

from __future__ import annotations

import fcntl
import threading

import torch.utils.cpp_extension as ext

from tools.testing import jit_extension


def _record_loads(monkeypatch, folder):
    """Replaces cpp_extension.load; returns the list of (build_directory, torch lock present, kwargs)."""
    calls = []

    def load(build_directory, **kwargs):
        calls.append((build_directory, (folder / jit_extension.TORCH_LOCK).exists(), kwargs))
        return "module"

    monkeypatch.setattr(ext, "load", load)
    return calls


def test_a_lock_left_by_a_killed_build_is_removed_before_loading(tmp_path, monkeypatch):
    calls = _record_loads(monkeypatch, tmp_path)
    (tmp_path / jit_extension.TORCH_LOCK).touch()  # what a build killed mid-way leaves
    assert jit_extension.load(tmp_path, name="x", verbose=False) == "module"
    assert calls == [(str(tmp_path), False, {"name": "x", "verbose": False})]


def test_a_living_build_of_the_same_folder_is_waited_for(tmp_path, monkeypatch):
    calls = _record_loads(monkeypatch, tmp_path)
    with open(tmp_path / jit_extension.OUR_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build holds the folder (flock is per open file)
        worker = threading.Thread(target=jit_extension.load, args=(tmp_path,), kwargs={"name": "x"})
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and calls == []
    worker.join(10)
    assert not worker.is_alive() and len(calls) == 1

"""File writes the builders and the model files share: only when the content changes (so that ninja
and the loaders see unchanged files as unchanged), atomically (a reader never sees half a file), and
once for all the processes that ask for one cache file at the same time (`made_once`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def own_temp(path: Path, suffix: str = ".tmp") -> Path:
    """A temporary name beside `path` that no other process writes: `path` is made there, then
    replaces it in one step."""
    return path.with_name(f"{path.name}.{os.getpid()}{suffix}")


def copy_if_changed(src: Path, dst: Path) -> None:
    if dst.exists() and dst.stat().st_size == src.stat().st_size and dst.read_bytes() == src.read_bytes():
        return
    tmp = own_temp(dst)
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        tmp = own_temp(path)
        tmp.write_text(text)
        os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path`.lock, held until the block ends (released by the OS if the
    process dies)."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def made_once(path: Path, is_current: Callable[[Path], bool], write: Callable[[Path], None]) -> bool:
    """Makes the cache file `path` unless `is_current(path)`: `write(tmp)` writes it to a file of this
    process's own, which then replaces `path` in one step. Processes asking at the same time (test
    processes side by side on an empty cache) take turns: one writes, the others find it current.
    Returns whether this call wrote it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        if is_current(path):
            return False
        tmp = own_temp(path, ".part")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return True

"""torch.utils.cpp_extension.load for extensions that tests build in the shared cache, made safe
against a killed run. torch marks a build in progress with a `lock` file in the build folder and
waits, without limit, for it to go away; a process killed while building (a timed-out CI run, a
stopped session) leaves that file behind and every later run hangs on it. Here one build per folder
runs at a time under a file lock of the kernel's (released when its holder dies, however it dies),
so a `lock` file found while holding it belongs to no living build and is removed."""

from __future__ import annotations

import fcntl
from pathlib import Path

TORCH_LOCK = "lock"  # the file torch's FileBaton creates in build_directory
OUR_LOCK = ".load.lock"


def load(build_dir: Path, **kwargs):
    """cpp_extension.load(build_directory=build_dir, **kwargs), one process at a time per folder,
    after removing a lock a killed build left."""
    import torch.utils.cpp_extension as ext

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / OUR_LOCK, "w") as ours:
        fcntl.flock(ours, fcntl.LOCK_EX)
        (build_dir / TORCH_LOCK).unlink(missing_ok=True)
        return ext.load(build_directory=str(build_dir), **kwargs)

"""A virtualenv holding only torch and kernels, at the versions of the running interpreter's, as a
user who installs nothing else has: made once per machine in the cache (GGML_KERNELS_CACHE/venvs/),
for tests that load what a user downloads (tests/test_publishing.py)."""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools.build import upstream

READY = "ready"  # written last: a venv without it is an interrupted one, made again


def requirements() -> list[str]:
    return [f"torch=={importlib.metadata.version('torch').split('+')[0]}",
            f"kernels=={importlib.metadata.version('kernels')}"]


def python() -> Path:
    """The venv's interpreter, making the venv first if needed (minutes: torch is installed)."""
    folder = upstream.cache_dir() / "venvs" / "-".join(r.replace("==", "-") for r in requirements())
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker at a time; the others wait, then find it ready
        if not (folder / READY).exists():
            shutil.rmtree(folder, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
            # PIP_CONSTRAINT: an explicit pin must win over a machine's cap on torch releases (noxfile)
            subprocess.run([str(folder / "bin" / "python"), "-m", "pip", "install", "-q", *requirements()],
                           env={**clean_env(), "PIP_CONSTRAINT": os.devnull}, check=True)
            (folder / READY).write_text("\n".join(requirements()) + "\n")
    return folder / "bin" / "python"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what points Python or kernels at this checkout, its builds or caches."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LOCAL_KERNELS", "GGML_KERNELS_BUILDS", "KERNELS_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("HF_")}
    return {**env, **extra}

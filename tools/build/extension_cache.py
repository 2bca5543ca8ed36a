"""Built extensions kept outside the checkout, keyed by everything that makes them.

A package's extension depends only on its recipe: the compile and link commands (the ninja file),
the content of the C/C++ files it may include (the package's and common/'s), and the torch it is
compiled against. Two checkouts, or two virtualenvs with the same torch, therefore build the same
bytes, and a fresh clone (CI) would otherwise compile every package again for every torch. The key
is the ninja file with its machine paths replaced by placeholders (this checkout, the running torch)
plus those files' contents and torch's version; a hit copies the cached library into the build
folder instead of running ninja, a miss runs ninja and stores the result. Incremental builds in a
checkout are unchanged: ninja still decides what to recompile there.

The cache is `<GGML_KERNELS_CACHE>/extensions/<torch variant>/`, the newest KEEP libraries per
extension kind (package and backend) kept.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from tools import REPO

from . import files, upstream
from . import ninja_build as ninja

KEEP = 6
SOURCE_SUFFIXES = {".c", ".cc", ".cpp", ".h", ".hpp", ".inc", ".S"}
SKIPPED_FOLDERS = {"build", "build-metal-emu", "tests", "benchmarks", "__pycache__"}


def build(so: Path, work: Path, recipe: ninja.NinjaFile, pkg: Path, jobs: int | None) -> None:
    """Makes `so` (the output of `recipe`, written to work/build.ninja): from the cache when it holds
    this recipe's library, else with ninja, storing the result."""
    cached = cache_dir(work.name) / f"{so.stem.removesuffix('.abi3')}-{recipe_key(recipe, pkg)}.so"
    if cached.exists():
        files.copy_if_changed(cached, so)
        os.utime(cached)  # the newest entries are the ones kept
        return
    ninja.run(work, jobs)
    _store(so, cached)


def cache_dir(variant: str) -> Path:
    return upstream.cache_dir() / "extensions" / variant


def recipe_key(recipe: ninja.NinjaFile, pkg: Path) -> str:
    """Independent of where the checkout and the virtualenv are: their paths become placeholders."""
    import torch

    text = "\n".join(recipe.lines)
    for path, placeholder in ((Path(torch.__file__).parent, "@TORCH"), (Path(torch.__file__).resolve().parent, "@TORCH"),
                              (REPO, "@REPO")):
        text = text.replace(str(path), placeholder)
    h = hashlib.sha256(text.encode())
    h.update(f"torch {torch.__version__} {torch.version.git_version}".encode())
    for f in _sources(pkg) + _sources(REPO / "common"):
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:24]


def _sources(folder: Path) -> list[Path]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_FOLDERS and not d.startswith("."))
        found += [Path(root) / f for f in sorted(names) if Path(f).suffix in SOURCE_SUFFIXES]
    return found


def _store(so: Path, cached: Path) -> None:
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    shutil.copy2(so, tmp)
    os.replace(tmp, cached)
    kind = cached.name.rsplit("_", 1)[0]  # _<py_name>_<tag>: the id's hash and the key vary
    entries = sorted(cached.parent.glob(f"{kind}_*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        old.unlink(missing_ok=True)


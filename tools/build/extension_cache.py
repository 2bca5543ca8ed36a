"""Built extensions kept outside the checkout, keyed by everything that makes them.

A package's extension depends only on its recipe: the compile and link commands (the ninja file),
the sources it compiles, the headers of the checkout they include, the torch and the compiler it is
built with (ggml's headers are named by their pinned folder in the commands). Two checkouts, or two
virtualenvs with the same torch, build the same bytes, and a fresh clone (CI) would otherwise compile
every package again for every torch. So, in the manner of ccache's direct mode:

- the recipe key hashes the ninja file with its machine paths replaced by placeholders (this
  checkout, the running torch), the compiled sources' contents, torch's and the compiler's version;
- a manifest per recipe key lists the checkout's headers the last build of it read (from ninja's
  dependency log), and the library is stored under the recipe key and those headers' contents.

A hit copies the cached library into the build folder instead of running ninja; a miss runs ninja
and stores the result. A change to a header no source of the package includes (another backend's)
leaves its key alone. Incremental builds in a checkout are unchanged: ninja still decides there.

The cache is `<GGML_KERNELS_CACHE>/extensions/<torch variant>/`; the newest KEEP libraries per
extension kind (package and backend) are kept.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tools import REPO

from . import files, upstream
from . import ninja_build as ninja

KEEP = 6


@dataclass(frozen=True)
class Toolchain:
    """What a recipe's text does not say about the tools that build it (versions), and the machine
    paths in it that name them (a virtualenv's torch), which become a placeholder."""

    identity: str
    machine_paths: tuple[Path, ...] = ()


def running_torch() -> Toolchain:
    """g++ against the torch of the running interpreter (the Linux builds)."""
    import torch

    folder = Path(torch.__file__).parent
    return Toolchain(f"torch {torch.__version__} {torch.version.git_version}; {_compiler()}", (folder, folder.resolve()))


def build(so: Path, work: Path, recipe: ninja.NinjaFile, sources: list[Path], jobs: int | None,
          toolchain: Toolchain | None = None) -> None:
    """Makes `so` (the output of `recipe`, written to work/build.ninja, from `sources`: those it
    compiles and any other file of the checkout it reads, such as a linker's stub list): from the cache
    when it holds this recipe's library, else with ninja, storing the result."""
    toolchain = toolchain or running_torch()
    kind = so.name.split(".")[0].rsplit("_", 1)[0]  # _<py_name>_<tag>; the id's hash varies
    key = recipe_key(recipe, sources, toolchain)
    folder = cache_dir(work.name)
    manifest = folder / f"{kind}-{key}.json"
    cached = _entry(folder, kind, key, _read_headers(manifest))
    if cached is not None and cached.exists():
        files.copy_if_changed(cached, so)
        os.utime(cached)  # the newest entries are the ones kept
        return
    ninja.run(work, jobs)
    headers = checkout_headers(work, sources, toolchain)
    folder.mkdir(parents=True, exist_ok=True)
    files.write_if_changed(manifest, json.dumps(headers, indent=1) + "\n")
    _store(so, _entry(folder, kind, key, headers), kind)


def cache_dir(variant: str) -> Path:
    return upstream.cache_dir() / "extensions" / variant


def recipe_key(recipe: ninja.NinjaFile, sources: list[Path], toolchain: Toolchain) -> str:
    """Independent of where the checkout and the virtualenv are: their paths become placeholders."""
    text = "\n".join(recipe.lines)
    for path in toolchain.machine_paths:
        text = text.replace(str(path), "@TOOLCHAIN")
    h = hashlib.sha256(text.replace(str(REPO), "@REPO").encode())
    h.update(toolchain.identity.encode())
    for f in sources:
        h.update(_relative(f).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:24]


def checkout_headers(work: Path, sources: list[Path], toolchain: Toolchain) -> list[str]:
    """The files of the checkout (the toolchain's aside: a virtualenv's torch) that the last build in
    `work` read, besides the sources themselves, from ninja's dependency log."""
    out = subprocess.run([ninja.ninja_exe(), "-C", str(work), "-t", "deps"], check=True, capture_output=True,
                         text=True).stdout
    outside = tuple(str(p) + os.sep for p in toolchain.machine_paths)
    compiled = {str(f) for f in sources}
    found = {line.strip() for line in out.splitlines() if line.startswith("    ")}
    return sorted(_relative(Path(f)) for f in found
                  if f.startswith(str(REPO) + os.sep) and not f.startswith(outside) and f not in compiled)


def _entry(folder: Path, kind: str, key: str, headers: list[str] | None) -> Path | None:
    if headers is None:
        return None
    h = hashlib.sha256()
    for rel in headers:
        path = REPO / rel
        if not path.is_file():
            return None  # a header the recipe read is gone: the sources changed, so did the key
        h.update(rel.encode() + b"\0" + path.read_bytes())
    return folder / f"{kind}-{key}-{h.hexdigest()[:16]}.so"


def _read_headers(manifest: Path) -> list[str] | None:
    try:
        return json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None


def _store(so: Path, cached: Path, kind: str) -> None:
    tmp = files.own_temp(cached)
    shutil.copy2(so, tmp)
    os.replace(tmp, cached)
    entries = sorted(cached.parent.glob(f"{kind}-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        old.unlink(missing_ok=True)


def _relative(path: Path) -> str:
    return path.resolve().relative_to(REPO).as_posix()


@functools.cache
def _compiler() -> str:
    return " ".join(subprocess.run([c, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
                    for c in ("g++", "gcc"))

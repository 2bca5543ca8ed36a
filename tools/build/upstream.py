"""Fetch ggml's pinned sources (upstream.toml) into a cache outside the repository.

The sdist is downloaded once from the package index, verified by sha256 and only its ggml/ tree is
extracted. Nothing from it is ever written inside the repository.

    python -m tools.build.upstream          # prints the path of the extracted ggml tree
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request
from pathlib import Path

from tools import REPO
from tools.build import files


def pin() -> dict:
    with open(REPO / "upstream.toml", "rb") as f:
        return tomllib.load(f)


def cache_dir() -> Path:
    """Root of every cached artifact: sdist, ggml tree, ggml runtime builds, llama.cpp wheel."""
    root = Path(os.environ.get("GGML_KERNELS_CACHE", Path.home() / ".cache" / "ggml-kernels"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_from_index(pkg: str, filename: str, dest: Path) -> None:
    """Find the sdist's URL through the index's JSON simple API; fall back to `pip download`."""
    try:
        req = urllib.request.Request(
            f"https://pypi.org/simple/{pkg}/",
            headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
        url = next(f["url"] for f in files if f["filename"] == filename)
        tmp = files.own_temp(dest, ".part")
        with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as out:
            shutil.copyfileobj(r, out, 1 << 20)
        tmp.rename(dest)
        return
    except Exception as e:  # the index may only be reachable through pip's configuration
        print(f"[upstream] direct download failed ({e}); trying pip download", file=sys.stderr)
    version = filename.removeprefix(pkg.replace("-", "_") + "-").removesuffix(".tar.gz")
    with tempfile.TemporaryDirectory() as tmpdir:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"{pkg}=={version}", "-d", tmpdir],
            check=True,
        )
        shutil.move(str(Path(tmpdir) / filename), dest)


def sdist_path() -> Path:
    p = pin()["sdist"]
    dest = cache_dir() / "sdist" / p["filename"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and _sha256(dest) == p["sha256"]:
        return dest
    if dest.exists():
        dest.unlink()
    print(f"[upstream] downloading {p['filename']}", file=sys.stderr)
    _download_from_index(p["package"], p["filename"], dest)
    got = _sha256(dest)
    if got != p["sha256"]:
        dest.unlink()
        raise RuntimeError(f"sha256 mismatch for {p['filename']}: expected {p['sha256']}, got {got}")
    return dest


def ggml_tree() -> Path:
    """Path of ggml's source tree (include/, src/) at the pinned llama.cpp commit."""
    p = pin()
    commit = p["llama_cpp"]["commit"]
    root = cache_dir() / f"ggml-{commit[:12]}"
    tree = root / "ggml"
    if (root / ".complete").exists():
        return tree
    sdist = sdist_path()
    prefix = p["sdist"]["ggml_subdir"].rstrip("/") + "/"
    staging = Path(tempfile.mkdtemp(dir=cache_dir()))
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = "ggml/" + m.name[len(prefix):]
        tar.extractall(staging, members=members, filter="data")
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    shutil.move(str(staging / "ggml"), tree)
    shutil.rmtree(staging, ignore_errors=True)
    (root / ".complete").write_text(commit + "\n")
    return tree


def upstream_license() -> Path:
    """llama.cpp's LICENSE file (it covers ggml) from the pinned sdist, extracted once into the cache."""
    p = pin()
    dest = cache_dir() / f"LICENSE-{p['llama_cpp']['commit'][:12]}"
    if dest.exists():
        return dest
    member = p["sdist"]["ggml_subdir"].rstrip("/").rsplit("/", 1)[0] + "/LICENSE"
    with tarfile.open(sdist_path()) as tar:
        data = tar.extractfile(member).read()
    tmp = files.own_temp(dest)
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


if __name__ == "__main__":
    print(ggml_tree())

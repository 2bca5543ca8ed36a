"""The proof that a darwin variant passed its checks on a Mac, which `nox -s publish` asks for.

A darwin variant (packages/<name>/build/torch<XY>-metal-aarch64-darwin/) is cross-built and
link-checked on Linux, where nothing of it can run. The Mac session writes, beside the variant,
`<variant>.mac-checked.json`: {"passed": true, "files": {path: sha256, ...}, ...details} over every
file of the variant as it was checked. A variant is publishable only while that marker says passed
and its files are still those bytes: a rebuild after the check makes it unchecked again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import files

SUFFIX = ".mac-checked.json"
NOT_CONTENT = ("__pycache__", ".pyc")  # left by importing the variant in place


def marker(variant: Path) -> Path:
    return variant.with_name(variant.name + SUFFIX)


def digest(variant: Path) -> dict[str, str]:
    """{relative path: sha256} of every file of the variant."""
    found = sorted(f for f in variant.rglob("*") if f.is_file() and not any(s in f.as_posix() for s in NOT_CONTENT))
    return {f.relative_to(variant).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in found}


def write(variant: Path, passed: bool, details: dict) -> Path:
    """Records the Mac check of the variant as it is now (what the Mac session calls)."""
    path = marker(variant)
    files.write_if_changed(path, json.dumps({**details, "passed": passed, "files": digest(variant)}, indent=2) + "\n")
    return path


def problem(variant: Path) -> str | None:
    """Why the variant is not proven on a Mac, or None when it is."""
    path = marker(variant)
    if not path.is_file():
        return f"not checked on a Mac: no {path.name} beside it (nothing of a darwin build runs on Linux)"
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"{path.name} is not readable JSON ({e})"
    if not isinstance(record, dict) or record.get("passed") is not True:
        return f"{path.name} does not say the Mac check passed"
    if record.get("files") != digest(variant):
        return f"its files changed since the Mac check ({path.name}): check the new build on a Mac"
    return None

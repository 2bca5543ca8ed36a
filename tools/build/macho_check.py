"""Link-level checks of a darwin build's Mach-O files, on Linux (tools/build/macho.py reads them).

What is checked, for each .so / .dylib of a torch<XY>-metal-aarch64-darwin variant:
- arm64, a dylib or bundle, LC_BUILD_VERSION for macOS with minos <= 26.0 (kernels loads Metal
  variants on macOS >= 26 only, so that is the floor the builds may require);
- it loads only torch's libraries by @rpath and Apple's Metal, Foundation, libobjc, libc++ and
  libSystem by their system paths: nothing of this machine; its rpaths are @loader_path-relative and
  a dylib's install name is @rpath/<name>;
- every undefined symbol binds to a library that exports it: torch's from the macOS wheel's export
  tries, Apple's from our stubs (tools/build/darwin/stubs.toml) and zig's libSystem.tbd. A Python
  extension's C API symbols bind by flat lookup (the interpreter provides them); nothing else may;
- it carries a code signature (the linker's ad-hoc one: arm64 macOS runs nothing unsigned).

Only a Mac can check that dyld loads it and that Metal runs it (docs/metal.md, "Darwin builds").

    python -m tools.build.macho_check VARIANT_DIR [--torch 2.13.0]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from . import darwin_toolchain, macho

MAX_MINOS = tuple(int(p) for p in darwin_toolchain.MIN_MACOS.split(".")) + (0,)
PYTHON_ABI = "3.9"  # the extension's Py_LIMITED_API (common/registration.h)
PYTHON_C_API = re.compile(r"^__?Py[A-Z_]")  # _PyLong_FromLong, __Py_NoneStruct, _PyExc_RuntimeError


class LinkCheckError(RuntimeError):
    """A darwin binary breaks one of the link rules; the message lists every problem."""


def libraries(tc: darwin_toolchain.Toolchain, torch_version: str) -> dict[str, set[str]]:
    """{install name: exported symbols} of every library a darwin build of this torch may load."""
    stubs = [*sorted(tc.stubs.glob("*.tbd")), tc.libsystem, *sorted(tc.torch[torch_version].libs.glob("*.tbd"))]
    return dict(macho.read_tbd(p) for p in stubs)


def problems(image: macho.MachO, allowed: dict[str, set[str]], python_extension: bool) -> list[str]:
    """Every rule `image` breaks (empty: it passes)."""
    found = []
    if image.cpu != "arm64":
        found.append(f"CPU type {image.cpu}, not arm64")
    if image.filetype not in ("dylib", "bundle"):
        found.append(f"a Mach-O {image.filetype}, not a dylib or bundle")
    if image.platform != "macos":
        found.append(f"built for {image.platform or 'no platform (no LC_BUILD_VERSION)'}, not macOS")
    elif image.minos > MAX_MINOS:
        found.append(f"minimum macOS {'.'.join(map(str, image.minos))} is above {darwin_toolchain.MIN_MACOS}")
    found += [f"loads {lib}, which is neither torch's nor one of Apple's it may use" for lib in image.dylibs if lib not in allowed]
    found += [f"rpath {r} is not relative to the library (@loader_path)" for r in image.rpaths if not r.startswith("@loader_path")]
    if image.filetype == "dylib" and not (image.install_name or "").startswith("@rpath/"):
        found.append(f"install name {image.install_name} is not @rpath/<name>")
    if not image.signed:
        found.append("no code signature (arm64 macOS runs no unsigned code)")
    found += _import_problems(image, allowed, python_extension)
    return found


def _import_problems(image: macho.MachO, allowed: dict[str, set[str]], python_extension: bool) -> list[str]:
    found, flat = [], []
    for imp in image.imports:
        if imp.library is None:
            if not (python_extension and PYTHON_C_API.match(imp.name)):
                flat.append(imp.name)
        elif imp.library in allowed and imp.name not in allowed[imp.library]:
            found.append(f"imports {imp.name} from {imp.library}, which does not export it")
        elif imp.library not in allowed:
            found.append(f"imports {imp.name} from {imp.library}")
    if flat:
        what = "symbols that are not Python's C API" if python_extension else "symbols"
        found.append(f"binds {len(flat)} {what} by flat lookup (no library says it exports them): {', '.join(sorted(flat)[:20])}")
    return found


def check_file(path: Path, allowed: dict[str, set[str]]) -> None:
    """Raises LinkCheckError naming the file and every rule it breaks."""
    try:
        image = macho.read(path)
    except macho.MachOError as e:
        raise LinkCheckError(str(e)) from None
    found = problems(image, allowed, python_extension=path.name.endswith(".abi3.so"))
    if found:
        raise LinkCheckError(f"{path}:\n  " + "\n  ".join(found))


def check_variant(variant: Path, allowed: dict[str, set[str]]) -> list[Path]:
    """Every Mach-O file of a darwin variant folder; returns them (there must be some)."""
    binaries = sorted(p for p in variant.iterdir() if p.suffix in (".so", ".dylib"))
    if not binaries:
        raise LinkCheckError(f"{variant}: no .so or .dylib to check")
    errors = []
    for path in binaries:
        try:
            check_file(path, allowed)
        except LinkCheckError as e:
            errors.append(str(e))
    if errors:
        raise LinkCheckError("darwin link check failed:\n" + "\n".join(errors))
    return binaries


def check_macos_binaries(variant: Path, required: bool = True) -> None:
    """kernel-abi-check's macOS rules (what kernel-builder's check-abi applies to Hub builds): a
    minimum macOS no newer than 26.0 on every Mach-O file, Python abi3 >= 3.9 on the extension.
    Without the package installed: raises (required), or says so and checks nothing."""
    try:
        import kernel_abi_check
    except ImportError:
        if required:
            raise RuntimeError("kernel-abi-check is not installed: pip install kernel-abi-check") from None
        print("[darwin] kernel-abi-check not installed; its macOS rules not checked", file=sys.stderr)
        return
    found = []
    for path in sorted(p for p in variant.iterdir() if p.suffix in (".so", ".dylib")):
        obj = kernel_abi_check.ObjectFile(str(path))
        if obj.format() != kernel_abi_check.BinaryFormat.MACH_O:
            found.append(f"{path.name}: not a Mach-O file ({obj.format()})")
            continue
        bad = list(obj.check_macos(darwin_toolchain.MIN_MACOS))
        if path.name.endswith(".abi3.so"):
            bad += list(obj.check_python_abi(PYTHON_ABI))
        found += [f"{path.name}: {b}" for b in bad]
    if found:
        raise LinkCheckError(f"{variant}: kernel-abi-check:\n  " + "\n  ".join(found))


def torch_version_of(variant: Path) -> str:
    """torch<M><m>-metal-aarch64-darwin -> the cached macOS torch of that major.minor."""
    found = re.match(r"torch(\d)(\d+)-metal-aarch64-darwin$", variant.name)
    wanted = [v for v in darwin_toolchain.TORCH_VERSIONS if found and v.startswith(f"{found[1]}.{found[2]}.")]
    if not wanted:
        raise ValueError(f"{variant.name}: not a torch<XY>-metal-aarch64-darwin variant of {darwin_toolchain.TORCH_VERSIONS}")
    return wanted[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.build.macho_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", type=Path)
    args = ap.parse_args(argv)
    try:
        for variant in args.variants:
            version = torch_version_of(variant)
            allowed = libraries(darwin_toolchain.toolchain((version,)), version)
            for path in check_variant(variant, allowed):
                print(f"ok {path}")
    except (LinkCheckError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

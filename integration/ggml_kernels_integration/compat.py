"""What the integration needs of transformers, kernels and gguf-py, checked before anything is patched.

`enable()` rebinds internals of transformers 5.22 and 5.23 (there is no public hook for what it does),
so it refuses versions outside the range it was tested with (`check_versions`; `allow_untested=True`
lets people try), and checks that every internal it touches is still there with the parameters it
calls (`check_internals`): an upgrade then fails in one place, naming what moved. Each module declares
the internals it relies on beside the code that uses them (`needs`); every one is there in both
tested transformers versions.
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# distribution -> the versions the integration is tested with (noxfile.py pins the lower ends)
TESTED = {"transformers": ">=5.22.2,<5.24", "kernels": ">=0.17.2,<0.18"}

# One internal: (module, attribute path, the leading parameter names we call it with, or None for a
# non-callable). Each module that patches or calls internals declares them beside its code with
# `needs(...)`; importing the package fills this list.
Internal = tuple[str, str, tuple[str, ...] | None]
INTERNALS: list[Internal] = []


def needs(*internals: Internal) -> None:
    """Declare internals the calling module patches or calls (checked by `check_internals`)."""
    for internal in internals:
        if internal not in INTERNALS:
            INTERNALS.append(internal)


ALLOW_UNTESTED_HINT = "pass enable(allow_untested_versions=True) to try anyway"


class UnsupportedVersionError(RuntimeError):
    """transformers or kernels is outside the tested range."""


class InternalsChangedError(RuntimeError):
    """An internal the integration patches or calls moved or changed its parameters."""


def installed_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in TESTED}


def untested_versions(versions: dict[str, str] | None = None) -> list[str]:
    """One line per distribution outside its tested range."""
    versions = versions if versions is not None else installed_versions()
    return [
        f"{name} {version} (tested: {TESTED[name]})"
        for name, version in versions.items()
        if Version(version) not in SpecifierSet(TESTED[name])
    ]


def check_versions(versions: dict[str, str] | None = None) -> None:
    versions = versions if versions is not None else installed_versions()
    if untested_versions(versions):
        found = ", ".join(f"{n} {v}" for n, v in versions.items())
        tested = ", ".join(f"{n} {s}" for n, s in TESTED.items())
        raise UnsupportedVersionError(
            f"ggml_kernels_integration is tested with {tested}; this environment has {found}. "
            f"It patches internals of these libraries that change between releases; {ALLOW_UNTESTED_HINT}."
        )


def transformers_uses_kernels() -> bool:
    """Whether transformers took the installed kernels at import (5.23 takes only kernels >= 0.18.2, which
    the package index does not serve; with 0.17.2 it switches its kernels integration off)."""
    from transformers.utils.import_utils import is_kernels_available

    return is_kernels_available()


def resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def moved_internals() -> list[str]:
    """One line per internal that is missing or whose leading parameters differ from `INTERNALS`."""
    problems = []
    for module, path, params in INTERNALS:
        try:
            obj = resolve(module, path)
        except (ImportError, AttributeError) as error:
            problems.append(f"{module}.{path}: missing ({error})")
            continue
        if params is None:
            continue
        try:
            found = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            problems.append(f"{module}.{path}: not a function any more ({type(obj).__name__})")
            continue
        if found[: len(params)] != params:
            problems.append(f"{module}.{path}: parameters {found}, expected to start with {params}")
    return problems


def check_internals() -> None:
    problems = moved_internals()
    if problems:
        raise InternalsChangedError(
            "ggml_kernels_integration relies on internals that moved in this transformers / kernels / "
            "gguf version:\n  " + "\n  ".join(problems)
        )

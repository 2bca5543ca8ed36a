"""Every package's build.toml as kernel-builder reads it: kernels' parser (`kernels._rust.Build.open`,
the code of `kernel-builder check-config`) accepts it as written, with no error and no warning; and
ggml-build.toml beside it, what tools/build needs beyond that schema, is read and checked with it."""

from __future__ import annotations

import re
import shutil
import warnings

import pytest

from tools import REPO
from tools.build import package_spec
from tools.build.build import check_backends, packages

PACKAGES = packages()


def parse(folder, capfd):
    """kernels' parser on a package folder: (the parsed Build, everything it printed)."""
    from kernels._rust import Build

    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build = Build.open(folder)
    out, err = capfd.readouterr()
    return build, out + err


@pytest.mark.parametrize("package", PACKAGES)
def test_build_toml_parses_clean(package, capfd):
    build, printed = parse(REPO / "packages" / package, capfd)
    assert printed == ""
    assert sorted(str(b) for b in build.general.backends) == ["cpu", "metal"]


def copy_package(package: str, tmp_path, edit) -> object:
    folder = tmp_path / package
    shutil.copytree(REPO / "packages" / package, folder, ignore=shutil.ignore_patterns("build", "build-*"))
    toml = folder / package_spec.BUILD_TOML
    toml.write_text(edit(toml.read_text()))
    return folder


def test_the_parser_warns_about_a_legacy_file(tmp_path, capfd):
    """Without `edition = 5` the file is read as the legacy format with a printed warning, which the
    test above would see."""
    folder = copy_package("ggml-norm", tmp_path, lambda t: t.replace("edition = 5\n", ""))
    _, printed = parse(folder, capfd)
    assert printed != ""


def test_the_parser_refuses_a_key_outside_its_schema(tmp_path, capfd):
    """Why the ggml runtime of each kernel is in ggml-build.toml, not in build.toml."""
    folder = copy_package("ggml-norm", tmp_path, lambda t: t.replace(
        'src = ["ggml_norm_ops/norm.cpp"]\n', 'src = ["ggml_norm_ops/norm.cpp"]\nggml = ["ggml-base", "ggml-cpu"]\n', 1))
    with pytest.raises(ValueError, match="ggml"):
        parse(folder, capfd)


@pytest.mark.parametrize("package", PACKAGES)
def test_metal_entries_list_no_headers(package):
    """In a metal kernel, kernel-builder hands `.metal` and `.h` sources to the shader compiler: our
    C++ headers are reached through `include`."""
    spec = package_spec.load(REPO / "packages" / package)
    for kernel in spec.kernels_of("metal"):
        assert [s for s in kernel.src if s.endswith((".h", ".metal"))] == [], kernel.name


@pytest.mark.parametrize("package", PACKAGES)
def test_ggml_build_toml_matches_the_builder(package):
    spec = package_spec.load(REPO / "packages" / package)
    check_backends(spec)
    assert {k.backend for k in spec.kernels} == {"cpu", "metal"}


def test_ggml_build_toml_names_every_kernel(tmp_path):
    folder = copy_package("ggml-norm", tmp_path, lambda t: t)
    ours = folder / package_spec.GGML_BUILD_TOML
    ours.write_text(re.sub(r"(?s)\[kernel\.ggml_norm_metal\].*", "", ours.read_text()))
    with pytest.raises(ValueError, match=r"ggml-build.toml: .*missing \['ggml_norm_metal'\]"):
        package_spec.load(folder)


@pytest.mark.parametrize(("old", "new", "message"), [
    ('ggml = ["ggml-base", "ggml-metal"]', 'ggml = ["ggml-base", "ggml-cpu"]', "a metal extension loads"),
    ("emulated = true", "emulated = false", "only as the emulated build"),
    ("emulated = true", "emulated = 1", "must be true or false"),
    ("emulated = true", "emulate = true", r"unknown keys \['emulate'\]"),
])
def test_ggml_build_toml_mistakes_are_named(tmp_path, old, new, message):
    folder = copy_package("ggml-norm", tmp_path, lambda t: t)
    ours = folder / package_spec.GGML_BUILD_TOML
    ours.write_text(ours.read_text().replace(old, new))
    with pytest.raises(ValueError, match=message):
        check_backends(package_spec.load(folder))

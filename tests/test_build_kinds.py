"""tools/testing/builds.py: the build kinds the packages' tests run on, and when a missing build
fails a test rather than skipping it."""

from __future__ import annotations

import pytest

from tools import REPO
from tools.build import build, package_spec
from tools.testing import builds, metal_builds


def test_kinds_name_every_build_folder_the_build_step_makes():
    assert builds.KINDS == {"cpu": "build", "metal-emu": "build-metal-emu", "mps-emu": "build-mps-emu"}
    assert builds.KINDS == {name: kind.folder for name, kind in build.BUILD_KINDS.items()}
    assert builds.METAL_KINDS == tuple(metal_builds.METAL_BUILDS)


@pytest.mark.parametrize("package", build.packages())
def test_the_build_step_makes_the_cpu_and_both_emulated_builds(package):
    has_metal = bool(package_spec.load(REPO / "packages" / package).kernels_of("metal"))
    assert builds.made_by_build_step(package, "cpu")
    assert builds.made_by_build_step(package, "metal-emu") == has_metal
    assert builds.made_by_build_step(package, "mps-emu") == has_metal


@pytest.mark.parametrize(("made", "required", "outcome"), [
    (True, False, pytest.fail.Exception),  # a failed build must not pass as skipped tests
    (False, True, pytest.fail.Exception),
    (False, False, pytest.skip.Exception),  # a kind the build step does not make yet
])
def test_a_missing_build_fails_unless_nothing_makes_it(monkeypatch, made, required, outcome):
    monkeypatch.setattr(builds, "exists", lambda package, kind: False)
    monkeypatch.setattr(builds, "made_by_build_step", lambda package, kind: made)
    monkeypatch.delenv(builds.REQUIRE_BUILDS_ENV, raising=False)
    if required:
        monkeypatch.setenv(builds.REQUIRE_BUILDS_ENV, "1")
    with pytest.raises(outcome, match="packages/topk/build-mps-emu"):
        builds.load_build("topk", "mps-emu")


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="no build kind 'cuda' \\(only cpu, metal-emu, mps-emu\\)"):
        builds.load_build("topk", "cuda")


def test_the_cpu_kind_is_the_build_transformers_loads():
    module = builds.load_build("topk", "cpu")
    assert module.info()["backend"] == "cpu" and "metal_dispatches" not in module.__all__


@pytest.mark.parametrize("named, kinds, expected", [
    ("", tuple(builds.KINDS), tuple(builds.KINDS)),
    ("metal-emu,mps-emu", tuple(builds.KINDS), ("metal-emu", "mps-emu")),
    ("mps-emu", ("metal-emu",), ()),
    # on a Mac (nox -s mac): the darwin variant runs where its Linux twin would, nothing else
    ("mps", tuple(builds.KINDS), ("mps",)),
    ("mps", ("metal-emu",), ()),
    ("mps", ("cpu",), ()),
])
def test_the_kinds_a_run_selects(monkeypatch, named, kinds, expected):
    monkeypatch.setenv("GGML_KERNELS_TEST_BUILDS", named)
    assert builds.selected(kinds) == expected


def test_an_unknown_selected_kind_is_named(monkeypatch):
    monkeypatch.setenv("GGML_KERNELS_TEST_BUILDS", "metal")
    with pytest.raises(ValueError, match="unknown build kinds.*'metal'"):
        builds.selected(tuple(builds.KINDS))

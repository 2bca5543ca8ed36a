"""The build kinds a package's tests run on, and fixtures parametrized over them.

    "cpu"        packages/<name>/build/            ggml's CPU backend (what the Hub gets)
    "metal-emu"  packages/<name>/build-metal-emu/  upstream's Metal backend on the emulated device
    "mps-emu"    packages/<name>/build-mps-emu/    the MPS device layer's Linux twin, each call checked
                                                   against metal-emu (metal_builds.TwinChecked)

A test that takes the fixture made by `each_build` runs once per kind, with the kind as its id
(`pytest packages/ggml-norm -k mps-emu` runs one kind). A build that the build step makes for the
package (tools/build/build.py) and is missing fails the test: a failed build must not pass as skipped
tests. A kind the build step does not make yet is skipped, with the reason, unless
GGML_KERNELS_REQUIRE_BUILDS is set (then every kind must exist).

GGML_KERNELS_TEST_BUILDS narrows the kinds (mps_builds.selected_kinds: `metal-emu,mps-emu`, or `mps`
on a Mac, where "mps", a package's darwin variant on MPS tensors, runs wherever its twin mps-emu would).

The emulator is slow (a metal-emu call costs 10-1000 CPU calls, an mps-emu call twice that: it runs
on the twin and on metal-emu), so heavy Metal cases keep a representative subset in the fast tier:
`slow_on("mps-emu")` puts a test or parameter value in the slow tier on those kinds only.
"""

from __future__ import annotations

import os

import pytest

from tools import REPO
from tools.testing import kernel_testing, metal_builds, mps_builds

KINDS = {"cpu": "build", **metal_builds.METAL_BUILDS}  # kind -> packages/<name>/<folder>/
METAL_KINDS = tuple(metal_builds.METAL_BUILDS)
REQUIRE_BUILDS_ENV = "GGML_KERNELS_REQUIRE_BUILDS"


def made_by_build_step(package: str, kind: str) -> bool:
    """Whether `python -m tools.build <package>` writes this kind's folder (tools/build/build.py: the
    kinds of every backend the package's build.toml has kernels for)."""
    from tools.build import build, package_spec

    return kind in build.kinds_of(package_spec.load(REPO / "packages" / package))


def exists(package: str, kind: str) -> bool:
    return any((REPO / "packages" / package / KINDS[kind]).glob("torch*-cpu-*"))


def load_build(package: str, kind: str):
    """The package's build of `kind`, loaded as users load it: the CPU build through kernels.get_kernel
    (its Hub id, as transformers does), a Metal one through metal_builds.load_metal."""
    if kind == mps_builds.KIND:
        return mps_builds.load_mps(package)
    if kind not in KINDS:
        raise ValueError(f"no build kind {kind!r} (only {', '.join(KINDS)})")
    if not exists(package, kind):
        folder = f"packages/{package}/{KINDS[kind]}"
        if os.environ.get(REQUIRE_BUILDS_ENV) or made_by_build_step(package, kind):
            pytest.fail(f"{folder} is missing: run `nox -s build` (or `python -m tools.build {package}`)")
        pytest.skip(f"{folder} does not exist: the build step does not make {kind} builds yet "
                    f"(set {REQUIRE_BUILDS_ENV}=1 to make a missing build fail)")
    if kind == "cpu":
        return kernel_testing.load_kernel(_hub_id(package))
    return metal_builds.load_metal(package, kind)


def each_build(name: str, package: str, kinds: tuple[str, ...] = tuple(KINDS)):
    """A session-scoped fixture `name` parametrized over `kinds` (ids: the kind names): every test
    using it runs on each build of the package."""

    def fixture(request):
        return load_build(package, request.param)

    chosen = list(selected(kinds))
    return pytest.fixture(scope="session", name=name, params=chosen, ids=chosen)(fixture)


def selected(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """`kinds` narrowed to those GGML_KERNELS_TEST_BUILDS names; "mps" wherever its Linux twin,
    "mps-emu", is among them."""
    named = mps_builds.selected_kinds(tuple(KINDS))
    return tuple(k for k in named if k in kinds or (k == mps_builds.KIND and "mps-emu" in kinds))


def slow_on(*kinds: str):
    """A mark: the test (or parameter value) is in the slow tier when it runs on one of `kinds`
    (mark_slow_on adds `slow` at collection, before `-m "not slow"` deselects)."""
    return pytest.mark.slow_on(*kinds)


def mark_slow_on(items) -> None:
    """pytest_collection_modifyitems: `slow` on every item marked slow_on(kind) that runs on that kind."""
    for item in items:
        kinds = {kind for mark in item.iter_markers("slow_on") for kind in mark.args}
        params = getattr(item, "callspec", None)
        if kinds and params and kinds & {v for v in params.params.values() if isinstance(v, str)}:
            item.add_marker(pytest.mark.slow)


def _hub_id(package: str) -> str:
    return next(repo for repo, path in kernel_testing.hub_ids().items() if path.name == package)

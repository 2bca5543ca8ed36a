"""Repo-wide pytest setup: LOCAL_KERNELS points every Hub id at its package folder, so tests load
builds the way users do (tools/testing/kernel_testing.py; the repository root is on sys.path through
pyproject's `pythonpath`, so tests import the tools as `tools.<job>.<module>`); the `slow_on(kind)`
mark puts a test in the slow tier on that build kind only (tools/testing/builds.py)."""

import pytest

from tools.testing import builds, kernel_testing

kernel_testing.point_hub_ids_at_local_builds()


@pytest.fixture(scope="session", autouse=True)
def _compiled_steps_in_a_temporary_folder(tmp_path_factory):
    """Compiled decode steps the tests store (integration's `stored_steps` and `packaged_steps`, torch
    >= 2.15) go to a folder of this run (the processes the tests start inherit it), not the user's
    cache."""
    import os

    if "GGML_KERNELS_COMPILED_STEPS" not in os.environ:
        os.environ["GGML_KERNELS_COMPILED_STEPS"] = str(tmp_path_factory.mktemp("compiled-steps"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow_on(*kinds): the slow tier on those build kinds only (tools/testing/builds.py)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    builds.mark_slow_on(items)

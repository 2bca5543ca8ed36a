"""Repo-wide pytest setup: LOCAL_KERNELS points every Hub id at its package folder, so tests load
builds the way users do (tools/testing/kernel_testing.py; the repository root is on sys.path through
pyproject's `pythonpath`, so tests import the tools as `tools.<job>.<module>`)."""

from tools.testing import kernel_testing

kernel_testing.point_hub_ids_at_local_builds()

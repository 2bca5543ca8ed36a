"""Repo-wide pytest setup: tools/ on sys.path (test helpers, oracles) and LOCAL_KERNELS pointing
every Hub id at its package folder, so tests load builds the way users do (tools/kernel_testing.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))

import kernel_testing  # noqa: E402

kernel_testing.point_hub_ids_at_local_builds()

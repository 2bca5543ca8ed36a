import pytest

from tools.testing import builds
from tools.testing.kernel_testing import load_kernel


@pytest.fixture(scope="session")
def tk():
    """The topk build, loaded through kernels.get_kernel as transformers loads it."""
    return load_kernel("transformers-community/topk")


# Each build kind of the package (tools/testing/builds.py), the kind as the test id (`-k mps-emu`):
# `build` every kind (cpu, metal-emu, mps-emu) for tests whose API and tolerances hold on each,
# `metal` each Metal kind, `metal_emu` the emulated build alone (its instrumentation).
build = builds.each_build("build", "topk")
metal = builds.each_build("metal", "topk", builds.METAL_KINDS)
metal_emu = builds.each_build("metal_emu", "topk", ("metal-emu",))

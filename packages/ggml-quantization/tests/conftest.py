import pytest

from tools.testing import builds
from tools.testing.kernel_testing import load_kernel


@pytest.fixture(scope="session")
def gq():
    """The ggml-quantization build, loaded through kernels.get_kernel as transformers loads it."""
    return load_kernel("ggml-org/ggml-quantization")


# Each build kind of the package (tools/testing/builds.py), the kind as the test id (`-k mps-emu`):
# `build` every kind (cpu, metal-emu, mps-emu) for tests whose API and tolerances hold on each,
# `metal` each Metal kind, `metal_emu` the emulated build alone (its instrumentation).
build = builds.each_build("build", "ggml-quantization")
metal = builds.each_build("metal", "ggml-quantization", builds.METAL_KINDS)
metal_emu = builds.each_build("metal_emu", "ggml-quantization", ("metal-emu",))

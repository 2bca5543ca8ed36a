import pytest

from tools.testing.kernel_testing import load_kernel


@pytest.fixture(scope="session")
def gdn():
    """The ggml-gated-delta-net build, loaded through kernels.get_kernel as transformers loads it."""
    return load_kernel("ggml-org/ggml-gated-delta-net")

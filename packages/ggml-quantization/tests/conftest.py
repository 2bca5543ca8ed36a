import pytest

from tools.testing.kernel_testing import load_kernel


@pytest.fixture(scope="session")
def gq():
    """The ggml-quantization build, loaded through kernels.get_kernel as transformers loads it."""
    return load_kernel("ggml-org/ggml-quantization")

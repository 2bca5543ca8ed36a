"""Prefill matmuls on the CPU: ggml-quantization's `mul_mat` chooses the path, this module only says
whether it may.

`mul_mat` on the CPU build takes its dense path (its `dense_prefill` module: the thresholds and the
measurements behind them, what it guarantees) for block-32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
times 32 to 128 rows and more by type on a CPU with bfloat16 dot products (AVX512-BF16, AMX), and
with AMX also for Q4_K / Q5_K / Q6_K weights times 192-256 rows: ggml's
dequantize, a chunk of rows at a time, then a bfloat16 GEMM with float32 accumulation, several times
faster than ggml's dot products there and closer to float32 (no 8-bit activations). Everything else
runs ggml's own mul_mat. `enable(dense_prefill=False)` (`set_enabled(False)`) asks for ggml's exact
path (`exact=True`) for every prefill matmul instead: activations rounded to 8 bits as llama.cpp
does, each row computed alone.

`integration/tests/test_integration.py` holds a whole model's logits on each path against float32
transformers and llama.cpp. Measure it in a model, alternating rounds with the path off and on in
one process:
    python -m tools.bench.ab_decode --gguf F --feature dense-prefill --prompt-tokens 512
(the integration README has the dated table).
"""

from __future__ import annotations

import torch

_state: dict = {"enabled": True}


def set_enabled(on: bool) -> None:
    """True: mul_mat chooses (its dense path where it applies); False: ggml's exact path always."""
    _state["enabled"] = bool(on)


def mul_mat(quant, blocks: torch.Tensor, x: torch.Tensor, ggml_type: int, out_features: int) -> torch.Tensor:
    """ggml-quantization's (`quant`) mul_mat, its dense path allowed or not (`set_enabled`)."""
    return quant.mul_mat(blocks, x, ggml_type, out_features, exact=not _state["enabled"])


def mul_mat_group(quant, blocks: list, x: torch.Tensor, ggml_types: list, out_features: list) -> list:
    """ggml-quantization's (`quant`) mul_mat_group, its dense path allowed or not (`set_enabled`)."""
    return quant.mul_mat_group(blocks, x, ggml_types, out_features, exact=not _state["enabled"])


def package():
    """The ggml-quantization build loaded for the CPU (`enable()` points kernels at it)."""
    import kernels

    from . import locate

    return kernels.get_kernel(locate.QUANTIZATION, version=1, **locate.backend_kwargs())


def native_bf16() -> bool:
    """Whether this CPU has the bfloat16 dot products mul_mat's dense path needs (the package decides:
    its `dense_prefill.NATIVE_BF16`). Call it after `enable()`."""
    return bool(package().dense_prefill.NATIVE_BF16)

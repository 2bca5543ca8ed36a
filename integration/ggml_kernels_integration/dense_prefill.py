"""Prefill matmuls on block-32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): ggml's dequantize, then a
bfloat16 GEMM.

For many activation rows ggml-cpu multiplies these types one (row, column) dot product at a time
(`vec_dot_q4_1_q8_1` and kin; llamafile's tiled sgemm covers Q4_0 / Q8_0 only, and the repacked
layouts need ggml's own buffers), while the K-quants' dot products keep up with a dense GEMM. On a
CPU with native bfloat16 dot products (AVX512-BF16, AMX) a dense bfloat16 GEMM (oneDNN, through
torch) on the weight dequantized by ggml is several times faster from 32-64 rows on, which is also
how ggml's own BLAS backend runs batches: dequantize, then a dense GEMM. The K-quants stay on ggml,
whose dot products for them are as fast as this path.

It is also closer to the model: ggml rounds the activations to 8 bits per block of 32 (Q8_0 / Q8_1)
before its dot products; bfloat16 keeps 8 significant bits per value and accumulates in float32.
`integration/tests/test_integration_dense_prefill.py` checks both products against the float32 product of the
dequantized weight (this one closer), and `integration/tests/test_integration.py` a whole model's logits against
float32 transformers. Decode steps (at most 8 rows) keep ggml's mat-vec, which is faster there.

What it guarantees: each entry within bfloat16 rounding of the float32 product of the dequantized
weight. It is not independent of the row count bit for bit: torch's bfloat16 GEMM may pick another
kernel for another number of rows (oneDNN on AMX CPUs does), so an entry can move by one bfloat16
step with the rows multiplied beside it, and a left-padded batch equals its prompts alone within
that. ggml's own path computes every row alone.

Measure it in a model, alternating rounds with the path off and on in one process:
    python -m tools.bench.ab_decode --gguf F --feature dense-prefill --prompt-tokens 512
(the integration README has the dated table). `MIN_ROWS` is where the path became the faster one
on a 2-core zen4 machine, per type.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import repacking

# ggml type id -> fewest activation rows at which this path is the faster one (see the docstring)
MIN_ROWS = {
    2: 32,  # Q4_0
    3: 32,  # Q4_1
    6: 32,  # Q5_0
    7: 32,  # Q5_1
    8: 64,  # Q8_0: ggml's Q8_0 dot products are twice as fast as the 4-bit ones
}
# bfloat16 bytes of weight dequantized at a time: the chunk stays in cache between ggml's dequantize
# and the GEMM, and a large matrix (a 49152-row vocabulary projection) is never unpacked whole
CHUNK_BYTES = 4 << 20

_state: dict = {"enabled": True}


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX-BF16): without them oneDNN
    emulates bfloat16 and the GEMM is slower than ggml's path."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def set_enabled(on: bool) -> None:
    _state["enabled"] = bool(on)


def applies(quant, ggml_type: int, rows: int) -> bool:
    """Whether a product of `rows` activation rows with a `ggml_type` weight (a type id of
    ggml-quantization, `quant`, repacked or not) takes this path."""
    min_rows = MIN_ROWS.get(repacking.base_type(quant, ggml_type))
    return min_rows is not None and rows >= min_rows and _state["enabled"] and native_bf16()


def matmul(quant, blocks: torch.Tensor, x: torch.Tensor, ggml_type: int, out_features: int) -> torch.Tensor:
    """x (M, K) @ W.T for the packed weight `blocks` (out_features, row bytes): float32 (M, N).

    The weight is dequantized by ggml-quantization's `dequantize` in row chunks of ~CHUNK_BYTES,
    each multiplied in bfloat16 (float32 accumulation) into its columns of the output."""
    m, k = x.shape
    xb = x.to(torch.bfloat16)
    rows_per_chunk = max(256, CHUNK_BYTES // (2 * k)) // repacking.REPACK_ROWS * repacking.REPACK_ROWS
    if rows_per_chunk >= out_features:
        w = quant.dequantize(blocks, ggml_type, out_features, k, torch.bfloat16)
        return F.linear(xb, w).float()
    out = torch.empty(m, out_features, dtype=torch.float32)
    for start in range(0, out_features, rows_per_chunk):
        stop = min(start + rows_per_chunk, out_features)
        w = quant.dequantize(blocks[start:stop], ggml_type, stop - start, k, torch.bfloat16)
        out[:, start:stop] = F.linear(xb, w)
    return out

"""`mul_mat`'s dense path: a prefill product on a block-32 weight as ggml's `dequantize`, then a
bfloat16 GEMM.

Why. For many activation rows ggml-cpu multiplies Q4_1 and Q5_1 one (row, column) dot product at a
time; Q4_0, Q5_0 and Q8_0 run llamafile's tiled sgemm, faster but still behind a dense GEMM; the
K-quants' products keep up with one. On a CPU with native bfloat16 dot products a dense bfloat16
GEMM (oneDNN, through torch) on the weight dequantized by ggml is several times faster at hundreds
of rows; ggml's own BLAS backend runs batches the same way: dequantize, then a dense GEMM. It is
also closer to the float32 product: ggml rounds the activations to 8 bits per block of 32 (Q8_0 /
Q8_1) before its dot products, bfloat16 keeps 8 significant bits per value and accumulates in float32.

When. `mul_mat` takes it (`applies`) for CPU tensors on the CPU build (the Metal builds keep ggml's
kernels), a weight whose GGUF type, repacked or not, has a threshold (`min_rows`: `MIN_ROWS`, and on a
CPU with AMX also `AMX_MIN_ROWS`), at least that many activation rows, on a CPU with native bfloat16
dot products (`NATIVE_BF16`), unless called with `exact=True`.

`MIN_ROWS`. This path pays one dequantize of the whole weight per call, then a GEMM whose cost grows
with the rows; ggml's path costs a fixed amount per row. So the crossover is the dequantize's cost
over the difference of the per-row costs, per type, and to first order the same for every shape.
Measured on a 2-core AMD EPYC (zen4: AVX512-BF16, no AMX), torch 2.13, ms per product, ggml's
`mul_mat` / this path:

    type  shape (N x K)  threads  M=16       M=32       M=64       M=96       M=128      M=512
    Q4_1  1536x576       2        0.26/0.30  0.52/0.35  1.01/0.41                         8.30/1.48
    Q4_1  3584x1024      1        3.13/5.41  6.30/5.71  15.6/6.83  20.4/7.64
    Q5_1  3584x1024      1                   10.3/10.1  12.9/7.94  28.5/9.59  25.5/10.0
    Q4_0  576x1536       2                                                               7.80/1.38
    Q4_0  3584x1024      1        1.61/6.29  2.82/4.80  5.29/6.95  9.54/9.06  14.1/8.89
    Q5_0  3584x1024      1        1.82/6.44  3.26/9.44  6.31/8.17  8.69/9.53  16.2/15.0
    Q8_0  3584x1024      2                   0.87/1.20  1.74/1.51                         13.2/5.35
    Q8_0  3584x1024      1        1.60/3.17  3.59/4.11  5.09/4.89  7.45/6.30  13.0/7.13

The 2-thread rows are of 2026-12-01; the 1-thread rows of 2026-12-03, the best of 15 alternating
calls each, with the machine shared (its 2-thread timings were unusable that day): treat them to
+-20 %. Hence Q4_1 / Q5_1 from 32 rows, Q8_0 from 64, Q4_0 from 96 and Q5_0 from 128 (their
crossovers at ~90 and ~110 rows). Measure again with `kernels benchmark
./packages/ggml-quantization` (benchmarks/benchmark_mul_mat.py: `MulMat_exact` against `MulMat` at
32-128 rows on every block-32 type). An AMX CPU runs the GEMM faster still and ggml's dot products
no faster, so its crossovers are no later than these.

`AMX_MIN_ROWS`. With AMX tiles (`amx_bf16` in the CPU's flags: `AMX_BF16`) the K-quants cross over
too, where on the EPYC ggml's K-quant products kept up with the GEMM at every row count measured.
Measured 2026-12-06 on an Intel Xeon with AMX (2 vCPUs, 2 MiB L2 per core), torch 2.13, ms per
product on 4 row-permuted copies of the weight, median of 5 alternating rounds, ggml's `mul_mat`
(`exact=True`) / this path, the ratio in brackets:

    type  shape (N x K)  threads  M=128               M=192               M=256
    Q4_K  6144x1024      2        3.25/3.25 (1.00x)   5.12/3.60 (1.42x)   6.27/3.75 (1.67x)
    Q4_K  9216x2560      2        12.6/13.1 (0.96x)   18.4/14.6 (1.26x)   22.7/17.3 (1.31x)
    Q4_K  1024x3584      1        4.33/3.79 (1.14x)   6.59/4.69 (1.40x)   8.47/4.90 (1.73x)
    Q5_K  6144x1024      2        3.12/3.45 (0.90x)   4.86/3.64 (1.33x)   6.19/3.92 (1.58x)
    Q5_K  9216x2560      2        12.9/13.8 (0.93x)   19.1/16.6 (1.15x)   24.1/17.2 (1.40x)
    Q6_K  6144x1024      2        3.75/5.49 (0.68x)   5.99/5.97 (1.00x)   7.62/6.42 (1.19x)
    Q6_K  9216x2560      2        15.0/22.3 (0.67x)   21.4/25.1 (0.86x)   27.0/24.9 (1.08x)
    Q6_K  9216x2560      1        29.5/39.0 (0.76x)   40.5/41.9 (0.97x)   52.7/46.4 (1.14x)

and likewise on 1024x3584 and 2048x1024 at both thread counts (Q4_K / Q5_K 1.30-1.47x at 192 rows,
Q6_K 1.08-1.25x at 256); at 512 rows Q4_K 1.5-2.1x, Q6_K 1.4-1.8x. Hence Q4_K and Q5_K from 192
rows, Q6_K (the slowest to dequantize) from 256. The other K-quants and the i-quants are not measured
and keep ggml's path.

CPUs without native bfloat16 dot products (neither AVX512-BF16 nor AMX-BF16 in the CPU's flags):
oneDNN emulates bfloat16 there with float32 arithmetic plus conversions, and no measurement shows
this path faster than ggml's, so `mul_mat` keeps ggml's path on them. The CPU builds are x86-64
Linux only, so the flags come from /proc/cpuinfo, read once at import (`cpu.CPU`;
`native_bf16_dot` reads another file's).

Chunks. The weight is dequantized and multiplied a chunk of rows at a time, so that the chunk ggml's
dequantize writes is still in cache when the GEMM reads it, and a large matrix (a 49152-row
vocabulary projection) is never unpacked whole. A chunk is about one core's L2 cache
(`CHUNK_BYTES`: `l2_cache_bytes`, from Linux's sysfs, 1 MiB assumed where it cannot be read): the
weight is cut into as many equal chunks as it holds whole L2s of bfloat16, so a chunk has one to two
L2s and a weight under two is not cut (cut in two, SmolLM2's 1536x576 ran up to 1.5x slower), each
chunk's rows a multiple of 128 (`chunk_rows`; oneDNN's bfloat16 GEMM ran 64 x 2560 by 816 rows 15 %
slower per row than by 768, cache-hot, 2 threads). Measured 2026-12-05 on the EPYC (1 MiB L2 per
core, 32 MiB L3) against the former chunks (4 MiB, at least 256 rows), one process, alternating,
9 rounds, weights cycled past the cache, ms per product, former / now:

    type  shape (N x K)  threads  M=64         M=128        M=512
    Q8_0  9216x2560      1        29.0 / 23.3  43.4 / 37.5  133 / 131
    Q8_0  9216x2560      2        15.5 / 12.3  23.4 / 19.5  66.0 / 63.9
    Q8_0  2560x9216      1        28.4 / 23.6  42.7 / 39.1  129 / 131
    Q4_1  2560x9216      2        23.0 / 21.0  31.1 / 26.1  77.5 / 83.0
    Q8_0  3584x1024      1        4.39 / 3.67  7.18 / 6.47  22.6 / 22.5
    Q4_1  3584x1024      2        3.05 / 3.00  4.18 / 4.02  11.3 / 11.1
    Q8_0  1536x576       2        0.49 / 0.48  0.75 / 0.76  2.67 / 2.71

and 0.93-1.26x over the 48 (type, shape, threads, rows) cells of Q8_0 and Q4_1 on these four
shapes, 1.00x or more in 39, 0.98x or more in 46; in runs when the machine was busy, the 4 MiB
chunks lost up to 1.8x (Q8_0 9216x2560 at 64 rows, 2 threads: 24.5 against 13.8 ms). A one-off
script timed `matmul` with each rule's chunk rows; `kernels benchmark ./packages/ggml-quantization`
times the path as it is. Only this CPU's 1 MiB L2 has been measured.

What it guarantees: each output entry within bfloat16 rounding of the float32 product of the
dequantized weight: x, W and the output are each rounded to bfloat16 (at most 2^-9 relative each),
the products summed in float32, so |y - x @ W.T| <= ~3 * 2^-9 * (|x| @ |W|.T), entry by entry.
It is not independent of the row count bit for bit: torch's bfloat16 GEMM may pick another kernel
for another number of rows (oneDNN on AMX CPUs does, by shape too: on an Intel Xeon with AMX a
1536x576 weight gave other bits at 9-32 rows than at 33 and more, a 576x1536 one at 33-333 rows
than at 700), so an entry can move by one bfloat16 step with the rows multiplied beside it, and a
padded batch's greedy token can differ from its prompt's alone where two logits were that close to
a tie. Calls of a fixed row count would make it independent at 1.5-2.2x the GEMM's time (3584x1024,
32-512 rows, 2 threads, there), so it is not done. ggml's path (`exact=True`) computes every row
alone, bit for bit as llama.cpp's ggml. A NaN or infinity in an activation row gives NaN / infinity in that row's
outputs, as a float product does (ggml's path may give finite numbers there, see the README).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from . import _checks, cpu
from ._ggml_runtime import BACKEND, check_size, same_device
from ._ops import ops
from .types import REPACKED, GGMLType

# GGUF type -> fewest activation rows at which this path is the faster one (the table above)
MIN_ROWS: dict[int, int] = {
    GGMLType.Q4_1: 32,  # one dot product at a time on ggml's path
    GGMLType.Q5_1: 32,
    GGMLType.Q8_0: 64,  # llamafile's tiles on ggml's path, and the cheapest dequantize
    GGMLType.Q4_0: 96,
    GGMLType.Q5_0: 128,
}
# GGUF type -> fewest activation rows on a CPU with AMX (`AMX_BF16`; the module docstring's table)
AMX_MIN_ROWS: dict[int, int] = {
    GGMLType.Q4_K: 192,
    GGMLType.Q5_K: 192,
    GGMLType.Q6_K: 256,  # the slowest K-quant to dequantize
}
# a core's L2 cache where sysfs does not say (the x86 CPUs of the last years have 1-2 MiB)
ASSUMED_L2_BYTES = 1 << 20
# a chunk's rows are a multiple of this (oneDNN's GEMM blocks; a multiple of REPACK_ROWS too)
CHUNK_ROWS_MULTIPLE = 128
# CPU flags of native bfloat16 dot products (Linux's names)
BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def native_bf16_dot(cpuinfo: str = cpu.CPUINFO) -> bool:
    """Whether this CPU has native bfloat16 dot products (`BF16_DOT_FLAGS` in its flags); False where
    the flags cannot be read."""
    return bool(BF16_DOT_FLAGS & cpu.flags(cpu.read_cpuinfo(cpuinfo)))


NATIVE_BF16: bool = bool(BF16_DOT_FLAGS & cpu.flags(cpu.CPU))  # this CPU's (cpu.CPU: read once)
# whether oneDNN's bfloat16 GEMM runs on AMX tiles here (AMX_MIN_ROWS apply)
AMX_BF16: bool = "amx_bf16" in cpu.flags(cpu.CPU)


def min_rows(gguf_type: int) -> int | None:
    """The fewest activation rows from which a weight of this GGUF type takes this path on this CPU,
    None where it never does."""
    if gguf_type in MIN_ROWS:
        return MIN_ROWS[gguf_type]
    return AMX_MIN_ROWS.get(gguf_type) if AMX_BF16 else None


def l2_cache_bytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of one core's level-2 cache (cpu0's, from Linux's sysfs), or None where it cannot be
    read."""
    units = {"K": 1 << 10, "M": 1 << 20}
    try:
        for index in sorted(Path(cache_dir).glob("index*")):
            level, kind = ((index / name).read_text().strip() for name in ("level", "type"))
            if level != "2" or kind == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
    except (OSError, ValueError):
        pass
    return None


# bfloat16 bytes of weight a chunk holds at least (the module docstring, "Chunks")
CHUNK_BYTES: int = l2_cache_bytes() or ASSUMED_L2_BYTES


def chunk_rows(rows: int, cols: int) -> int:
    """Rows of each chunk of a (rows, cols) weight: as many equal chunks as whole CHUNK_BYTES of its
    bfloat16 (one for a weight under twice that), rounded up to a multiple of CHUNK_ROWS_MULTIPLE."""
    chunks = max(1, rows * 2 * cols // CHUNK_BYTES)
    per_chunk = -(-rows // chunks)
    return -(-per_chunk // CHUNK_ROWS_MULTIPLE) * CHUNK_ROWS_MULTIPLE


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() >= 1 and x.shape[-1] > 0 else 0


@functools.cache
def _repacked_here() -> frozenset[int]:
    return frozenset(ops.repacked_types.default())


def may_apply(x: torch.Tensor) -> bool:
    """Whether a product with activations x could take this path for some weight: False on builds and
    CPUs without it and for fewer rows than every type's threshold (a decode step's), which decides a
    group of weights once, not per weight."""
    return NATIVE_BF16 and BACKEND == "cpu" and _rows(x) >= min(MIN_ROWS.values())


def applies(blocks: torch.Tensor, x: torch.Tensor, type_id: int) -> bool:
    """Whether `mul_mat(blocks, x, type_id, ...)` takes this path (see the module docstring). Decided
    from the type, the row count, the devices and the CPU; inputs the product would refuse go to
    ggml's path, whose checks name the problem (a repacked layout this CPU lacks among them)."""
    repacked = REPACKED <= type_id < 2 * REPACKED
    gguf_type = type_id - REPACKED if repacked else type_id
    fewest = min_rows(gguf_type)
    return (fewest is not None and NATIVE_BF16 and BACKEND == "cpu" and _rows(x) >= fewest
            and (not repacked or gguf_type in _repacked_here())
            and blocks.device.type == "cpu" and x.device.type == "cpu"
            and blocks.dtype == torch.uint8 and x.dtype in _checks._FLOAT)


def _check(blocks: torch.Tensor, x: torch.Tensor, type_id: int, out_features: int) -> None:
    """What ggml's mul_mat refuses, with its words: the shape and dtype rules and the size limits."""
    same_device("mul_mat", blocks=blocks, x=x)
    check_size(blocks, "blocks")
    check_size(x, "x")
    _checks.product(blocks, type_id, out_features, x)
    check_size(torch.empty((*x.shape[:-1], out_features), dtype=torch.float32, device="meta"), "the product")


def matmul(blocks: torch.Tensor, x: torch.Tensor, type_id: int, out_features: int) -> torch.Tensor:
    """x (..., K) @ W.T for the packed weight `blocks` (out_features, row bytes): float32 (..., N).

    The weight is dequantized by ggml in row chunks of ~CHUNK_BYTES (`chunk_rows`: whole groups of a
    repacked weight's interleaved rows), each multiplied in bfloat16 with float32 accumulation into
    its columns of the output."""
    _check(blocks, x, type_id, out_features)
    k = x.shape[-1]
    xb = x.reshape(-1, k).to(torch.bfloat16)
    out = torch.empty(xb.shape[0], out_features, dtype=torch.float32)
    rows_per_chunk = chunk_rows(out_features, k)
    for start in range(0, out_features, rows_per_chunk):
        stop = min(start + rows_per_chunk, out_features)
        w = ops.dequantize.default(blocks[start:stop], type_id, stop - start, k, torch.bfloat16)
        out[:, start:stop] = F.linear(xb, w)
    return out.view(*x.shape[:-1], out_features)

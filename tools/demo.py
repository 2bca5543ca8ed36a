"""The main job: run a real GGUF model's weights through our kernels and report what ran and how fast.

Loads SmolLM2-135M-Instruct (Q4_1) from its GGUF file, keeps every weight packed as stored, and
times one decode token's worth of mat-vecs (every linear layer of the model, M=1) and a 64-token
prefill's mat-mats with ggml-quantization, next to what transformers does on the CPU without
kernels (dense float32 weights made at load). Results are checked against gguf-py's dequantizer.

    python tools/demo.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_testing  # noqa: E402
from benchutil import median_time  # noqa: E402
import models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import gguf
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    kernel_testing.point_hub_ids_at_local_builds()
    gq = kernel_testing.load_kernel("ggml-org/ggml-quantization")
    info = gq.info()
    print(f"ggml-quantization: ggml {info['ggml']}, CPU level '{info['cpu_variant']}', {args.threads} threads")

    path = models.smollm2_gguf()
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    weights = {}
    with warnings.catch_warnings():  # the file is mapped read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        for t in reader.tensors:
            if len(t.shape) == 2 and t.tensor_type not in (gguf.GGMLQuantizationType.F32,):
                weights[t.name] = (torch.from_numpy(np.asarray(t.data)), int(t.tensor_type), int(t.shape[0]), int(t.shape[1]))
    load_s = time.perf_counter() - t0
    packed_bytes = sum(w[0].numel() for w in weights.values())
    dense_bytes = sum(4 * w[2] * w[3] for w in weights.values())
    print(f"model: {path.name} (arch {arch}), {len(weights)} packed matrices, "
          f"{packed_bytes / 2**20:.0f} MiB packed vs {dense_bytes / 2**20:.0f} MiB as float32 "
          f"({dense_bytes / packed_bytes:.1f}x), mapped in {load_s * 1000:.0f} ms")

    embd_name = "token_embd.weight"
    emb_blocks, emb_type, emb_cols, emb_rows = weights.pop(embd_name)
    linears = weights

    # correctness against gguf-py, on the first layer's matrices and the embedding
    worst = 0.0
    for name in [n for n in linears if n.startswith("blk.0.")]:
        blocks, t, cols, rows = linears[name]
        dense = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(t))).reshape(rows, cols)
        x = torch.randn(4, cols)
        ref = x @ dense.T
        out = gq.mul_mat_vec(blocks, x, t, rows)
        worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
    ids = torch.randint(0, emb_rows, (32,))
    emb = gq.get_rows(emb_blocks, ids, emb_type, emb_cols, torch.float32)
    emb_ref = torch.from_numpy(gguf.quants.dequantize(emb_blocks[ids].numpy(), gguf.GGMLQuantizationType(emb_type)))
    exact = torch.equal(emb, emb_ref.reshape(emb.shape))
    print(f"check vs gguf-py: layer-0 mat-vecs within {worst:.2e} of dequantize+matmul "
          f"(llama.cpp-style activation quantization), embedding rows {'bit-exact' if exact else 'DIFFER'}")

    # what transformers keeps on CPU without kernels: float32 weights made once at load
    dense = {n: gq.dequantize(b, t, r, c, torch.float32) for n, (b, t, c, r) in linears.items()}
    rows_out = []
    for m, label in ((1, "decode: 1 token"), (64, "prefill: 64 tokens")):
        xs = {c: torch.randn(m, c) for c in {v[2] for v in linears.values()}}
        fn = gq.mul_mat_vec if m <= gq.MAX_GEMV_ROWS else gq.mul_mat

        def ours():
            for b, t, c, r in linears.values():
                fn(b, xs[c], t, r)

        def transformers_cpu():
            for n, (b, t, c, r) in linears.items():
                torch.nn.functional.linear(xs[c], dense[n])

        t_ours, t_tf = median_time(ours), median_time(transformers_cpu)
        rows_out.append((label, t_ours, t_tf, packed_bytes / t_ours / 1e9))
    print(f"\nall {len(linears)} linear layers of the model, per forward pass:")
    print(f"  {'':20s} {'ggml kernels':>14s} {'transformers f32':>17s} {'speedup':>8s} {'weights read':>13s}")
    for label, a, b, gbs in rows_out:
        print(f"  {label:20s} {a * 1000:11.2f} ms {b * 1000:14.2f} ms {b / a:7.1f}x {gbs:9.1f} GB/s")
    print(f"\nmemory for the weights: {packed_bytes / 2**20:.0f} MiB packed (ggml kernels) vs "
          f"{dense_bytes / 2**20:.0f} MiB float32 (transformers without kernels)")


if __name__ == "__main__":
    main()

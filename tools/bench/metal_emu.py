"""Time per call of the packages' ops on their emulated-Metal builds (packages/<name>/build-metal-emu:
upstream's Metal host code and translated kernels, each GPU thread a fiber). Verification, not
speed: these numbers say how big a shape a test can afford, nothing about a Mac.

    python -m tools.bench.metal_emu [--calls 5]      # a markdown table on stdout

`nox -s bench` writes it to bench-results/metal-emu.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from tools import REPO

Q4_K, Q6_K, Q8_0 = 12, 14, 8


def _load(package: str):
    import kernels

    return kernels.get_local_kernel(Path(REPO / "packages" / package / "build-metal-emu"), backend="cpu")


def workloads(quant, norm, topk, gdn, attn, device: str = "cpu", quantize=None) -> dict:
    """name -> (module, call), on random data quantized by ggml's reference quantizer (the CPU build's;
    `quantize(x, ggml_type)` instead where there is none), every tensor on `device`."""
    g = torch.Generator().manual_seed(0)
    k, n = 1024, 256
    quantize = quantize or _cpu_quantization().quantize

    def weight(t, rows=n):
        return quantize(torch.randn(rows, k, generator=g), t).to(device)

    w, w6, w8 = weight(Q4_K), weight(Q6_K, 128), weight(Q8_0, 64)
    experts = torch.stack([weight(Q4_K) for _ in range(4)])
    x = {rows: torch.randn(rows, k, generator=g) for rows in (1, 5, 32)}
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(32)])
    nw = torch.randn(k, generator=g)
    logits = torch.randn(32, 64, generator=g)
    q, v = torch.randn(1, 1, 16, 128, generator=g), torch.randn(1, 1, 16, 128, generator=g)
    gate, beta, state = -torch.rand(1, 1, 16, generator=g), torch.rand(1, 1, 16, generator=g), torch.zeros(1, 16, 128, 128)
    cx, cw, cs = torch.randn(1, 6144, 32, generator=g), torch.randn(6144, 1, 4, generator=g), torch.zeros(1, 6144, 4)
    aq1, aq32 = torch.randn(1, 8, 1, 256, generator=g), torch.randn(1, 8, 32, 256, generator=g)
    ak, av = torch.randn(1, 2, 512, 256, generator=g), torch.randn(1, 2, 512, 256, generator=g)
    keys, values, rows = torch.zeros(1, 2, 512, 256), torch.zeros(1, 2, 512, 256), torch.randn(1, 2, 1, 256, generator=g)
    row_ids = torch.tensor([0, 5, 9, 255])
    if device != "cpu":  # every input on the device (the weights are there already)
        x = {r: t.to(device) for r, t in x.items()}
        ids, nw, logits, q, v, gate, beta, state, cx, cw, cs, aq1, aq32, ak, av, keys, values, rows, row_ids = (
            t.to(device) for t in (ids, nw, logits, q, v, gate, beta, state, cx, cw, cs, aq1, aq32, ak, av, keys,
                                   values, rows, row_ids))
    return {
        f"rms_norm {k} x 32, weight": (norm, lambda: norm.rms_norm(x[32], nw)),
        f"rms_norm_gated {k} x 32": (norm, lambda: norm.rms_norm_gated(x[32], x[32], nw)),
        f"l2_norm {k} x 32": (norm, lambda: norm.l2_norm(x[32])),
        f"Q4_K {n}x{k} mul_mat_vec, 1 row": (quant, lambda: quant.mul_mat_vec(w, x[1], Q4_K, n)),
        f"Q4_K {n}x{k} mul_mat_vec, 5 rows": (quant, lambda: quant.mul_mat_vec(w, x[5], Q4_K, n)),
        f"Q4_K {n}x{k} mul_mat, 32 rows": (quant, lambda: quant.mul_mat(w, x[32], Q4_K, n)),
        "mul_mat_group Q4_K + Q6_K + Q8_0, 1 row": (
            quant, lambda: quant.mul_mat_group([w, w6, w8], x[1], [Q4_K, Q6_K, Q8_0], [n, 128, 64])),
        f"Q4_K MoE 4 experts {n}x{k}, 32 tokens x 2": (quant, lambda: quant.mul_mat_id(experts, x[32], ids, Q4_K, n)),
        f"get_rows Q4_K {n}x{k}, 4 rows": (
            quant, lambda: quant.get_rows(w, row_ids, Q4_K, k, torch.float32)),
        f"dequantize Q4_K {n}x{k}": (quant, lambda: quant.dequantize(w, Q4_K, n, k, torch.float32)),
        "MoE routing, 64 experts, top-8 of 32 tokens": (topk, lambda: topk.softmax_top_k(logits, 8)),
        "gated delta net decode, 16 heads of 128": (gdn, lambda: gdn.gated_delta_net(q, q, v, gate, beta, state)),
        "causal conv 6144 channels, 32 tokens": (gdn, lambda: gdn.causal_conv1d(cx, cw, cs)),
        "flash attention decode, 8/2 heads of 256, 512 keys": (attn, lambda: attn.flash_attn(aq1, ak, av)),
        "flash attention prefill, 32 queries, causal": (attn, lambda: attn.flash_attn(aq32, ak, av, causal=True)),
        "kv_write 1 row into a 512-row cache (K and V)": (attn, lambda: attn.kv_write(keys, values, rows, rows, 7)),
    }


def _cpu_quantization():
    import kernels

    return kernels.get_local_kernel(Path(REPO / "packages" / "ggml-quantization"), backend="cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    rows = []
    builds = (_load(p) for p in ("ggml-quantization", "ggml-norm", "topk", "ggml-gated-delta-net", "ggml-attn"))
    for name, (module, call) in workloads(*builds).items():
        module.reset_metal_dispatches()
        call()  # warm-up, and the kernels it takes
        dispatched = module.metal_dispatches()
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        kernels = ", ".join(dispatched)
        rows.append(f"| {name} | {kernels} | {sum(dispatched.values())} | {statistics.median(times) * 1e3:.1f} |")
    print(f"{datetime.date.today()}, {platform.machine()} {platform.system()}; median ms per call over {args.calls} "
          "calls of the emulated builds' ops (upload, upstream's encoding, the emulated dispatches, read-back) "
          "(`python -m tools.bench.metal_emu`)\n")
    print("| op | kernels | threadgroups | ms |\n|---|---|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""What this CPU is, and the layout choice made from it.

The CPU builds are x86-64 Linux only, so the CPU is read from /proc/cpuinfo (its first processor's
vendor and flags), once, at import. `dense_prefill` reads its native-bfloat16 check from here too.

Which weights are faster in ggml-cpu's repacked layout (`faster_repacked_types`). ggml-cpu has
kernels for Q4_0 and Q4_K weights interleaved 8 rows at a time (`repack`); whether they beat the plain
layout's for a decode step's one activation row depends on the CPU, not on the instruction set ggml
was built for (both CPUs below run ggml's `zen4` level). Plain / repacked time, 2 threads, one
process, alternating:

    CPU                          products (mul_mat, 1 row / 4 rows)     a Qwen3.5-0.8B-shaped model
    Intel Xeon (AMX), 2 vCPUs    Q4_K 9216x2560, 2560x9216, 3584x1024,  Q4_K_M: decode 1.30x, first
                                 1024x3584: 1.37-1.70x / 1.76-2.38x;    token after 4 / 16 / 64 tokens
                                 Q4_0 9216x2560, 2560x9216: 1.50-2.07x  1.48x / 1.12x / 0.90x
    AMD EPYC (zen4), 2 vCPUs     Q4_K 1024x3584, 3584x1024: 0.94-0.98x  Q4_K_M: decode 0.95x, prefill
                                 / 1.30-1.56x; Q4_0 1024x3584: 1.13x    4 / 16 / 64 tokens 1.10x / 1.05x
                                 / 4.45x (3584x1024)                    / 0.84x; Q4_0 mix: decode
                                                                        1.02-1.09x, prefill 2.21x /
                                                                        2.09x / 0.93-1.00x, 512: 0.98x

(Xeon: 2026-12-05, docs/benchmarks.md "On an Intel Xeon with AMX", the model column from alternating
rounds against llama.cpp, the decode of one run each; EPYC: 2026-12-01, the same file's
ggml-quantization tables and integration/README.md's `ab_decode --feature repack-weights` rounds.)
At 48 activation rows and more a repacked weight is unpacked slice by slice for ggml's plain
kernels, which a 64-token prompt pays on either CPU. So a type is repacked by default where both
its decode steps and its short prompts are faster so: Q4_0 and Q4_K on the Intel CPU, Q4_0 on the
EPYC, whose plain Q4_K kernels decode faster (the 0.95x) and keep 64-token prompts faster. Other CPUs,
unmeasured, keep the plain layout (llama.cpp repacks on every AVX2 CPU); measure one with `nox -s
bench-e2e -- --backends kernels-plain kernels-repacked llama.cpp` and `python -m tools.bench.ab_decode
--feature repack-weights` before adding it here. Either layout computes the same products up to the
float32 order of per-block sums, but a repacked weight's results depend on how many rows share a call
(ggml's gemm and gemv round the activations apart), as in llama.cpp.
"""

from __future__ import annotations

from .types import GGMLType

CPUINFO = "/proc/cpuinfo"

# CPU vendor (cpuinfo's vendor_id) -> GGUF types whose repacked layout is the faster one there
# (the module docstring's table)
FASTER_REPACKED: dict[str, frozenset[int]] = {
    "GenuineIntel": frozenset({GGMLType.Q4_0, GGMLType.Q4_K}),
    "AuthenticAMD": frozenset({GGMLType.Q4_0}),
}


def read_cpuinfo(path: str = CPUINFO) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("vendor_id", "flags", ...); empty where it
    cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                name, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def flags(info: dict[str, str]) -> frozenset[str]:
    """The CPU's feature flags (Linux's names: "avx512_bf16", "amx_tile", ...)."""
    return frozenset(info.get("flags", "").split())


CPU: dict[str, str] = read_cpuinfo()


def faster_repacked_types(info: dict[str, str] | None = None) -> frozenset[int]:
    """GGUF type ids whose weights are faster in ggml-cpu's repacked layout on this CPU (`info`: a
    `read_cpuinfo` result, this machine's by default): what an integration repacks unless told
    otherwise. Empty on CPUs where the plain layout is measured as fast or not measured."""
    info = CPU if info is None else info
    return FASTER_REPACKED.get(info.get("vendor_id", ""), frozenset())

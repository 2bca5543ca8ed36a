"""Flash attention at Qwen3.5's full-attention head layouts: decode against 512 / 4096 / 16384 cached
keys and a 512-token causal prefill (float32, batch 1).

    kernels benchmark ./packages/ggml-attn                  # a local build
    kernels benchmark ggml-org/ggml-attn@v1                 # the published one

Workloads are named <layout>_<decode_kv<keys>|prefill_512>, layouts 0.8B (8 query heads, 2 KV heads,
head dim 256) and 4B (16 / 4 / 256). Each class times one implementation of the same workloads:
  FlashAttn              ggml_attn.flash_attn_forward: transformers' attention-function interface
                         (what a kernelized model calls), on ggml's flash attention
  FlashAttn_sdpa         transformers' sdpa_attention_forward (torch's scaled_dot_product_attention)
  FlashAttn_eager        transformers' eager_attention_forward (Llama's), with an additive causal mask
  FlashAttn_reference    ggml_attn.reference.flash_attn (the package's pure-PyTorch reference)
  FlashAttn_ggml         ggml's own ggml_flash_attn_ext through llama-cpp-python's libggml (the
                         repository's tools/testing/ggml_ctypes.py; present when that is importable,
                         as in `nox -s bench`): one graph with ggml's additive f16 causal mask and
                         native GQA, K/V in the type ours is given (float32 here), built once, only
                         ggml_graph_compute timed
verify_* is torch's SDPA (GQA, bottom-right causal mask): every implementation matches it to ~1e-6
of the output scale. GGML_KERNELS_BENCH_QUICK=1 runs the 0.8B layout's 512-key decode and the
prefill (for tests).
"""

import os

import torch
from kernels.benchmark import Benchmark

try:  # ggml's own op: llama-cpp-python's libggml, through this repository's tools (not on the Hub)
    from tools.testing import ggml_ctypes
except ImportError:
    ggml_ctypes = None

QUICK = os.environ.get("GGML_KERNELS_BENCH_QUICK") == "1"
LAYOUTS = {"0.8B": (8, 2, 256)} if QUICK else {"0.8B": (8, 2, 256), "4B": (16, 4, 256)}
CASES = {"prefill_512": (512, 512)}  # name -> (queries, keys)
CASES.update({f"decode_kv{n}": (1, n) for n in ([512] if QUICK else [512, 4096, 16384])})


class _Layer(torch.nn.Module):
    """What transformers' attention functions read off the attention layer."""

    def __init__(self, hq: int, hkv: int):
        super().__init__()
        self.num_key_value_groups = hq // hkv
        self.is_causal = True
        self.training = False


def _add(cls, name: str, *params) -> None:
    """Workload `name` of cls and its subclasses: prepare(*params), then run() timed, reference() checked."""
    setattr(cls, f"setup_{name}", lambda self: self.prepare(*params))
    setattr(cls, f"benchmark_{name}", lambda self: self.run())
    setattr(cls, f"verify_{name}", lambda self: self.reference())


class FlashAttn(Benchmark):
    """Outputs as the attention functions return them: (B, Sq, Hq, D)."""

    seed = 0

    def prepare(self, hq: int, hkv: int, d: int, sq: int, skv: int) -> None:
        gen = torch.Generator().manual_seed(sq * 31 + skv)
        self.q = torch.randn(1, hq, sq, d, generator=gen)
        self.k = torch.randn(1, hkv, skv, d, generator=gen)
        self.v = torch.randn(1, hkv, skv, d, generator=gen)
        self.layer, self.scale = _Layer(hq, hkv), d**-0.5
        visible = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
        self.visible = visible
        self.additive_mask = torch.zeros(1, 1, sq, skv).masked_fill(~visible, float("-inf"))

    def run(self) -> None:
        self.out = self.kernel.flash_attn_forward(self.layer, self.q, self.k, self.v, None, scaling=self.scale)[0]

    def reference(self) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.visible,
                                                               scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2)


class FlashAttn_sdpa(FlashAttn):
    def run(self) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        sq = self.q.shape[2]
        self.out = sdpa_attention_forward(self.layer, self.q, self.k, self.v, None, scaling=self.scale,
                                          is_causal=sq > 1)[0]


class FlashAttn_eager(FlashAttn):
    def run(self) -> None:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        mask = self.additive_mask if self.q.shape[2] > 1 else None
        self.out = eager_attention_forward(self.layer, self.q, self.k, self.v, mask, scaling=self.scale)[0]


class FlashAttn_reference(FlashAttn):
    def run(self) -> None:
        out = self.kernel.reference.flash_attn(self.q, self.k, self.v, causal=True, compute_dtype=torch.float32)
        self.out = out.transpose(1, 2)


if ggml_ctypes is not None and ggml_ctypes.available():

    class FlashAttn_ggml(FlashAttn):
        """The graph is made in prepare(); run() only computes it and `out` reads its (Sq, Hq, D) result."""

        def prepare(self, hq: int, hkv: int, d: int, sq: int, skv: int) -> None:
            super().prepare(hq, hkv, d, sq, skv)
            self.graph = ggml_ctypes.FlashAttn(hq, hkv, d, sq, skv, self.scale, "f32", torch.get_num_threads())
            self.graph.set_input(self.q[0], self.k[0], self.v[0])

        def run(self) -> None:
            self.graph.compute()

        @property
        def out(self):
            graph = self.__dict__.get("graph")
            return None if graph is None else torch.from_numpy(graph.output()).unsqueeze(0)

        @out.setter
        def out(self, value):
            pass


for _layout, (_hq, _hkv, _d) in LAYOUTS.items():
    for _case, (_sq, _skv) in CASES.items():
        _add(FlashAttn, f"{_layout}_{_case}", _hq, _hkv, _d, _sq, _skv)

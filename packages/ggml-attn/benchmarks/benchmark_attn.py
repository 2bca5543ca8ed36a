"""Flash attention at Qwen3.5's full-attention head layout: decode against 512 / 4096 / 16384 cached
keys and a 512-token causal prefill (8 query heads, 2 KV heads, head dim 256; float32).

    kernels benchmark ./packages/ggml-attn

verify_* is torch's SDPA (GQA, bottom-right causal mask): the kernel matches it to ~1e-6 of the
output scale.
"""

import torch

from kernels.benchmark import Benchmark

HQ, HKV, D = 8, 2, 256


class FlashAttn(Benchmark):
    seed = 0

    def _setup(self, sq: int, skv: int) -> None:
        gen = torch.Generator().manual_seed(sq * 31 + skv)
        self.q = torch.randn(1, HQ, sq, D, generator=gen)
        self.k = torch.randn(1, HKV, skv, D, generator=gen)
        self.v = torch.randn(1, HKV, skv, D, generator=gen)
        self.out = torch.empty(1, HQ, sq, D)

    def _run(self) -> None:
        self.out = self.kernel.flash_attn(self.q, self.k, self.v, causal=True)

    def _verify(self) -> torch.Tensor:
        sq, skv = self.q.shape[2], self.k.shape[2]
        visible = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
        return torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=visible, enable_gqa=True)


def _add(name: str, sq: int, skv: int) -> None:
    setattr(FlashAttn, f"setup_{name}", lambda self: self._setup(sq, skv))
    setattr(FlashAttn, f"benchmark_{name}", lambda self: self._run())
    setattr(FlashAttn, f"verify_{name}", lambda self: self._verify())


for _skv in (512, 4096, 16384):
    _add(f"decode_kv{_skv}", 1, _skv)
_add("prefill_512", 512, 512)

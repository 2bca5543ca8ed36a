"""Gated delta net and the short causal conv at Qwen3.5's linear-attention shapes (16 key heads x 128,
16 or 32 value heads x 128, conv kernel 4, conv channels 2 * 16 * 128 + Hv * 128), batch 1:
decode (T = 1, on a state) and a 512-token prefill.

    kernels benchmark ./packages/ggml-gated-delta-net          # a local build
    kernels benchmark ggml-org/ggml-gated-delta-net@v1         # the published one

Workloads are named <op>_<decode|prefill512>_hv<Hv>. Each class times one implementation:
  GatedDeltaNet, CausalConv1d     this package's ops
  GatedDeltaNetInPlace            decode with gated_delta_net_, which updates the state where it is, as
                                  a model's decode step does (checked on the first call's state)
  GatedDeltaNet_ggml, GatedDeltaNetInPlace_ggml, CausalConv1d_ggml
                                  ggml's own graphs as llama.cpp's Qwen3.5 graph builds them, through
                                  llama-cpp-python's libggml (the repository's
                                  tools/testing/ggml_ctypes.py; present when that is importable, as in
                                  `nox -s bench`), built once, only ggml_graph_compute timed: q/k L2
                                  norms then ggml_gated_delta_net; the conv state's tail concatenated
                                  with the tokens, ggml_ssm_conv, ggml_silu, the next state copied out
  GatedDeltaNet_transformers      transformers' torch fallbacks for the same rule, q/k repeated to the
                                  value heads as the layer does: torch_recurrent_gated_delta_rule for
                                  decode, the chunked torch_chunk_gated_delta_rule for prefill
  Layer                           the whole Qwen3_5GatedDeltaNet forward (hidden 1024, float32 nn.Linear
                                  projections) kernelized onto this package's layer: decode 1 token on
                                  a cache holding a 32-token prompt, prefill 512 tokens from an empty one
  Layer_transformers              the same module as transformers ships it (its torch fallbacks)
The ops' reference (verify_*) is the package's own per-token loop (reference.py) in float32; the
kernel matches it to ~1e-6 of the output scale, far inside the runner's atol of 1e-2, and its time
is that loop's (vectorised over heads). The layers are not checked here (their caches change with
every call; tests/test_layer.py compares them). GGML_KERNELS_BENCH_QUICK=1 runs 16 value heads only
(for tests).
"""

import copy
import logging
import os
from pathlib import Path

import torch
from kernels.benchmark import Benchmark

try:  # ggml's own op: llama-cpp-python's libggml, through this repository's tools (not on the Hub)
    from tools.testing import ggml_ctypes
except ImportError:
    ggml_ctypes = None

QUICK = os.environ.get("GGML_KERNELS_BENCH_QUICK") == "1"
HIDDEN, HK, D, KERNEL = 1024, 16, 128, 4
VALUE_HEADS = [16] if QUICK else [16, 32]
TOKENS = {"decode": 1, "prefill512": 512}
PROMPT = 32  # tokens already in the cache of a layer decode


class _GdnInputs:
    """q, k, v, g, beta and a non-zero state in ggml's layout (a transposed view), as a model's decode
    step passes back the state the op returned; the reference from that state."""

    seed = 0

    def _setup(self, tokens: int, hv: int) -> None:
        gen = torch.Generator().manual_seed(tokens * 100 + hv)
        self.q = torch.randn(1, tokens, HK, D, generator=gen)
        self.k = torch.randn(1, tokens, HK, D, generator=gen)
        self.v = torch.randn(1, tokens, hv, D, generator=gen)
        self.g = -torch.rand(1, tokens, hv, generator=gen)
        self.beta = torch.rand(1, tokens, hv, generator=gen)
        state = torch.randn(1, hv, D, D, generator=gen) * 0.1
        self.state = state.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, ggml's strides
        self.out = torch.empty(1, tokens, hv, D)
        self.initial_state = self.state.clone()  # what the first call reads (the in-place op changes state)

    def _verify(self) -> torch.Tensor:
        out, _ = self.kernel.reference.gated_delta_net(self.q, self.k, self.v, self.g, self.beta, self.initial_state,
                                                       l2_normalize_qk=True)
        return out


class GatedDeltaNet(_GdnInputs, Benchmark):
    """gated_delta_net with q/k L2-normalised in the op: output and a new state."""

    def _run(self) -> None:
        self.out, _ = self.kernel.gated_delta_net(self.q, self.k, self.v, self.g, self.beta, self.state, l2_normalize_qk=True)


class GatedDeltaNetInPlace(_GdnInputs, Benchmark):
    """gated_delta_net_ (decode): the state updated where it is, each call from the last one's state
    (the same work every call; the runners check the first call)."""

    def _run(self) -> None:
        self.out = self.kernel.gated_delta_net_(self.q, self.k, self.v, self.g, self.beta, self.state, l2_normalize_qk=True)


class CausalConv1d(Benchmark):
    """causal_conv1d + SiLU on x (1, C, T) as the layer passes it (a transposed view), with a
    (1, C, K) rolling state."""

    seed = 0

    def _setup(self, tokens: int, hv: int) -> None:
        gen = torch.Generator().manual_seed(tokens * 100 + hv)
        channels = 2 * HK * D + hv * D
        self.x = torch.randn(1, tokens, channels, generator=gen).transpose(1, 2)
        self.w = torch.randn(channels, 1, KERNEL, generator=gen) * 0.5
        self.state = torch.randn(1, channels, KERNEL, generator=gen)
        self.out = torch.empty(1, channels, tokens)

    def _run(self) -> None:
        self.out, _ = self.kernel.causal_conv1d(self.x, self.w, self.state, "silu")

    def _verify(self) -> torch.Tensor:
        out, _ = self.kernel.reference.causal_conv1d(self.x, self.w, self.state, "silu")
        return out


class _Ggml:
    """ggml's graph, made in _setup(); _run() only computes it and `out` reads its result."""

    def _run(self) -> None:
        self.graph.compute()

    @property
    def out(self):
        graph = self.__dict__.get("graph")
        return None if graph is None else self._result(torch.from_numpy(graph.output()))

    @out.setter
    def out(self, value):
        pass


if ggml_ctypes is not None and ggml_ctypes.available():

    class _GdnGraph(_Ggml):
        def _setup(self, tokens: int, hv: int) -> None:
            super()._setup(tokens, hv)
            self.graph = ggml_ctypes.GatedDeltaNet(HK, hv, D, tokens, n_threads=torch.get_num_threads())
            self.graph.set_input(self.q[0], self.k[0], self.v[0], self.g[0], self.beta[0], self.state[0])

        def _result(self, y: torch.Tensor) -> torch.Tensor:
            return y.unsqueeze(0)  # (1, T, Hv, D)

    class GatedDeltaNet_ggml(_GdnGraph, GatedDeltaNet):
        pass

    class GatedDeltaNetInPlace_ggml(_GdnGraph, GatedDeltaNetInPlace):
        """The same graph; its result, the new state included, stays in the graph's own memory."""

    class CausalConv1d_ggml(_Ggml, CausalConv1d):
        def _setup(self, tokens: int, hv: int) -> None:
            super()._setup(tokens, hv)
            channels = self.x.shape[1]
            self.graph = ggml_ctypes.CausalConv1d(channels, KERNEL, tokens, torch.get_num_threads())
            # x (1, C, T) is a view of (1, T, C) memory: the projection's rows, as ggml reads them
            self.graph.set_input(self.x[0].T, self.w[:, 0], self.state[0, :, 1:])

        def _result(self, y: torch.Tensor) -> torch.Tensor:
            return y.T.unsqueeze(0)  # (T, C) -> (1, C, T)


class GatedDeltaNet_transformers(GatedDeltaNet):
    def _run(self) -> None:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        rule = hf.torch_recurrent_gated_delta_rule if self.q.shape[1] == 1 else hf.torch_chunk_gated_delta_rule
        repeat = self.v.shape[2] // HK
        q, k = self.q.repeat_interleave(repeat, 2), self.k.repeat_interleave(repeat, 2)
        self.out, _ = rule(q, k, self.v, g=self.g, beta=self.beta, initial_state=self.state, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)


class Layer_transformers(Benchmark):
    """Qwen3_5GatedDeltaNet.forward(x, cache_params=cache), random weights (seed 0)."""

    seed = 0

    def _setup(self, tokens: int, hv: int) -> None:
        from transformers import DynamicCache
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        self.config = Qwen3_5TextConfig(
            hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=HK,
            linear_num_value_heads=hv, linear_key_head_dim=D, linear_value_head_dim=D,
            linear_conv_kernel_dim=KERNEL, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
            intermediate_size=3584, vocab_size=1024,
        )
        torch.manual_seed(0)
        self.module = self._prepared(Qwen3_5GatedDeltaNet(self.config, layer_idx=0).eval().requires_grad_(False))
        gen = torch.Generator().manual_seed(tokens * 100 + hv)
        self.x = torch.randn(1, tokens, HIDDEN, generator=gen)
        self.cache = None
        if tokens == 1:  # decode: on a cache that holds a prompt
            self.cache = DynamicCache(config=self.config)
            self.module(torch.randn(1, PROMPT, HIDDEN, generator=gen), cache_params=self.cache)

    def _prepared(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def _run(self) -> None:
        from transformers import DynamicCache

        cache = self.cache if self.cache is not None else DynamicCache(config=self.config)  # prefill: a new one
        self.out = self.module(self.x, cache_params=cache)


class Layer(Layer_transformers):
    def _prepared(self, module: torch.nn.Module) -> torch.nn.Module:
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

        repo = LocalLayerRepository(repo_path=Path(self.kernel.__file__).parent, layer_name="Qwen3_5GatedDeltaNet")
        module = copy.deepcopy(module)
        # kernelize warns once per inner layer it has no mapping for (RMSNormGated, causal_conv1d_fn,
        # ...): those never run, this layer's forward replaces them
        quiet = logging.getLogger("kernels.layer.layer")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with use_kernel_mapping({"Qwen3_5GatedDeltaNet": {"cpu": repo}}, inherit_mapping=False):
                kernelize(module, device="cpu", mode=Mode.INFERENCE)
        finally:
            quiet.setLevel(level)
        return module


def _add(cls, op: str, phase: str, hv: int, checked: bool = True) -> None:
    """Workload <op>_<phase>_hv<hv> of cls and its subclasses: _setup, then _run timed, _verify checked."""
    name = f"{op}_{phase}_hv{hv}"
    tokens = TOKENS[phase]
    setattr(cls, f"setup_{name}", lambda self: self._setup(tokens, hv))
    setattr(cls, f"benchmark_{name}", lambda self: self._run())
    if checked:
        setattr(cls, f"verify_{name}", lambda self: self._verify())


for _hv in VALUE_HEADS:
    for _phase in TOKENS:
        _add(GatedDeltaNet, "gdn", _phase, _hv)
        if _phase == "decode":
            _add(GatedDeltaNetInPlace, "gdn", _phase, _hv)
        _add(CausalConv1d, "conv", _phase, _hv)
        _add(Layer_transformers, "layer", _phase, _hv, checked=False)

"""Packed GGUF matrix products at Qwen3.5 linear shapes: decode and short prompts (M = 1, 8; 2 and 4
on the two largest shapes, ours and ggml's op only) and prefill (M = 16, 64, 512), against ggml's own
op and transformers' CPU paths.

    kernels benchmark ./packages/ggml-quantization          # a local build
    kernels benchmark ggml-org/ggml-quantization@v1         # the published one

Workloads are named <type>_<N>x<K>_m<M> for a weight of N output rows and K input columns. Each
class times one implementation of the same workloads:
  MulMatVec (M <= 8), MulMat (M > 8)
                   this package: mul_mat_vec / mul_mat on the packed blocks (mul_mat as it chooses:
                   block-32 weights from 32-128 rows by type take its dense path on a CPU with
                   bfloat16 dot products, see ggml_quantization/dense_prefill.py)
  MulMat_exact     mul_mat(..., exact=True): ggml's own kernel at every row count. Against MulMat
                   at 32, 64, 96 and 128 rows on every block-32 type (the *_3584x1024_m32 ..
                   m128 workloads) it is the measurement behind dense_prefill.MIN_ROWS
  *_ggml           ggml's own GGML_OP_MUL_MAT through llama-cpp-python's libggml (the repository's
                   tools/testing/ggml_ctypes.py; present when that is importable, as in `nox -s bench`):
                   a one-op graph planned once, only ggml_graph_compute timed
  *_tf_f32, *_tf_bf16
                   what transformers runs per call on the CPU without a kernel: it dequantizes the
                   GGUF at load and keeps dense weights, so each call is a dense F.linear (float32, or
                   bfloat16 for a model loaded in it)
  MulMat_tf_unpack what transformers runs for M > 8 with the kernel installed: GgufLinear dequantizes
                   the packed weight with its own torch code on every call, then multiplies
  MulMatVec_huge_pages
                   MulMatVec on the weight copied to transparent huge pages (`huge_pages.place`, as
                   the integration loads GGUF weights); MulMatVec reads torch's 4 KiB pages
  MulMatGroup      a layer's sibling projections in one mul_mat_group call
  MulMatId, MulMatId_ggml
                   mixture of experts: mul_mat_id on a Qwen3.5-MoE-shaped layer's experts (gate/up
                   and down, 1-64 tokens), and ggml's own GGML_OP_MUL_MAT_ID on the same copies
  MulMatRepacked   mul_mat on the weight in ggml-cpu's repacked layout (`repack`) at 1-64 rows, the
                   types this CPU repacks (Q4_0, Q4_K here); compare with MulMatVec / MulMat
Weights are streamed from memory as in a real decode: each workload cycles through copies of its
weight (rows in different orders, so no two pages are equal) until they overflow the last-level
cache four times over. The packed implementations of one workload (ours and ggml's graph, which
borrows their memory) read the very same copies: where a copy's pages happen to lie moved a one-row
product by up to ~10 % on the 2-core EPYC, the same code on two sets of copies of one weight, which
alternating rounds do not average out.

The reference (verify_*) is a dense float32 matmul against the dequantized weight, with the
activations rounded the way ggml's CPU dot products round them (to Q8_0 or Q8_K blocks, see
`_round_like_ggml`): ours and ggml's match it to ~1e-5 of the output scale (~1e-3 in the rare row
where an activation sits exactly on a rounding tie), inside the runner's atol of 1e-2. Where
`mul_mat` takes its dense path the reference is the same bfloat16 product on the same chunks of
weight rows (F.linear of the bfloat16 activations and weight chunks). transformers'
float32 paths do not round activations and are checked against the unrounded product; bfloat16 is
not checked (its own rounding is larger than the runner's tolerance). GGML_KERNELS_BENCH_QUICK=1
runs two types at one shape each, weights cache-resident (for tests).
"""

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark

try:  # ggml's own op: llama-cpp-python's libggml, through this repository's tools (not on the Hub)
    from tools.testing import ggml_ctypes
except ImportError:
    ggml_ctypes = None

QUICK = os.environ.get("GGML_KERNELS_BENCH_QUICK") == "1"
TYPES = ["Q4_0", "Q4_K"] if QUICK else ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
MATVEC = {1: [(1024, 3584)]} if QUICK else {m: [(1024, 1024), (3584, 1024), (1024, 3584), (2560, 9216), (9216, 2560)]
                                            for m in (1, 8)}  # M -> (N, K)
MATMAT = {64: [(1024, 3584)]} if QUICK else {16: [(3584, 1024), (1024, 3584)],
                                             64: [(3584, 1024), (1024, 3584), (9216, 2560)],
                                             512: [(3584, 1024), (1024, 3584)]}
# the rows between 1 and 8 (a short prompt's) on the largest shapes: ours against ggml's op only
BETWEEN = {} if QUICK else {m: [(2560, 9216), (9216, 2560)] for m in (2, 4)}
# mul_mat's dense path against ggml's kernel around its thresholds (dense_prefill.MIN_ROWS)
BLOCK_32_TYPES = ["Q4_1"] if QUICK else ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
THRESHOLDS = {32: [(1024, 3584)]} if QUICK else {m: [(3584, 1024)] for m in (32, 64, 96, 128)}
# short prompts: the repacked layout against the plain one (Q4_0 and Q4_K: every AVX2 CPU repacks them)
REPACKED_TYPES = ["Q4_0", "Q4_K"]
SHORT = {1: [(1024, 3584)]} if QUICK else {m: [(3584, 1024), (1024, 3584)] for m in (1, 4, 8, 16, 64)}
MAX_COPIES = 64


def _llc_bytes() -> int:
    """Largest CPU cache, from sysfs (32 MiB when it cannot be read)."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            s = f.read_text().strip().upper()
            best = max(best, int(s.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1))
        except (OSError, ValueError):
            continue
    return best or (32 << 20)


ROTATE_BYTES = 0 if QUICK else max(4 * _llc_bytes(), 64 << 20)


def _copies(t: torch.Tensor, gen: torch.Generator) -> list[torch.Tensor]:
    """t and row-permuted copies of it, enough to overflow the cache ROTATE_BYTES times over."""
    n = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / (t.numel() * t.element_size()))))
    return [t] + [t[torch.randperm(t.shape[0], generator=gen)] for _ in range(n - 1)]


# the packed weight's copies of the last workload set up, shared by the implementations that read
# the packed blocks as they are: (type, N, K, M) -> copies (one entry: a workload's copies are
# dropped when the next workload's are made)
_shared_copies: dict[tuple, list[torch.Tensor]] = {}


def _packed_copies(key: tuple, blocks: torch.Tensor, gen: torch.Generator) -> list[torch.Tensor]:
    found = _shared_copies.get(key)
    if found is None or not torch.equal(found[0], blocks):
        _shared_copies.clear()
        found = _shared_copies[key] = _copies(blocks, gen)
    return found


def _round_like_ggml(x: torch.Tensor, vec_dot_type: str) -> torch.Tensor:
    """x as ggml-cpu sees it after quantizing it to the weight type's vec_dot_type.

    Q8_0 (and Q8_1, Q4_1's: the same values, plus a block sum the dot product takes as fp16): blocks of
    32, scale amax/127 stored as fp16, values rounded to nearest (ties to even).
    Q8_K: blocks of 256, scale from the signed value of largest magnitude, stored as float32.
    """
    m, k = x.shape
    if vec_dot_type in ("Q8_0", "Q8_1"):
        b = x.reshape(m, k // 32, 32)
        amax = b.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(b * inv)
        d = (amax / 127.0).half().float()
        return (q * d).reshape(m, k)
    if vec_dot_type == "Q8_K":
        b = x.reshape(m, k // 256, 256)
        idx = b.abs().argmax(-1, keepdim=True)
        big = b.gather(-1, idx)
        iscale = torch.where(big != 0, -127.0 / big, torch.zeros_like(big))
        q = torch.round(b * iscale).clamp(max=127)
        d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale))
        return (q * d).reshape(m, k)
    raise ValueError(f"no reference rounding for activations of type {vec_dot_type}")


class _WeightCopies:
    """A workload's weight copies, `weights` (made by `_operand` from each copy), taken in turn."""

    def _operand(self, weight: torch.Tensor):
        """What _run calls with one copy of the weight (a module or a graph for some implementations)."""
        return weight

    def _next(self):
        w = self.weights[self.calls % len(self.weights)]
        self.calls += 1
        return w


class _PackedProduct(_WeightCopies):
    """Shared setup, rotation and reference (not a Benchmark itself: the runner would time it).
    `run` calls the implementation on the next copy of the weight; the first call uses the original,
    which is the one the runner checks."""

    seed = 0
    checked = True  # whether the runner compares the output with _verify

    def _setup(self, type_name: str, n: int, k: int, m: int) -> None:
        gen = torch.Generator().manual_seed(n * 7919 + k * 31 + m)
        # weights ~ N(0, 1/K) keep every output O(1), whatever K is
        w = torch.randn(n, k, generator=gen) / k**0.5
        self.type, self.n, self.k, self.m, self.calls = type_name, n, k, m, 0
        self.blocks = self.kernel.quantize(w, type_name)
        self.x = torch.randn(m, k, generator=gen)
        self.out = torch.empty(m, n)
        # the reference, precomputed so verify times only a dense float32 matmul
        self.w_dense = self.kernel.dequantize(self.blocks, type_name, n, k, torch.float32)
        self.x_rounded = _round_like_ggml(self.x, self.kernel.type_info(type_name).vec_dot_type.name)
        weight = self._weight()
        copies = (_packed_copies((type_name, n, k, m), weight, gen) if weight is self.blocks
                  else _copies(weight, gen))
        self.weights = [self._operand(w) for w in copies]

    def _weight(self) -> torch.Tensor:
        """The weight this implementation reads: the packed blocks (dense implementations override it)."""
        return self.blocks

    def _verify(self) -> torch.Tensor:
        return F.linear(self.x_rounded, self.w_dense)


class MulMatVec(_PackedProduct, Benchmark):
    """Decode: transformers calls mul_mat_vec for M <= 8 rows."""

    def _run(self) -> None:
        self.out = self.kernel.mul_mat_vec(self._next(), self.x, self.type, self.n)


class MulMat(_PackedProduct, Benchmark):
    """Prefill: mul_mat on the packed weight, no dense copy of the whole weight (its dense path
    unpacks a chunk of rows at a time)."""

    def _run(self) -> None:
        self.out = self.kernel.mul_mat(self._next(), self.x, self.type, self.n)

    def _verify(self) -> torch.Tensor:
        dense = self.kernel.dense_prefill
        if dense.applies(self.blocks, self.x, int(self.kernel.GGMLType[self.type])):
            # the same bfloat16 products on the same chunks of weight rows: oneDNN on AMX CPUs picks
            # its kernel by shape, and the whole weight at once gave outputs a bfloat16 step (0.0156)
            # away on an Intel Xeon
            rows = dense.chunk_rows(self.n, self.k)
            xb, wb = self.x.bfloat16(), self.w_dense.bfloat16()
            return torch.cat([F.linear(xb, wb[s : s + rows]) for s in range(0, self.n, rows)], dim=1).float()
        return super()._verify()


class MulMat_exact(_PackedProduct, Benchmark):
    """Prefill on ggml's own kernel whatever the row count (exact=True)."""

    def _run(self) -> None:
        self.out = self.kernel.mul_mat(self._next(), self.x, self.type, self.n, exact=True)


class MulMatVec_huge_pages(_PackedProduct, Benchmark):
    """Decode on the packed weight copied to transparent huge pages (`huge_pages.place`, as the
    integration loads GGUF weights) instead of torch's 4 KiB pages: against MulMatVec."""

    def _operand(self, weight: torch.Tensor):
        return self.kernel.huge_pages.place([weight])[0]

    def _run(self) -> None:
        self.out = self.kernel.mul_mat_vec(self._next(), self.x, self.type, self.n)


class MulMatRepacked(_PackedProduct, Benchmark):
    """Short prompts: mul_mat on the repacked layout (ggml's gemv, then gemm from 4 rows, then the plain
    kernels on unpacked slices from 48)."""

    def _weight(self):
        t = int(self.kernel.GGMLType[self.type])
        if t not in self.kernel.repacked_types():
            raise ValueError(f"this CPU's ggml does not repack {self.type} (an x86 CPU without AVX2)")
        return self.kernel.repack(self.blocks, t)

    def _run(self) -> None:
        t = self.kernel.repacked_type(self.type)
        self.out = self.kernel.mul_mat(self._next(), self.x, t, self.n)


class _Dense(_PackedProduct):
    """transformers without a kernel: the weight dequantized at load, F.linear per call."""

    dtype = torch.float32

    def _weight(self):
        return self.w_dense.to(self.dtype)

    def _run(self) -> None:
        self.out = F.linear(self.x.to(self.dtype), self._next())

    def _verify(self) -> torch.Tensor:
        return F.linear(self.x, self.w_dense)  # transformers does not round the activations


class MulMatVec_tf_f32(_Dense, Benchmark):
    pass


class MulMat_tf_f32(_Dense, Benchmark):
    pass


class _DenseBf16(_Dense):
    dtype = torch.bfloat16
    checked = False

    def _run(self) -> None:
        self.out = F.linear(self.x.to(self.dtype), self._next()).float()


class MulMatVec_tf_bf16(_DenseBf16, Benchmark):
    pass


class MulMat_tf_bf16(_DenseBf16, Benchmark):
    pass


class MulMat_tf_unpack(_PackedProduct, Benchmark):
    """transformers' GgufLinear wired to this kernel as transformers wires the Hub one: above 8 rows
    it dequantizes the packed weight with its own torch code on every call."""

    def _operand(self, weight: torch.Tensor):
        import transformers.integrations.gguf.kernels as tk
        from transformers.integrations.gguf.utils import GgufLinear

        tk._gguf_kernel = tk.GgufKernel(self.kernel)
        linear = GgufLinear(self.k, self.n, int(self.kernel.GGMLType[self.type]))
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        return linear

    def _run(self) -> None:
        with torch.inference_mode():
            self.out = self._next()(self.x)

    def _verify(self) -> torch.Tensor:
        return F.linear(self.x, self.w_dense)


class _GgmlGraphs:
    """ggml's own op: `_operand` makes one graph per weight copy, `_run` computes the next one, and
    `out` is read from the graph last run."""

    def _run(self) -> None:
        self.graph = self._next()
        self.graph.compute()

    @property
    def out(self):
        graph = self.__dict__.get("graph")
        return None if graph is None else torch.from_numpy(graph.output())

    @out.setter
    def out(self, value):
        pass


class _Ggml(_GgmlGraphs, _PackedProduct):
    """GGML_OP_MUL_MAT, reading the weight copies in place."""

    def _operand(self, weight: torch.Tensor):
        t = int(self.kernel.GGMLType[self.type])
        graph = ggml_ctypes.MulMat(weight.numpy(), t, self.k, self.m, torch.get_num_threads(), borrow=True)
        graph.set_input(self.x.numpy())
        return graph


MATVEC_CLASSES = [MulMatVec, MulMatVec_huge_pages, MulMatVec_tf_f32, MulMatVec_tf_bf16]
MATMAT_CLASSES = [MulMat, MulMat_exact, MulMat_tf_f32, MulMat_tf_bf16, MulMat_tf_unpack]
if ggml_ctypes is not None and ggml_ctypes.available():

    class MulMatVec_ggml(_Ggml, Benchmark):
        pass

    class MulMat_ggml(_Ggml, Benchmark):
        pass

    MATVEC_CLASSES.append(MulMatVec_ggml)
    MATMAT_CLASSES.append(MulMat_ggml)


class MulMatGroup(Benchmark):
    """A layer's sibling projections, which read the same activations, in one mul_mat_group call:
    decode (Qwen3.5-0.8B shapes, Q4_K_M types) and a short prompt (SmolLM2's q/k/v). The timed call includes concatenating the outputs into
    one tensor, which the runner compares with the reference."""

    seed = 0

    def _setup(self, parts: list[tuple[str, int]], k: int, m: int) -> None:
        gen = torch.Generator().manual_seed(k + m + len(parts))
        self.types, self.rows = [t for t, _ in parts], [n for _, n in parts]
        self.blocks, dense, rounded = [], [], []
        x = torch.randn(m, k, generator=gen)
        for type_name, n in parts:
            blocks = self.kernel.quantize(torch.randn(n, k, generator=gen) / k**0.5, type_name)
            self.blocks.append(blocks)
            dense.append(self.kernel.dequantize(blocks, type_name, n, k, torch.float32))
            rounded.append(_round_like_ggml(x, self.kernel.type_info(type_name).vec_dot_type.name))
        self.x, self.dense, self.rounded = x, dense, rounded
        self.out = torch.empty(m, sum(self.rows))

    def _bench(self) -> None:
        self.out = torch.cat(self.kernel.mul_mat_group(self.blocks, self.x, self.types, self.rows), -1)

    def _verify(self) -> torch.Tensor:
        return torch.cat([torch.nn.functional.linear(x, w) for x, w in zip(self.rounded, self.dense, strict=True)], -1)

    def setup_attn_qkv_m1(self):
        self._setup([("Q4_K", 4096), ("Q4_K", 512), ("Q6_K", 512)], 1024, 1)

    def benchmark_attn_qkv_m1(self):
        self._bench()

    def verify_attn_qkv_m1(self):
        return self._verify()

    def setup_mlp_gate_up_m1(self):
        self._setup([("Q4_K", 3584), ("Q4_K", 3584)], 1024, 1)

    def benchmark_mlp_gate_up_m1(self):
        self._bench()

    def verify_mlp_gate_up_m1(self):
        return self._verify()

    # a short prompt (4 rows) on SmolLM2-135M's q/k/v (Q4_1), whose 192-row k/v are small
    def setup_smollm2_qkv_m4(self):
        self._setup([("Q4_1", 576), ("Q4_1", 192), ("Q4_1", 192)], 576, 4)

    def benchmark_smollm2_qkv_m4(self):
        self._bench()

    def verify_smollm2_qkv_m4(self):
        return self._verify()


def _add(cls, type_name: str, n: int, k: int, m: int) -> None:
    """Workload <type>_<N>x<K>_m<M> of cls and its subclasses: _setup, then _run timed, _verify checked."""
    name = f"{type_name.lower()}_{n}x{k}_m{m}"
    setattr(cls, f"setup_{name}", lambda self: self._setup(type_name, n, k, m))
    setattr(cls, f"benchmark_{name}", lambda self: self._run())
    if cls.checked:
        setattr(cls, f"verify_{name}", lambda self: self._verify())


for _t in TYPES:
    for _plan, _classes in ((MATVEC, MATVEC_CLASSES), (MATMAT, MATMAT_CLASSES)):
        for _m, _shapes in _plan.items():
            for _n, _k in _shapes:
                for _cls in _classes:
                    _add(_cls, _t, _n, _k, _m)
for _t in TYPES:
    for _m, _shapes in BETWEEN.items():
        for _n, _k in _shapes:
            for _cls in [c for c in MATVEC_CLASSES if c is MulMatVec or c.__name__.endswith("_ggml")]:
                _add(_cls, _t, _n, _k, _m)
for _t in BLOCK_32_TYPES:
    for _m, _shapes in THRESHOLDS.items():
        for _n, _k in _shapes:
            for _cls in (MulMat, MulMat_exact):
                if not hasattr(_cls, f"setup_{_t.lower()}_{_n}x{_k}_m{_m}"):
                    _add(_cls, _t, _n, _k, _m)
for _t in REPACKED_TYPES:
    for _m, _shapes in SHORT.items():
        for _n, _k in _shapes:
            _add(MulMatRepacked, _t, _n, _k, _m)
            if _m in (4, 16):  # the plain layout at the same rows (1, 8 and 64 are in MATVEC / MATMAT)
                _add(MulMatVec, _t, _n, _k, _m)


# Mixture of experts: mul_mat_id on one Qwen3.5-MoE-shaped layer's experts (64 experts of 256 rows
# over a hidden size of 1024, top 8: the held-out MoE file's shapes) as transformers' GGUF MoE layer
# calls it: gate and up in one weight of 512 rows per expert, each token's activation row shared by
# its 8 experts; down with one row per (token, expert) pair. Tokens: a decode step, short prompts and
# a prefill. Workloads are named <projection>_<type>_<E>x<N>x<K>_t<tokens>.
MOE_EXPERTS, MOE_TOP_K = (8, 2) if QUICK else (64, 8)
MOE_PROJECTIONS = {"gate_up": ("Q4_K", 512, 1024, MOE_TOP_K), "down": ("Q6_K", 1024, 256, 1)}  # type, N, K, ids a row
MOE_TOKENS = [1, 4] if QUICK else [1, 4, 16, 64]


class _ExpertProduct(_WeightCopies):
    """Shared setup, rotation and reference of the expert products (the runner times subclasses)."""

    seed = 0

    def _setup(self, projection: str, tokens: int) -> None:
        type_name, n, k, per_row = MOE_PROJECTIONS[projection]
        gen = torch.Generator().manual_seed(n * 7919 + k * 31 + tokens)
        experts = self.kernel.quantize(torch.randn(MOE_EXPERTS * n, k, generator=gen) / k**0.5, type_name)
        picks = torch.stack([torch.randperm(MOE_EXPERTS, generator=gen)[:MOE_TOP_K] for _ in range(tokens)])
        self.ids = (picks if per_row > 1 else picks.reshape(-1, 1)).to(torch.int32)
        self.type, self.n, self.k, self.calls = type_name, n, k, 0
        self.x = torch.randn(self.ids.shape[0], k, generator=gen)
        blocks = experts.view(MOE_EXPERTS, n, -1)
        dense = self.kernel.dequantize(experts, type_name, MOE_EXPERTS * n, k, torch.float32).view(MOE_EXPERTS, n, k)
        rounded = _round_like_ggml(self.x, self.kernel.type_info(type_name).vec_dot_type.name)
        self.expected = torch.stack([torch.einsum("tk,tnk->tn", rounded, dense[self.ids[:, j]])
                                     for j in range(self.ids.shape[1])], dim=1)  # (rows, ids a row, N)
        self.out = torch.empty_like(self.expected)
        copies = _packed_copies(("experts", projection, tokens), blocks, gen)
        self.weights = [self._operand(w) for w in copies]

    def _verify(self) -> torch.Tensor:
        return self.expected


class MulMatId(_ExpertProduct, Benchmark):
    """This package's mul_mat_id on the packed experts."""

    def _run(self) -> None:
        self.out = self.kernel.mul_mat_id(self._next(), self.x, self.ids, self.type, self.n)


MOE_CLASSES = [MulMatId]
if ggml_ctypes is not None and ggml_ctypes.available():

    class MulMatId_ggml(_GgmlGraphs, _ExpertProduct, Benchmark):
        """GGML_OP_MUL_MAT_ID, reading the copies of the experts in place."""

        def _operand(self, experts: torch.Tensor):
            t = int(self.kernel.GGMLType[self.type])
            rows, per_row = self.ids.shape
            graph = ggml_ctypes.MulMatId(experts.numpy(), t, self.k, rows, per_row, torch.get_num_threads(),
                                         borrow=True)
            graph.set_input(self.x.numpy(), self.ids)
            return graph

    MOE_CLASSES.append(MulMatId_ggml)


def _add_experts(cls, projection: str, tokens: int) -> None:
    type_name, n, k, _ = MOE_PROJECTIONS[projection]
    name = f"{projection}_{type_name.lower()}_{MOE_EXPERTS}x{n}x{k}_t{tokens}"
    setattr(cls, f"setup_{name}", lambda self: self._setup(projection, tokens))
    setattr(cls, f"benchmark_{name}", lambda self: self._run())
    setattr(cls, f"verify_{name}", lambda self: self._verify())


for _projection in MOE_PROJECTIONS:
    for _tokens in MOE_TOKENS:
        for _cls in MOE_CLASSES:
            _add_experts(_cls, _projection, _tokens)

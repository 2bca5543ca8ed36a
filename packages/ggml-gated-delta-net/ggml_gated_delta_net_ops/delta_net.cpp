// ggml-gated-delta-net's graph ops, for every backend: ggml's GATED_DELTA_NET op (with rms_norm,
// softplus, sigmoid, silu and swiglu around it) on views of the torch tensors, run by the build's
// backend (ggml-cpu, or upstream's Metal backend). causal_conv1d is per backend (conv_cpu.cpp,
// conv_metal.cpp).
//
// gated_delta_net: one ggml graph per slice of (sequence, value heads): on the CPU single-threaded
// graphs spread over torch's threads (parallel_chunks), on Metal one graph per sequence. ggml pairs
// value head h with key head h % Hk (tiled) but sequence i with q/k sequence i / (n_seqs /
// n_q_seqs) (interleaved); transformers repeats key heads with repeat_interleave (value head h
// reads key head h / (Hv / Hk)). So each slice puts its value heads in ggml's sequence dim (one
// head per "sequence", strides kept, no copies of q/k/v) and the interleaved broadcast is exactly
// transformers'. ggml keeps the state transposed ({Dk, Dv} fastest-first: row j of a head's block
// is column j of transformers' S); the op returns the final state in that memory layout as a (B,
// Hv, Dk, Dv) view, and takes a state in either layout (transposing only a transformers-contiguous
// one). ggml scales the output by 1/sqrt(D); q is pre-scaled so that the result is S^T (scale * q)
// for the caller's scale (default D^-0.5, transformers' convention).
//
// The CPU build moves a slice's state and results with its own loops and memcpy through per-thread
// host scratch (a decode step's slices are microseconds each). A Metal build's tensors may be
// device memory (kTensorsInHostMemory false): there the input state is one torch tensor in ggml's
// layout (the caller's, its transposed copy, or zeros) the graphs read in place, each slice's
// result is a tensor on the op's device, and torch copies it to the output and the state.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gdn_ops.h"
#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace gdn_ops;

namespace {

constexpr int64_t kHeadDims[] = {32, 64, 128};

// ggml rows must be dense; every other stride is kept.
at::Tensor dense_rows(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// q or k (B, T, Hk, D) as the graphs read it: key heads repeated r times on Metal.
at::Tensor key_heads(const at::Tensor& x, int64_t r) {
  return dense_rows(kRepeatKeyHeads && r > 1 ? x.repeat_interleave(r, 2) : x);
}

// A graph leaf over t's elements from `offset` (elements of t from its first) on, ne / nb in ggml's
// order (nb in bytes), noted in t: an address only the backend resolves, in t's own storage (the
// MPS backend binds its Metal buffer at that byte offset), never read by the host.
ggml_tensor* leaf_in(Graph& gr, const at::Tensor& t, int64_t offset, const int64_t (&ne)[4],
                     const size_t (&nb)[4]) {
  const char* address = static_cast<const char*>(t.data_ptr()) + offset * t.element_size();
  ggml_tensor* leaf = gr.raw(ggml_type_of(t.scalar_type()), address, ne, nb);
  gr.note(leaf, t);
  return leaf;
}

// dst[h][i][j] = src[h][j][i] for hs blocks of D x D floats (src block stride `src_stride`).
// ggml's state layout <-> transformers'; 8x8 tiles keep both sides in cache lines. Host memory
// only (host_floats).
void transpose_blocks(const float* src, int64_t src_stride, float* dst, int64_t dst_stride,
                      int64_t hs, int64_t D) {
  constexpr int64_t kTile = 8;
  for (int64_t h = 0; h < hs; ++h) {
    const float* s = src + h * src_stride;
    float* d = dst + h * dst_stride;
    for (int64_t i0 = 0; i0 < D; i0 += kTile) {
      const int64_t i1 = std::min(D, i0 + kTile);
      for (int64_t j0 = 0; j0 < D; j0 += kTile) {
        const int64_t j1 = std::min(D, j0 + kTile);
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = j0; j < j1; ++j) d[i * D + j] = s[j * D + i];
      }
    }
  }
}

// A per-thread float buffer reused across calls. Slices of a decode step need ~0.5 MB of output
// and state; a fresh torch tensor of that size per slice is mmapped and page-faulted on every call
// (~1 ms for 16 heads). Buffers above kKeepBytes are not kept. Host memory: the CPU build's only
// (a Metal build binds only torch storages of the op's device into its graphs).
class Scratch {
 public:
  ~Scratch() { std::free(data_); }
  at::Tensor tensor(int64_t n) {
    TORCH_CHECK(kTensorsInHostMemory,
                "ggml-gated-delta-net: a host scratch buffer would be bound into a graph, which "
                "this build's backend (device memory) does not allow");
    const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
    if (bytes > kKeepBytes) return at::empty({n}, at::kFloat);
    if (bytes > cap_) {
      std::free(data_);
      cap_ = 0;
      data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(data_ != nullptr, "ggml-gated-delta-net: out of memory for a ", bytes,
                  "-byte buffer");
      cap_ = bytes;
    }
    return at::from_blob(data_, {n}, at::TensorOptions().dtype(at::kFloat));
  }

 private:
  static constexpr size_t kKeepBytes = size_t{64} << 20;
  float* data_ = nullptr;
  size_t cap_ = 0;
};

thread_local Scratch t_dst, t_state;

}  // namespace

namespace {

struct DeltaNetDims {
  int64_t B, T, Hv, Hk, D;
};

// The rules of both entry points (in_place: the state is updated in place, so it must be in
// ggml's layout and apart from every input); returns the dims.
DeltaNetDims check_delta_net_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta,
                                    const std::optional<at::Tensor>& state,
                                    std::optional<double> scale, bool in_place) {
  check_float(q, "q");
  check_float(k, "k");
  check_float(v, "v");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must share one dtype, got q ", q.scalar_type(), ", k ",
                   k.scalar_type(), ", v ", v.scalar_type());
  check_dim(q, 4, "q (batch, tokens, key heads, head dim)");
  check_dim(k, 4, "k (batch, tokens, key heads, head dim)");
  check_dim(v, 4, "v (batch, tokens, value heads, head dim)");
  TORCH_CHECK_VALUE(k.sizes() == q.sizes(), "k must have q's shape ", q.sizes(), ", got ",
                    k.sizes());
  const DeltaNetDims dims{v.size(0), v.size(1), v.size(2), q.size(2), v.size(3)};
  const auto [B, T, Hv, Hk, D] = dims;
  TORCH_CHECK_VALUE(q.size(0) == B && q.size(1) == T, "q ", q.sizes(), " and v ", v.sizes(),
                    " must agree on batch and tokens (dims 0 and 1)");
  TORCH_CHECK_VALUE(q.size(3) == D, "key head dim ", q.size(3), " differs from value head dim ", D,
                    ": ggml's gated delta net needs equal head dims");
  TORCH_CHECK_VALUE(std::find(std::begin(kHeadDims), std::end(kHeadDims), D) != std::end(kHeadDims),
                    "head dim ", D, " is not supported (32, 64 or 128)");
  TORCH_CHECK_VALUE(Hk > 0 && Hv % Hk == 0, "value heads (", Hv,
                    ") must be a multiple of key heads (", Hk, ")");
  for (auto [t, name] : {std::pair{&g, "g"}, std::pair{&beta, "beta"}}) {
    check_float(*t, name);
    TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == B && t->size(1) == T && t->size(2) == Hv, name,
                      " must be (batch, tokens, value heads) = ", shape_str({B, T, Hv}), ", got ",
                      t->sizes());
  }
  const bool has_state = state.has_value() && state->defined();
  if (has_state) {
    check_device(*state, "state");
    check_dtype(*state, {at::kFloat}, "state");
    TORCH_CHECK_VALUE(state->dim() == 4 && state->size(0) == B && state->size(1) == Hv &&
                          state->size(2) == D && state->size(3) == D,
                      "state must be (batch, value heads, key dim, value dim) = ",
                      shape_str({B, Hv, D, D}), ", got ", state->sizes());
  }
  check_size({B, Hv, D, D}, at::kFloat, "the state");  // made when none is given
  TORCH_CHECK_VALUE(!scale.has_value() || fits_float32(*scale), "scale must be finite",
                    kFloat32Range, ", got ", *scale);
  if (in_place) {
    TORCH_CHECK_VALUE(
        has_state && state->transpose(2, 3).is_contiguous(),
        "gated_delta_net_ updates the state in place, so it must be in ggml's layout: a state "
        "gated_delta_net returned (or a zeros_like of one), i.e. state.transpose(-1, -2) "
        "contiguous; got strides ",
        state->strides());
    for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}}) {
      check_no_overlap(*state, "state", *t, name);
    }
  }
  return dims;
}

// ggml_scale needs rows packed one after another (ggml_is_padded_1d), which a strided view of q
// is not: such a view is copied first.
ggml_tensor* scaled(Graph& g, ggml_tensor* t, float factor) {
  const auto& G = ggml();
  const bool packed = t->nb[0] == G.ggml_type_size(t->type) &&
                      t->nb[2] == t->nb[1] * static_cast<size_t>(t->ne[1]) &&
                      t->nb[3] == t->nb[2] * static_cast<size_t>(t->ne[2]);
  return G.ggml_scale(g.ctx(), packed ? t : G.ggml_cont(g.ctx(), t), factor);
}

// One gated_delta_net call: the inputs as the graphs read them, the output and the final state.
// One graph per run of whole key groups [h0, h1) of sequence b (run_slice). The value heads go to
// ggml's sequence dim (v {D, 1, T, hs}, q/k {D, 1, T, hs / r}), where ggml broadcasts q/k
// interleaved (sequence i reads i / r): transformers' repeat_interleave. Any head range works when
// r == 1. Slices are described to ggml by offset and strides (leaf_in): a decode step runs
// several slices per thread and torch views would cost more than the small ggml ops around the
// kernel.
class DeltaNetCall {
 public:
  // in_place: the final state overwrites `state` (in ggml's layout) instead of going to a new
  // tensor, saving a state-sized write and the caller's copy into its cache (decode reads and
  // writes the whole 1 MiB state of a Qwen3.5-0.8B layer per token).
  DeltaNetCall(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, const std::optional<at::Tensor>& state, bool l2_normalize_qk,
               std::optional<double> scale, bool in_place, const DeltaNetDims& dims)
      : dims_(dims),
        r_(kRepeatKeyHeads ? 1 : dims.Hv / dims.Hk),
        l2_normalize_qk_(l2_normalize_qk),
        in_place_(in_place),
        has_state_(state.has_value() && state->defined()),
        state_(has_state_ ? *state : at::Tensor()),
        state_ggml_(state_in_ggml_layout(state, q.options(), dims)),
        state_t_(has_state_ && !state_ggml_.defined() ? state->contiguous() : at::Tensor()),
        q_(key_heads(q, dims.Hv / dims.Hk)),
        k_(key_heads(k, dims.Hv / dims.Hk)),
        v_(dense_rows(v)),
        // g and beta as float32 once for all slices (no copy when they already are).
        g_(g.to(at::kFloat)),
        beta_(beta.to(at::kFloat)),
        out_(at::empty({dims.B, dims.T, dims.Hv, dims.D}, q.options())),
        // The final state is returned in ggml's memory layout: a (B, Hv, Dk, Dv) tensor over
        // (B, Hv, Dv, Dk) memory. Passed back in as `state` it needs no transposition.
        new_state_ggml_(
            in_place ? state->transpose(2, 3)
                     : at::empty({dims.B, dims.Hv, dims.D, dims.D}, q.options().dtype(at::kFloat))),
        // A decode step (T == 1) reads a slice's g / beta ({1, 1, 1, hs}) straight from the
        // tensors (graph leaves at an offset in their storage) and, on the CPU build, writes its
        // float32 output rows straight to out_ (memcpy); other shapes and builds gather and
        // scatter through torch.
        gates_direct_(dims.T == 1 && g_.stride(2) == 1 && beta_.stride(2) == 1),
        out_direct_(kTensorsInHostMemory && dims.T == 1 && out_.scalar_type() == at::kFloat &&
                    out_.is_contiguous()) {
    // ggml's output is S^T q_in / sqrt(D): q_in = scale * sqrt(D) * q (scale D^-0.5 by default).
    // With l2 normalisation, rms_norm(x, eps / D) = sqrt(D) * x / sqrt(sum(x^2) + eps) =
    // sqrt(D) * l2norm(x, eps): q's sqrt(D) is already there and k's is divided out.
    const double sqrt_d = std::sqrt(static_cast<double>(dims.D));
    const double s = scale.has_value() ? *scale : 1.0 / sqrt_d;
    q_mul_ = l2_normalize_qk ? s : s * sqrt_d;
    k_mul_ = l2_normalize_qk ? 1.0 / sqrt_d : 1.0;
    eps_d_ = static_cast<float>(1e-6 / static_cast<double>(dims.D));
  }

  // (output (B, T, Hv, D), final state (B, Hv, Dk, Dv) in ggml's layout)
  std::tuple<at::Tensor, at::Tensor> run() {
    const auto [B, T, Hv, Hk, D] = dims_;
    const at::Tensor new_state = new_state_ggml_.transpose(2, 3);
    if (B == 0 || Hv == 0) return {out_, new_state};
    if (T == 0) {
      if (!in_place_) has_state_ ? new_state.copy_(state_) : new_state.zero_();
      return {out_, new_state};
    }
    // ~4 D^2 flops per head and token; small heads (decode) are grouped so a slice is worth a graph
    const int64_t per_head = T * D * D;
    const int64_t min_heads = std::max<int64_t>(1, (int64_t{1} << 16) / per_head);
    parallel_chunks(B * Hv, min_heads, r_, 2, [&](int64_t n0, int64_t n1) {
      for (int64_t i = n0; i < n1;) {  // chunks are whole key groups (align r); split at sequences
        const int64_t b = i / Hv, h0 = i % Hv;
        const int64_t h1 = std::min(Hv, h0 + (n1 - i));
        run_slice(b, h0, h1);
        i += h1 - h0;
      }
    });
    return {out_, new_state};
  }

 private:
  // The input state as the graphs read it in place, (B, Hv, Dv, Dk) contiguous (ggml's layout):
  // the caller's when it already is one (a state this op returned, or transformers' cache holding
  // one); on a build whose tensors may be device memory also its transposed copy, or zeros without
  // a state, made by torch on the op's device. Undefined otherwise: the CPU build transposes (or
  // zeroes) slice by slice into host scratch (state_in).
  static at::Tensor state_in_ggml_layout(const std::optional<at::Tensor>& state,
                                         const at::TensorOptions& options,
                                         const DeltaNetDims& dims) {
    const bool has_state = state.has_value() && state->defined();
    if (has_state && state->transpose(2, 3).is_contiguous()) return state->transpose(2, 3);
    if (kTensorsInHostMemory) return at::Tensor();
    if (has_state) return state->transpose(2, 3).contiguous();
    return at::zeros({dims.B, dims.Hv, dims.D, dims.D}, options.dtype(at::kFloat));
  }

  // x (B, T, H, D)[b, :, h:h+nh, :] as ggml {D, 1, T, nh}: heads as sequences
  ggml_tensor* heads_as_seqs(Graph& gr, const at::Tensor& x, int64_t b, int64_t h,
                             int64_t nh) const {
    const auto es = static_cast<size_t>(x.element_size());
    return leaf_in(gr, x, b * x.stride(0) + h * x.stride(2), {dims_.D, 1, dims_.T, nh},
                   {es, static_cast<size_t>(dims_.D) * es, static_cast<size_t>(x.stride(1)) * es,
                    static_cast<size_t>(x.stride(2)) * es});
  }

  // q or k of key heads [kh, kh + nkh) as float32, L2-normalised and scaled as ggml must read them.
  ggml_tensor* query_or_key(Graph& gr, const at::Tensor& x, int64_t b, int64_t kh, int64_t nkh,
                            double mul) const {
    const auto& G = ggml();
    ggml_tensor* t = as_f32(gr, heads_as_seqs(gr, x, b, kh, nkh));
    if (l2_normalize_qk_)
      return G.ggml_scale(gr.ctx(), G.ggml_rms_norm(gr.ctx(), t, eps_d_), static_cast<float>(mul));
    return std::abs(mul - 1.0) > 1e-12 ? scaled(gr, t, static_cast<float>(mul)) : t;
  }

  // g or beta of value heads [h0, h0 + hs) as ggml's {1, 1, T, hs}: read in place (decode) or
  // gathered into `keep`, which the caller holds until the graph has run.
  ggml_tensor* per_seq(Graph& gr, const at::Tensor& x, int64_t b, int64_t h0, int64_t hs,
                       at::Tensor& keep) const {
    if (gates_direct_) return leaf_in(gr, x, b * x.stride(0) + h0, {1, 1, 1, hs}, {4, 4, 4, 4});
    keep = x.select(0, b).narrow(1, h0, hs).t().contiguous().view({hs, dims_.T, 1, 1});
    return gr.view(keep);
  }

  // The input state of value heads [h0, h0 + hs) as ggml's {D, D, 1, hs} (its layout): read in
  // place from state_ggml_, or on the CPU build transposed (zeros without a state) into `keep`,
  // held by the caller.
  ggml_tensor* state_in(Graph& gr, int64_t b, int64_t h0, int64_t hs, at::Tensor& keep) const {
    const int64_t D = dims_.D, first = (b * dims_.Hv + h0) * D * D;
    if (state_ggml_.defined()) {
      const size_t block = static_cast<size_t>(D * D) * sizeof(float);
      return leaf_in(gr, state_ggml_, first, {D, D, 1, hs},
                     {sizeof(float), static_cast<size_t>(D) * sizeof(float), block, block});
    }
    keep = t_state.tensor(hs * D * D).view({hs, 1, D, D});
    float* to = host_floats(keep, "the state's transposition");
    if (has_state_) {
      transpose_blocks(host_floats(state_t_, "the state's transposition") + first, D * D, to, D * D,
                       hs, D);
    } else {  // a memset: torch's zero_ costs ~5 us a call, once per slice of a first forward
      std::memset(to, 0, static_cast<size_t>(keep.numel()) * sizeof(float));
    }
    return gr.view(keep);
  }

  // A slice's graph result {D, hs * (T + D)} as (hs * (T + D), D) float32: host scratch on the
  // CPU build, a tensor on the op's device elsewhere.
  at::Tensor slice_result(int64_t rows) const {
    if (kTensorsInHostMemory) return t_dst.tensor(rows * dims_.D).view({rows, dims_.D});
    return at::empty({rows, dims_.D}, out_.options().dtype(at::kFloat));
  }

  // The graph of value heads [h0, h1) of sequence b, its run, and its results stored.
  void run_slice(int64_t b, int64_t h0, int64_t h1) {
    const int64_t hs = h1 - h0, khs = hs / r_, T = dims_.T, D = dims_.D;
    Graph gr(24);
    at::Tensor g_keep, beta_keep, state_keep;  // copies the graph reads: alive until it has run
    ggml_tensor* y = ggml().ggml_gated_delta_net(
        gr.ctx(), query_or_key(gr, q_, b, h0 / r_, khs, q_mul_),
        query_or_key(gr, k_, b, h0 / r_, khs, k_mul_), as_f32(gr, heads_as_seqs(gr, v_, b, h0, hs)),
        per_seq(gr, g_, b, h0, hs, g_keep), per_seq(gr, beta_, b, h0, hs, beta_keep),
        state_in(gr, b, h0, hs, state_keep), 1);
    // {D, hs * (T + D)}: the output (hs, T, D), then the final states (hs, D, D), ggml's layout
    const at::Tensor dst = slice_result(hs * (T + D));
    gr.compute(y, dst);
    store_slice(dst, b, h0, hs);
  }

  // The slice's output rows and final states from its graph result `dst` to out_ and
  // new_state_ggml_: memcpy on the CPU build (torch's copy_ costs microseconds a call, a decode
  // step has several slices per thread), torch's copy_ on the op's device elsewhere.
  void store_slice(const at::Tensor& dst, int64_t b, int64_t h0, int64_t hs) {
    const int64_t T = dims_.T, D = dims_.D, Hv = dims_.Hv;
    const at::Tensor rows = dst.narrow(0, 0, hs * T), states = dst.narrow(0, hs * T, hs * D);
    if (out_direct_) {  // out (B, 1, Hv, D): these heads' rows are hs * D consecutive floats
      std::memcpy(host_floats(out_, "the output's store") + (b * Hv + h0) * D,
                  host_floats(rows, "the output's store"),
                  static_cast<size_t>(hs * D) * sizeof(float));
    } else {
      out_.select(0, b).narrow(1, h0, hs).copy_(rows.view({hs, T, D}).transpose(0, 1));
    }
    // in place: these heads' input state was read by the graph and is not read again
    if (kTensorsInHostMemory) {
      std::memcpy(host_floats(new_state_ggml_, "the state's store") + (b * Hv + h0) * D * D,
                  host_floats(states, "the state's store"),
                  static_cast<size_t>(hs * D * D) * sizeof(float));
    } else {
      new_state_ggml_.select(0, b).narrow(0, h0, hs).copy_(states.view({hs, D, D}));
    }
  }

  const DeltaNetDims dims_;
  const int64_t r_;
  const bool l2_normalize_qk_, in_place_, has_state_;
  const at::Tensor state_, state_ggml_, state_t_, q_, k_, v_, g_, beta_;
  at::Tensor out_, new_state_ggml_;
  const bool gates_direct_, out_direct_;
  double q_mul_ = 1.0, k_mul_ = 1.0;
  float eps_d_ = 0.0f;
};

std::tuple<at::Tensor, at::Tensor> gated_delta_net_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const std::optional<at::Tensor>& state, bool l2_normalize_qk,
    std::optional<double> scale, bool in_place) {
  const DeltaNetDims dims = check_delta_net_inputs(q, k, v, g, beta, state, scale, in_place);
  return DeltaNetCall(q, k, v, g, beta, state, l2_normalize_qk, scale, in_place, dims).run();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gdn_ops::gated_delta_net(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const std::optional<at::Tensor>& state, bool l2_normalize_qk,
    std::optional<double> scale) {
  return gated_delta_net_impl(q, k, v, g, beta, state, l2_normalize_qk, scale, false);
}

at::Tensor gdn_ops::gated_delta_net_inplace(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& g,
                                            const at::Tensor& beta, at::Tensor& state,
                                            bool l2_normalize_qk, std::optional<double> scale) {
  return std::get<0>(gated_delta_net_impl(q, k, v, g, beta, state, l2_normalize_qk, scale, true));
}

namespace {

// The eps of l2_norm and gated_rms_norm, which ggml takes as a float32.
void check_eps(double eps) {
  TORCH_CHECK_VALUE(fits_float32(eps) && eps >= 0, "eps must be finite and >= 0", kFloat32Range,
                    ", got ", eps);
}

}  // namespace

at::Tensor gdn_ops::l2_norm(const at::Tensor& x, double eps) {
  check_float(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dim, got shape ",
                    x.sizes());
  check_eps(eps);
  const int64_t D = x.size(-1), rows = x.numel() / D;
  const at::Tensor x2 = x.reshape({rows, D}).contiguous();
  at::Tensor out = at::empty({rows, D}, x.options());
  // x * rsqrt(sum(x^2) + eps) == rms_norm(x, eps / D) / sqrt(D)
  const float eps_d = static_cast<float>(eps / static_cast<double>(D));
  const float inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  parallel_chunks(rows, std::max<int64_t>(1, 16384 / D), 1, 1, [&](int64_t r0, int64_t r1) {
    const auto& G = ggml();
    Graph gr(8);
    ggml_tensor* t = as_f32(gr, gr.view(x2.narrow(0, r0, r1 - r0)));
    t = G.ggml_scale(gr.ctx(), G.ggml_rms_norm(gr.ctx(), t, eps_d), inv_sqrt_d);
    gr.compute(as_dtype(gr, t, x.scalar_type()), out.narrow(0, r0, r1 - r0));
  });
  return out.view(x.sizes());
}

std::tuple<at::Tensor, at::Tensor> gdn_ops::gates(const at::Tensor& A_log, const at::Tensor& a,
                                                  const at::Tensor& dt_bias, const at::Tensor& b) {
  check_float(A_log, "A_log");
  check_float(dt_bias, "dt_bias");
  check_float(a, "a");
  check_float(b, "b");
  check_dim(A_log, 1, "A_log (value heads)");
  const int64_t H = A_log.size(0);
  TORCH_CHECK_VALUE(dt_bias.dim() == 1 && dt_bias.size(0) == H, "dt_bias must be (", H,
                    ",) like A_log, got ", dt_bias.sizes());
  TORCH_CHECK_VALUE(a.dim() >= 1 && a.size(-1) == H, "a must be (..., ", H,
                    ") (one value per head), got ", a.sizes());
  TORCH_CHECK_VALUE(b.sizes() == a.sizes(), "b must have a's shape ", a.sizes(), ", got ",
                    b.sizes());
  auto g = at::empty(a.sizes(), a.options().dtype(at::kFloat));
  auto beta = at::empty(b.sizes(), b.options().dtype(at::kFloat));
  const int64_t rows = H > 0 ? a.numel() / H : 0;
  if (rows == 0 || H == 0) return {g, beta};
  // Every tensor a graph reads is held by a name here until the graph has run (a temporary's
  // memory would be freed, possibly reused, before ggml reads it).
  const at::Tensor A32 = float32_contiguous(A_log), dt32 = float32_contiguous(dt_bias);
  const at::Tensor a2 = a.reshape({rows, H}).contiguous(), b2 = b.reshape({rows, H}).contiguous();
  const auto& G = ggml();
  {  // g = softplus(a + dt_bias) * -exp(A_log)
    Graph gr(12);
    ggml_context* ctx = gr.ctx();
    ggml_tensor* t = as_f32(gr, gr.view(a2));
    t = G.ggml_softplus(ctx, G.ggml_add(ctx, t, gr.view(dt32)));
    t = G.ggml_mul(ctx, t, G.ggml_neg(ctx, G.ggml_exp(ctx, gr.view(A32))));
    gr.compute(t, g.view({rows, H}));
  }
  {  // beta = sigmoid(b)
    Graph gr(6);
    ggml_tensor* t = G.ggml_sigmoid(gr.ctx(), as_f32(gr, gr.view(b2)));
    gr.compute(t, beta.view({rows, H}));
  }
  return {g, beta};
}

at::Tensor gdn_ops::gated_rms_norm(const at::Tensor& x, const at::Tensor& gate,
                                   const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(gate, "gate");
  check_float(weight, "weight");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dim, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(gate.sizes() == x.sizes(), "gate must have x's shape ", x.sizes(), ", got ",
                    gate.sizes());
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == D, "weight must be (", D, ",), got ",
                    weight.sizes());
  check_eps(eps);
  const at::Tensor x2 = x.reshape({rows, D}).contiguous(),
                   z2 = gate.reshape({rows, D}).contiguous();
  const at::Tensor w32 = float32_contiguous(weight);
  at::Tensor out = at::empty({rows, D}, x.options());
  parallel_chunks(rows, std::max<int64_t>(1, 16384 / D), 1, 1, [&](int64_t r0, int64_t r1) {
    const auto& G = ggml();
    Graph gr(12);
    ggml_context* ctx = gr.ctx();
    ggml_tensor* t = G.ggml_rms_norm(ctx, as_f32(gr, gr.view(x2.narrow(0, r0, r1 - r0))),
                                     static_cast<float>(eps));
    t = G.ggml_mul(ctx, t, gr.view(w32));
    ggml_tensor* z = as_f32(gr, gr.view(z2.narrow(0, r0, r1 - r0)));
    t = G.ggml_swiglu_split(ctx, z, t);  // silu(gate) * normed
    gr.compute(as_dtype(gr, t, x.scalar_type()), out.narrow(0, r0, r1 - r0));
  });
  return out.view(x.sizes());
}

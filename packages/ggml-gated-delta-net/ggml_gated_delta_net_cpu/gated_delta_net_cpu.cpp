// ggml-gated-delta-net on the CPU: ggml-cpu's own GATED_DELTA_NET op (with rms_norm, softplus,
// sigmoid, silu and swiglu around it) on views of the torch tensors, and SSM_CONV's arithmetic.
//
// gated_delta_net: one single-threaded ggml graph per slice of (sequence, value heads), the slices
// spread over torch's threads (parallel_chunks). ggml pairs value head h with key head h % Hk
// (tiled) but sequence i with q/k sequence i / (n_seqs / n_q_seqs) (interleaved); transformers
// repeats key heads with repeat_interleave (value head h reads key head h / (Hv / Hk)). So each
// slice puts its value heads in ggml's sequence dim (one head per "sequence", strides kept, no
// copies of q/k/v) and the interleaved broadcast is exactly transformers'. ggml keeps the state
// transposed ({Dk, Dv} fastest-first: row j of a head's block is column j of transformers' S); the
// op returns the final state in that memory layout as a (B, Hv, Dk, Dv) view, and takes a state in
// either layout (transposing only a transformers-contiguous one). ggml scales the output by
// 1/sqrt(D); q is pre-scaled so that the result is S^T (scale * q) for the caller's scale (default
// D^-0.5, transformers' convention).
//
// causal_conv1d: ggml SSM_CONV's sums (+ SiLU), computed directly over blocks of channels (see
// ConvCall), channels split over torch's threads.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;

namespace {

constexpr int64_t kHeadDims[] = {32, 64, 128};
constexpr int64_t kMaxConvTaps = 64;  // causal_conv1d's kernel sizes (Qwen3.5 and Mamba use 4)

void check_float(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  check_dtype(t, {at::kFloat, at::kBFloat16, at::kHalf}, name);
}

// t as float32 inside the graph (a ggml cast when it is bf16 / f16).
ggml_tensor* as_f32(Graph& g, ggml_tensor* t) {
  return t->type == GGML_TYPE_F32 ? t : ggml().ggml_cast(g.ctx(), t, GGML_TYPE_F32);
}

// A float32 result cast to `dtype`, to be computed straight into a dst of that dtype.
ggml_tensor* as_dtype(Graph& g, ggml_tensor* t, at::ScalarType dtype) {
  const ggml_type want = ggml_type_of(dtype);
  return t->type == want ? t : ggml().ggml_cast(g.ctx(), t, want);
}

// ggml rows must be dense; every other stride is kept.
at::Tensor dense_rows(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (auto d : dims) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

// dst[h][i][j] = src[h][j][i] for hs blocks of D x D floats (src block stride `src_stride`).
// ggml's state layout <-> transformers'; 8x8 tiles keep both sides in cache lines.
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
// (~1 ms for 16 heads). Buffers above kKeepBytes are not kept.
class Scratch {
 public:
  ~Scratch() { std::free(data_); }
  at::Tensor tensor(int64_t n) {
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
    check_cpu(*state, "state");
    check_dtype(*state, {at::kFloat}, "state");
    TORCH_CHECK_VALUE(state->dim() == 4 && state->size(0) == B && state->size(1) == Hv &&
                          state->size(2) == D && state->size(3) == D,
                      "state must be (batch, value heads, key dim, value dim) = ",
                      shape_str({B, Hv, D, D}), ", got ", state->sizes());
  }
  TORCH_CHECK_VALUE(!scale.has_value() || std::isfinite(*scale), "scale must be finite, got ",
                    *scale);
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
// r == 1. Slices are described to ggml by pointer and strides (Graph::raw): a decode step runs
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
        r_(dims.Hv / dims.Hk),
        l2_normalize_qk_(l2_normalize_qk),
        in_place_(in_place),
        has_state_(state.has_value() && state->defined()),
        // The state in ggml's layout (B, Hv, Dv, Dk) contiguous: taken as it is when the caller's
        // state already is (a state this op returned, or transformers' cache holding one), else
        // transposed slice by slice.
        state_is_ggml_(has_state_ && state->transpose(2, 3).is_contiguous()),
        state_(has_state_ ? *state : at::Tensor()),
        state_t_(has_state_ && !state_is_ggml_ ? state->contiguous() : at::Tensor()),
        q_(dense_rows(q)),
        k_(dense_rows(k)),
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
        // A decode step (T == 1) reads a slice's g / beta ({1, 1, 1, hs}) and writes its float32
        // output rows straight from / to the tensors; other shapes gather and scatter through
        // torch.
        gates_direct_(dims.T == 1 && g_.stride(2) == 1 && beta_.stride(2) == 1),
        out_direct_(dims.T == 1 && out_.scalar_type() == at::kFloat && out_.is_contiguous()) {
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
  // x (B, T, H, D)[b, :, h:h+nh, :] as ggml {D, 1, T, nh}: heads as sequences
  ggml_tensor* heads_as_seqs(Graph& gr, const at::Tensor& x, int64_t b, int64_t h,
                             int64_t nh) const {
    const auto es = static_cast<size_t>(x.element_size());
    const char* base =
        static_cast<const char*>(x.data_ptr()) + (b * x.stride(0) + h * x.stride(2)) * es;
    return gr.raw(ggml_type_of(x.scalar_type()), base, {dims_.D, 1, dims_.T, nh},
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
    if (gates_direct_) {
      return gr.raw(GGML_TYPE_F32, x.data_ptr<float>() + b * x.stride(0) + h0, {1, 1, 1, hs},
                    {4, 4, 4, 4});
    }
    keep = x.select(0, b).narrow(1, h0, hs).t().contiguous().view({hs, dims_.T, 1, 1});
    return gr.view(keep);
  }

  // The input state of value heads [h0, h0 + hs) as ggml's {D, D, 1, hs} (its layout): read in
  // place, or transposed (zeros without a state) into `keep`, held by the caller.
  ggml_tensor* state_in(Graph& gr, int64_t b, int64_t h0, int64_t hs, at::Tensor& keep) const {
    const int64_t D = dims_.D, first = (b * dims_.Hv + h0) * D * D;
    if (state_is_ggml_) {
      const size_t block = static_cast<size_t>(D * D) * sizeof(float);
      return gr.raw(GGML_TYPE_F32, state_.data_ptr<float>() + first, {D, D, 1, hs},
                    {sizeof(float), static_cast<size_t>(D) * sizeof(float), block, block});
    }
    keep = t_state.tensor(hs * D * D).view({hs, 1, D, D});
    if (has_state_) {
      transpose_blocks(state_t_.data_ptr<float>() + first, D * D, keep.data_ptr<float>(), D * D, hs,
                       D);
    } else {  // a memset: torch's zero_ costs ~5 us a call, once per slice of a first forward
      std::memset(keep.data_ptr<float>(), 0, static_cast<size_t>(keep.numel()) * sizeof(float));
    }
    return gr.view(keep);
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
    const at::Tensor dst = t_dst.tensor(hs * (T + D) * D).view({hs * (T + D), D});
    gr.compute(y, dst);
    store_slice(dst, b, h0, hs);
  }

  void store_slice(const at::Tensor& dst, int64_t b, int64_t h0, int64_t hs) {
    const int64_t T = dims_.T, D = dims_.D, Hv = dims_.Hv;
    const float* dst_mem = dst.data_ptr<float>();
    if (out_direct_) {  // out (B, 1, Hv, D): these heads' rows are hs * D consecutive floats
      std::memcpy(out_.data_ptr<float>() + (b * Hv + h0) * D, dst_mem,
                  static_cast<size_t>(hs * D) * sizeof(float));
    } else {
      out_.select(0, b).narrow(1, h0, hs).copy_(
          dst.narrow(0, 0, hs * T).view({hs, T, D}).transpose(0, 1));
    }
    // in place: these heads' input state was read by the graph and is not read again
    std::memcpy(new_state_ggml_.data_ptr<float>() + (b * Hv + h0) * D * D, dst_mem + hs * T * D,
                static_cast<size_t>(hs * D * D) * sizeof(float));
  }

  const DeltaNetDims dims_;
  const int64_t r_;
  const bool l2_normalize_qk_, in_place_, has_state_, state_is_ggml_;
  const at::Tensor state_, state_t_, q_, k_, v_, g_, beta_;
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

std::tuple<at::Tensor, at::Tensor> gated_delta_net_cpu(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v, const at::Tensor& g,
                                                       const at::Tensor& beta,
                                                       const std::optional<at::Tensor>& state,
                                                       bool l2_normalize_qk,
                                                       std::optional<double> scale) {
  return gated_delta_net_impl(q, k, v, g, beta, state, l2_normalize_qk, scale, false);
}

at::Tensor gated_delta_net_inplace_cpu(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& g,
                                       const at::Tensor& beta, at::Tensor& state,
                                       bool l2_normalize_qk, std::optional<double> scale) {
  return std::get<0>(gated_delta_net_impl(q, k, v, g, beta, state, l2_normalize_qk, scale, true));
}

namespace {

struct ConvDims {
  int64_t B, C, T, K, W;  // W: the rolling state's width (K without a state)
  bool silu;
};

// The rules of both entry points (in_place: the new rolling state overwrites `state`, which must
// then be given, be float32 or x's dtype, and share no memory with the inputs); returns the dims.
ConvDims check_conv_inputs(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& state,
                           const std::optional<at::Tensor>& bias,
                           std::optional<c10::string_view> activation, bool in_place) {
  check_float(x, "x");
  check_dim(x, 3, "x (batch, channels, tokens)");
  check_float(weight, "weight");
  TORCH_CHECK_VALUE(weight.dim() == 2 || (weight.dim() == 3 && weight.size(1) == 1),
                    "weight must be (channels, 1, kernel) or (channels, kernel), got shape ",
                    weight.sizes());
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), K = weight.size(-1);
  TORCH_CHECK_VALUE(weight.size(0) == C, "weight has ", weight.size(0),
                    " channels but x (batch, channels, tokens) ", x.sizes(), " has ", C);
  TORCH_CHECK_VALUE(K >= 1 && K <= kMaxConvTaps, "the kernel size must be 1 to ", kMaxConvTaps,
                    ", got weight shape ", weight.sizes());
  bool silu = false;
  if (activation.has_value()) {
    const std::string act(activation->data(), activation->size());
    TORCH_CHECK_VALUE(act == "silu" || act == "swish",
                      "activation must be None, 'silu' or 'swish', got '", act, "'");
    silu = true;
  }
  const bool has_state = state.has_value() && state->defined();
  if (has_state) {
    check_float(*state, "state");
    TORCH_CHECK_VALUE(
        state->dim() == 3 && state->size(0) == B && state->size(1) == C && state->size(2) >= K - 1,
        "state must be (batch, channels, >= kernel - 1) = ", shape_str({B, C, K - 1}),
        " or wider (transformers keeps ", K, " columns), got ", state->sizes());
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_float(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == C, "bias must be (channels,) = (", C,
                      ",), got ", bias->sizes());
  }
  if (in_place) {
    TORCH_CHECK_VALUE(has_state, "causal_conv1d_ updates a state in place: state must not be None");
    TORCH_CHECK_TYPE(state->scalar_type() == at::kFloat || state->scalar_type() == x.scalar_type(),
                     "state must be float32 or x's dtype (", x.scalar_type(), "), got ",
                     state->scalar_type());
    check_no_internal_overlap(*state, "state");
    check_no_overlap(*state, "state", x, "x");
    check_no_overlap(*state, "state", weight, "weight");
    if (has_bias) check_no_overlap(*state, "state", *bias, "bias");
  }
  return {B, C, T, K, has_state ? state->size(2) : K, silu};
}

// x86-64: the loop below compiled for AVX-512, AVX2 and the baseline, picked when the library
// loads.
#if defined(__x86_64__)
#define VECTOR_CLONES [[gnu::target_clones("avx512f", "avx2", "default")]]
#else
#define VECTOR_CLONES
#endif
constexpr int64_t kConvBlock = 16;  // channels: one 64-byte line of float32
typedef float ConvVec __attribute__((vector_size(kConvBlock * sizeof(float))));

// Raw views of one causal_conv1d call's float32 operands: (B, T, C) x rows and outputs, (C, K)
// weights, the K - 1 state columns the conv reads (any strides; null without a state), the bias.
struct ConvOperands {
  const float* x;
  float* out;
  const float* w;
  const float* head;
  int64_t head_sb, head_sc, head_sj;
  const float* bias;  // null without a bias
  int64_t C, T, K;
};

// Channels [c0, c1) of sequence b, kConvBlock at a time: out[t, c] = sum_j w[c, j] * in(t + j)[c]
// (+ bias[c]), where in(i) is state column i for i < K - 1, then x's row i - (K - 1). A block's
// weights and state columns are first laid out as one vector per tap / column. A block is one
// AVX-512 register, two AVX2 ones (a 4-wide SSE2 build spills the block's sum).
VECTOR_CLONES void conv_channels(const ConvOperands& a, int64_t b, int64_t c0, int64_t c1) {
  const int64_t C = a.C, T = a.T, K = a.K;
  const float* x = a.x + b * T * C;
  float* out = a.out + b * T * C;
  if (T == 1) {  // a decode step: one sum per channel, cheaper than laying blocks out as vectors
    const float* head = a.head != nullptr ? a.head + b * a.head_sb : nullptr;
    for (int64_t c = c0; c < c1; ++c) {
      const float* w = a.w + c * K;
      float acc = 0.0f;
      for (int64_t j = 0; j < K - 1; ++j)
        acc += w[j] * (head != nullptr ? head[c * a.head_sc + j * a.head_sj] : 0.0f);
      acc += w[K - 1] * x[c];
      out[c] = acc + (a.bias != nullptr ? a.bias[c] : 0.0f);
    }
    return;
  }
  for (int64_t cb = c0; cb < c1; cb += kConvBlock) {
    const int64_t n = std::min(kConvBlock, c1 - cb);
    ConvVec taps[kMaxConvTaps], head[kMaxConvTaps], bias = {};  // lanes past n stay zero
    for (int64_t j = 0; j < K; ++j) taps[j] = head[j] = ConvVec{};
    for (int64_t c = 0; c < n; ++c)
      for (int64_t j = 0; j < K; ++j) taps[j][c] = a.w[(cb + c) * K + j];
    if (a.head != nullptr) {
      const float* s = a.head + b * a.head_sb + cb * a.head_sc;
      for (int64_t c = 0; c < n; ++c)
        for (int64_t j = 0; j < K - 1; ++j) head[j][c] = s[c * a.head_sc + j * a.head_sj];
    }
    if (a.bias != nullptr)
      for (int64_t c = 0; c < n; ++c) bias[c] = a.bias[cb + c];
    for (int64_t t = 0; t < T; ++t) {
      ConvVec acc = {};
      for (int64_t j = 0; j < K; ++j) {
        const int64_t i = t + j - (K - 1);
        ConvVec in;
        if (i < 0) {
          in = head[i + K - 1];
        } else if (n == kConvBlock) {
          std::memcpy(&in, x + i * C + cb, sizeof(in));
        } else {  // a partial block's row, zero-padded
          in = ConvVec{};
          std::memcpy(&in, x + i * C + cb, static_cast<size_t>(n) * sizeof(float));
        }
        acc += taps[j] * in;
      }
      acc += bias;
      std::memcpy(out + t * C + cb, &acc, static_cast<size_t>(n) * sizeof(float));
    }
  }
}

// One causal_conv1d call, computed here rather than by ggml's SSM_CONV: ggml walks one channel's
// strided input row per output, a scalar chain of K products each (~0.2 ms of a 16-token,
// 6144-channel Qwen3.5 prefill on 2 threads). The same sums, in the same order (taps 0..K-1 from
// zero, then the bias), run here over blocks of kConvBlock channels token by token: x's (B, T, C)
// rows are read as they lie and every step is one vector operation over a block. SiLU is torch's,
// on the whole output.
//
// in_place: when the new state is the conv's whole input, [last K - 1 state columns | x]
// (W == K - 1 + T: a decode step on transformers' K-wide cache), each range of channels is rolled
// in place once its outputs are computed (`rolled_`): no new state tensor, no copy back.
class ConvCall {
 public:
  ConvCall(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& state,
           const std::optional<at::Tensor>& bias, bool in_place, const ConvDims& dims)
      : dims_(dims),
        in_place_(in_place),
        has_state_(state.has_value() && state->defined()),
        has_bias_(bias.has_value() && bias->defined()),
        rolled_(in_place && dims.W == dims.K - 1 + dims.T && dims.T > 0 &&
                state->scalar_type() == at::kFloat && state->is_contiguous()),
        x_(x),
        state_(has_state_ ? *state : at::Tensor()),
        // (B, T, C) float32: the layer's float32 x (a transposed view of such rows) is not copied
        rows_(x.transpose(1, 2).to(at::kFloat).contiguous()),
        w_(weight.reshape({dims.C, dims.K}).to(at::kFloat).contiguous()),
        bias_(has_bias_ ? bias->to(at::kFloat).contiguous() : at::Tensor()),
        // the K - 1 state columns the conv reads, as float32 (a view of a float32 state)
        head_(has_state_ && dims.K > 1
                  ? state->narrow(2, dims.W - (dims.K - 1), dims.K - 1).to(at::kFloat)
                  : at::Tensor()),
        out_(at::empty({dims.B, dims.T, dims.C}, x.options().dtype(at::kFloat))) {}

  // (y (B, C, T), the new rolling state: `state` itself in place)
  std::tuple<at::Tensor, at::Tensor> run() {
    const auto [B, C, T, K, W, silu] = dims_;
    if (B > 0 && C > 0 && T > 0) {
      const int64_t blocks = (C + kConvBlock - 1) / kConvBlock;
      const int64_t min_blocks =
          std::max<int64_t>(1, (int64_t{1} << 15) / (kConvBlock * B * T * K));
      const ConvOperands operands{rows_.data_ptr<float>(),
                                  out_.data_ptr<float>(),
                                  w_.data_ptr<float>(),
                                  head_.defined() ? head_.data_ptr<float>() : nullptr,
                                  head_.defined() ? head_.stride(0) : 0,
                                  head_.defined() ? head_.stride(1) : 0,
                                  head_.defined() ? head_.stride(2) : 0,
                                  has_bias_ ? bias_.data_ptr<float>() : nullptr,
                                  C,
                                  T,
                                  K};
      parallel_chunks(blocks, min_blocks, 1, 2, [&](int64_t b0, int64_t b1) {
        const int64_t c0 = b0 * kConvBlock, c1 = std::min(C, b1 * kConvBlock);
        for (int64_t b = 0; b < B; ++b) {
          conv_channels(operands, b, c0, c1);
          if (rolled_) roll_rows(b, c0, c1);
        }
      });
      if (silu) at::silu_(out_);
    }
    at::Tensor y = out_.scalar_type() == x_.scalar_type() ? out_ : out_.to(x_.scalar_type());
    y = y.transpose(1, 2);
    if (rolled_) return {y, state_};
    const at::Tensor new_state = rolling_state();
    if (in_place_) {
      state_.copy_(new_state);
      return {y, state_};
    }
    return {y, new_state};
  }

 private:
  // Channels [c0, c1) of sequence b of a contiguous float32 state, once their outputs are computed,
  // become the last W = K - 1 + T columns of [state | x]: each row moves T to the left (one memmove
  // of the range's rows: the last T columns of each row get the next row's first ones, overwritten
  // by x just below).
  void roll_rows(int64_t b, int64_t c0, int64_t c1) {
    const int64_t C = dims_.C, T = dims_.T, W = dims_.W;
    float* s = state_.data_ptr<float>() + (b * C + c0) * W;
    std::memmove(s, s + T, static_cast<size_t>((c1 - c0) * W - T) * sizeof(float));
    const float* x = rows_.data_ptr<float>() + b * T * C;
    for (int64_t c = c0; c < c1; ++c, s += W)
      for (int64_t t = 0; t < T; ++t) s[W - T + t] = x[t * C + c];
  }

  // The new rolling state: the last W columns of [state | x] (zeros before the first input).
  at::Tensor rolling_state() const {
    const int64_t T = dims_.T, W = dims_.W;
    at::Tensor new_state =
        at::empty({dims_.B, dims_.C, W},
                  x_.options().dtype(has_state_ ? state_.scalar_type() : x_.scalar_type()));
    if (T >= W) {
      new_state.copy_(x_.narrow(2, T - W, W));
    } else {
      if (has_state_)
        new_state.narrow(2, 0, W - T).copy_(state_.narrow(2, T, W - T));
      else
        new_state.narrow(2, 0, W - T).zero_();
      if (T > 0) new_state.narrow(2, W - T, T).copy_(x_);
    }
    return new_state;
  }

  const ConvDims dims_;
  const bool in_place_, has_state_, has_bias_, rolled_;
  const at::Tensor x_;
  at::Tensor state_;
  const at::Tensor rows_, w_, bias_, head_;
  at::Tensor out_;
};

std::tuple<at::Tensor, at::Tensor> causal_conv1d_impl(const at::Tensor& x, const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& state,
                                                      const std::optional<at::Tensor>& bias,
                                                      std::optional<c10::string_view> activation,
                                                      bool in_place) {
  const ConvDims dims = check_conv_inputs(x, weight, state, bias, activation, in_place);
  return ConvCall(x, weight, state, bias, in_place, dims).run();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                     const std::optional<at::Tensor>& state,
                                                     const std::optional<at::Tensor>& bias,
                                                     std::optional<c10::string_view> activation) {
  return causal_conv1d_impl(x, weight, state, bias, activation, false);
}

at::Tensor causal_conv1d_inplace_cpu(const at::Tensor& x, const at::Tensor& weight,
                                     at::Tensor& state, const std::optional<at::Tensor>& bias,
                                     std::optional<c10::string_view> activation) {
  return std::get<0>(causal_conv1d_impl(x, weight, state, bias, activation, true));
}

at::Tensor l2_norm_cpu(const at::Tensor& x, double eps) {
  check_float(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dim, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
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

std::tuple<at::Tensor, at::Tensor> gates_cpu(const at::Tensor& A_log, const at::Tensor& a,
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
  const at::Tensor A32 = A_log.to(at::kFloat).contiguous(),
                   dt32 = dt_bias.to(at::kFloat).contiguous();
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

at::Tensor gated_rms_norm_cpu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                              double eps) {
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
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  const at::Tensor x2 = x.reshape({rows, D}).contiguous(),
                   z2 = gate.reshape({rows, D}).contiguous();
  const at::Tensor w32 = weight.to(at::kFloat).contiguous();
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

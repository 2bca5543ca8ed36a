// causal_conv1d on the CPU: ggml SSM_CONV's sums (taps from zero, then the bias) computed directly
// over blocks of 16 channels (see ConvCall), channels split over torch's threads, SiLU by torch.
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
    // Qwen3.5's kernel on a float32 state, its taps spelled out: the general loop below, with its
    // strided, conditional reads, took 25.6 us a decode step of a 6144-channel layer in place on an
    // Intel Xeon (2 threads), this 18.4 (out of place, `nox -s bench`'s conv_decode: 1.23x). The
    // same sums in the same order.
    if (K == 4 && head != nullptr && a.head_sj == 1) {
      for (int64_t c = c0; c < c1; ++c) {
        const float* w = a.w + c * 4;
        const float* h = head + c * a.head_sc;
        float acc = 0.0f;
        acc += w[0] * h[0];
        acc += w[1] * h[1];
        acc += w[2] * h[2];
        acc += w[3] * x[c];
        out[c] = acc + (a.bias != nullptr ? a.bias[c] : 0.0f);
      }
      return;
    }
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
        rows_(float32_contiguous(x.transpose(1, 2))),
        w_(float32_contiguous(weight.reshape({dims.C, dims.K}))),
        bias_(has_bias_ ? float32_contiguous(*bias) : at::Tensor()),
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
    const at::Tensor new_state = rolling_state(x_, state_, dims_);
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

const bool gdn_ops::kRepeatKeyHeads = false;
const bool gdn_ops::kTensorsInHostMemory = true;

std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& state,
                                                 const std::optional<at::Tensor>& bias,
                                                 std::optional<c10::string_view> activation) {
  return causal_conv1d_impl(x, weight, state, bias, activation, false);
}

at::Tensor causal_conv1d_inplace(const at::Tensor& x, const at::Tensor& weight, at::Tensor& state,
                                 const std::optional<at::Tensor>& bias,
                                 std::optional<c10::string_view> activation) {
  return std::get<0>(causal_conv1d_impl(x, weight, state, bias, activation, true));
}

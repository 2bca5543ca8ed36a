#include "gdn_ops.h"

#include <c10/util/Exception.h>

#include <atomic>

#include "torch_binding.h"

using namespace ggml_kernels;

namespace gdn_ops {

void check_float(const at::Tensor& t, const char* name) {
  check_device(t, name);
  check_dtype(t, {at::kFloat, at::kBFloat16, at::kHalf}, name);
}

namespace {
std::atomic<int64_t> g_host_tensor_accesses{0};
}  // namespace

float* host_floats(const at::Tensor& t, const char* what) {
  TORCH_CHECK(kTensorsInHostMemory, "ggml-gated-delta-net: ", what,
              " would read or write tensor memory from the host, which this build's tensors ",
              "(device memory) do not allow");
  g_host_tensor_accesses.fetch_add(1, std::memory_order_relaxed);
  return t.data_ptr<float>();
}

int64_t host_tensor_accesses() { return g_host_tensor_accesses.load(std::memory_order_relaxed); }

ggml_tensor* as_f32(Graph& g, ggml_tensor* t) {
  return t->type == GGML_TYPE_F32 ? t : ggml().ggml_cast(g.ctx(), t, GGML_TYPE_F32);
}

ggml_tensor* as_dtype(Graph& g, ggml_tensor* t, at::ScalarType dtype) {
  const ggml_type want = ggml_type_of(dtype);
  return t->type == want ? t : ggml().ggml_cast(g.ctx(), t, want);
}

std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (auto d : dims) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

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

at::Tensor rolling_state(const at::Tensor& x, const at::Tensor& state, const ConvDims& dims) {
  const int64_t T = dims.T, W = dims.W;
  const bool has_state = state.defined();
  at::Tensor new_state = at::empty(
      {dims.B, dims.C, W}, x.options().dtype(has_state ? state.scalar_type() : x.scalar_type()));
  if (T >= W) {
    new_state.copy_(x.narrow(2, T - W, W));
  } else {
    if (has_state)
      new_state.narrow(2, 0, W - T).copy_(state.narrow(2, T, W - T));
    else
      new_state.narrow(2, 0, W - T).zero_();
    if (T > 0) new_state.narrow(2, W - T, T).copy_(x);
  }
  return new_state;
}

}  // namespace gdn_ops

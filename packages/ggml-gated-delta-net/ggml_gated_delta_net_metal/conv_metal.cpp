// causal_conv1d on Metal: one ggml graph per call, SSM_CONV over [the K - 1 state columns the
// conv reads | x] (+ bias, + SiLU), which upstream's Metal backend runs as kernel_ssm_conv_*; the
// new rolling state is the last W columns of [state | x], moved by torch (rolling_state).
#include <c10/util/Exception.h>

#include <tuple>

#include "gdn_ops.h"
#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace gdn_ops;

namespace {

// [the conv's K - 1 state columns (zeros without a state) | x] as float32 (B, C, K - 1 + T).
at::Tensor conv_input(const at::Tensor& x, const at::Tensor& state, const ConvDims& d) {
  const at::Tensor xf = x.to(at::kFloat);
  if (d.K == 1) return xf.contiguous();
  const at::Tensor head = state.defined() ? state.narrow(2, d.W - (d.K - 1), d.K - 1).to(at::kFloat)
                                          : at::zeros({d.B, d.C, d.K - 1}, xf.options());
  return at::cat({head, xf}, 2);
}

std::tuple<at::Tensor, at::Tensor> causal_conv1d_metal_impl(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& state_in,
    const std::optional<at::Tensor>& bias_in, std::optional<c10::string_view> activation,
    bool in_place) {
  const ConvDims d = check_conv_inputs(x, weight, state_in, bias_in, activation, in_place);
  const at::Tensor state = state_in.has_value() ? *state_in : at::Tensor();
  at::Tensor out = at::empty({d.B, d.T, d.C}, x.options());  // ggml's {C, T, B}
  if (d.B > 0 && d.C > 0 && d.T > 0) {
    const auto& G = ggml();
    const at::Tensor sx = conv_input(x, state, d);  // {K - 1 + T, C, B}
    const at::Tensor w = float32_contiguous(weight.reshape({d.C, d.K}));
    const at::Tensor bias =
        bias_in.has_value() && bias_in->defined() ? float32_contiguous(*bias_in) : at::Tensor();
    Graph g(12);
    ggml_tensor* y = G.ggml_ssm_conv(g.ctx(), g.view(sx), g.view(w));  // {C, T, B}
    if (bias.defined()) y = G.ggml_add(g.ctx(), y, g.view(bias));
    if (d.silu) y = G.ggml_silu(g.ctx(), y);
    g.compute(as_dtype(g, y, x.scalar_type()), out);
  }
  const at::Tensor y = out.transpose(1, 2);
  const at::Tensor new_state = rolling_state(x, state, d);
  if (!in_place) return {y, new_state};
  state_in->copy_(new_state);
  return {y, *state_in};
}

}  // namespace

const bool gdn_ops::kRepeatKeyHeads = true;
const bool gdn_ops::kTensorsInHostMemory = false;

std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& state,
                                                 const std::optional<at::Tensor>& bias,
                                                 std::optional<c10::string_view> activation) {
  return causal_conv1d_metal_impl(x, weight, state, bias, activation, false);
}

at::Tensor causal_conv1d_inplace(const at::Tensor& x, const at::Tensor& weight, at::Tensor& state,
                                 const std::optional<at::Tensor>& bias,
                                 std::optional<c10::string_view> activation) {
  return std::get<0>(causal_conv1d_metal_impl(x, weight, state, bias, activation, true));
}

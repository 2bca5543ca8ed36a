#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

// Every backend (ggml_gated_delta_net_ops/delta_net.cpp: ggml graphs the build's backend runs).
namespace gdn_ops {
std::tuple<at::Tensor, at::Tensor> gated_delta_net(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& g,
                                                   const at::Tensor& beta,
                                                   const std::optional<at::Tensor>& state,
                                                   bool l2_normalize_qk,
                                                   std::optional<double> scale);
at::Tensor gated_delta_net_inplace(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                   bool l2_normalize_qk, std::optional<double> scale);
at::Tensor l2_norm(const at::Tensor& x, double eps);
std::tuple<at::Tensor, at::Tensor> gates(const at::Tensor& A_log, const at::Tensor& a,
                                         const at::Tensor& dt_bias, const at::Tensor& b);
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                          double eps);
// How many times gdn_ops::host_floats gave tensor memory to the ops' own code since load: the CPU
// build's fast paths count; a Metal build's must stay at 0 (its tests require it).
int64_t host_tensor_accesses();
}  // namespace gdn_ops

// causal_conv1d per backend: ggml_gated_delta_net_cpu/conv_cpu.cpp (SSM_CONV's sums, vectorised),
// ggml_gated_delta_net_metal/conv_metal.cpp (a SSM_CONV graph); a build compiles one.
std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& state,
                                                 const std::optional<at::Tensor>& bias,
                                                 std::optional<c10::string_view> activation);
at::Tensor causal_conv1d_inplace(const at::Tensor& x, const at::Tensor& weight, at::Tensor& state,
                                 const std::optional<at::Tensor>& bias,
                                 std::optional<c10::string_view> activation);

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

// Every backend (ggml_norm_ops/norm.cpp: ggml graphs the build's backend runs).
namespace norm_ops {
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, double eps, bool zero_centered,
                    bool cast_before_weight);
at::Tensor rms_norm_gated(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                          double eps, bool cast_before_weight);
at::Tensor l2_norm(const at::Tensor& x, double eps, c10::string_view mode);
}  // namespace norm_ops

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

// CPU backend (ggml_norm_cpu/norm_cpu.cpp).
at::Tensor rms_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, double eps, bool zero_centered,
                        bool cast_before_weight);
at::Tensor rms_norm_gated_cpu(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                              double eps, bool cast_before_weight);
at::Tensor l2_norm_cpu(const at::Tensor& x, double eps, c10::string_view mode);

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

// CPU backend (ggml_attn_cpu/attn_cpu.cpp).
at::Tensor flash_attn_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, bool causal, double scale,
                          double softcap, const std::optional<at::Tensor>& sinks);
std::tuple<at::Tensor, at::Tensor> rotary_half_cpu(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& cos, const at::Tensor& sin);
void kv_write_cpu(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k,
                  const at::Tensor& v, int64_t position);

// Metal backend (ggml_attn_metal/attn_metal.cpp).
at::Tensor flash_attn_metal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, bool causal, double scale,
                            double softcap, const std::optional<at::Tensor>& sinks);
std::tuple<at::Tensor, at::Tensor> rotary_half_metal(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& cos, const at::Tensor& sin);
void kv_write_metal(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k,
                    const at::Tensor& v, int64_t position);

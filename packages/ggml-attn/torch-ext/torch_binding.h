#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

// Defined per backend (ggml_attn_cpu/attn_cpu.cpp, ggml_attn_metal/attn_metal.cpp): a build
// compiles one (build.toml's kernel of its backend).
at::Tensor flash_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& mask, bool causal, double scale,
                      double softcap, const std::optional<at::Tensor>& sinks);
std::tuple<at::Tensor, at::Tensor> rotary_half(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin);
void kv_write(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k,
              const at::Tensor& v, int64_t position);

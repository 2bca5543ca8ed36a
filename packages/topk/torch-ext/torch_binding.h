#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

// Defined per backend (topk_cpu/topk_cpu.cpp; topk_metal/topk_metal.cpp, where both ops route as
// llama.cpp does, ggml's ties): a build compiles one (build.toml's kernel of its backend).
std::tuple<at::Tensor, at::Tensor> top_k(const at::Tensor& logits, int64_t k, bool softmax,
                                         bool normalize, std::optional<at::ScalarType> dtype,
                                         std::optional<at::ScalarType> index_dtype);
std::tuple<at::Tensor, at::Tensor> top_k_ggml(const at::Tensor& logits, int64_t k, bool softmax,
                                              bool normalize);

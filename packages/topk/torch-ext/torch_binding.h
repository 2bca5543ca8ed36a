#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

// CPU backend (topk_cpu/topk_cpu.cpp).
std::tuple<at::Tensor, at::Tensor> top_k_cpu(const at::Tensor& logits, int64_t k, bool softmax,
                                             bool normalize, std::optional<at::ScalarType> dtype,
                                             std::optional<at::ScalarType> index_dtype);
std::tuple<at::Tensor, at::Tensor> top_k_ggml_cpu(const at::Tensor& logits, int64_t k, bool softmax,
                                                  bool normalize);

// Metal backend (topk_metal/topk_metal.cpp): both ops route as llama.cpp does (ggml's ties).
std::tuple<at::Tensor, at::Tensor> top_k_metal(const at::Tensor& logits, int64_t k, bool softmax,
                                               bool normalize, std::optional<at::ScalarType> dtype,
                                               std::optional<at::ScalarType> index_dtype);
std::tuple<at::Tensor, at::Tensor> top_k_ggml_metal(const at::Tensor& logits, int64_t k,
                                                    bool softmax, bool normalize);

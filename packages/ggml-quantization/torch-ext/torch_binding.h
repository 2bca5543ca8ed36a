#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

// Defined per backend (ggml_quantization_cpu/quantization_cpu.cpp;
// ggml_quantization_metal/quantization_metal.cpp, where quantize and the repacked layout are the
// CPU build's and raise NotImplementedError): a build compiles one (build.toml's kernel of its
// backend).
at::Tensor mul_mat(const at::Tensor& blocks, const at::Tensor& x, int64_t ggml_type,
                   int64_t out_features);
std::vector<at::Tensor> mul_mat_group(at::TensorList blocks, const at::Tensor& x,
                                      at::IntArrayRef ggml_types, at::IntArrayRef out_features);
at::Tensor mul_mat_id(const at::Tensor& blocks, const at::Tensor& x, const at::Tensor& ids,
                      int64_t ggml_type, int64_t out_features);
at::Tensor dequantize(const at::Tensor& blocks, int64_t ggml_type, int64_t rows, int64_t cols,
                      at::ScalarType dtype);
at::Tensor get_rows(const at::Tensor& blocks, const at::Tensor& indices, int64_t ggml_type,
                    int64_t cols, at::ScalarType dtype);
at::Tensor quantize(const at::Tensor& x, int64_t ggml_type,
                    const std::optional<at::Tensor>& imatrix);
at::Tensor repack(const at::Tensor& blocks, int64_t ggml_type);
at::Tensor unrepack(const at::Tensor& blocks, int64_t ggml_type);
std::vector<int64_t> repacked_types();

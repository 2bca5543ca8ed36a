#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

// CPU backend (ggml_quantization_cpu/quantization_cpu.cpp).
at::Tensor mul_mat_cpu(const at::Tensor& blocks, const at::Tensor& x, int64_t ggml_type,
                       int64_t out_features);
std::vector<at::Tensor> mul_mat_group_cpu(at::TensorList blocks, const at::Tensor& x,
                                          at::IntArrayRef ggml_types, at::IntArrayRef out_features);
at::Tensor mul_mat_id_cpu(const at::Tensor& blocks, const at::Tensor& x, const at::Tensor& ids,
                          int64_t ggml_type, int64_t out_features);
at::Tensor dequantize_cpu(const at::Tensor& blocks, int64_t ggml_type, int64_t rows, int64_t cols,
                          at::ScalarType dtype);
at::Tensor get_rows_cpu(const at::Tensor& blocks, const at::Tensor& indices, int64_t ggml_type,
                        int64_t cols, at::ScalarType dtype);
at::Tensor quantize_cpu(const at::Tensor& x, int64_t ggml_type,
                        const std::optional<at::Tensor>& imatrix);
at::Tensor repack_cpu(const at::Tensor& blocks, int64_t ggml_type);
at::Tensor unrepack_cpu(const at::Tensor& blocks, int64_t ggml_type);
std::vector<int64_t> repacked_types_cpu();

// Metal backend (ggml_quantization_metal/quantization_metal.cpp): quantize and the repacked layout
// are the CPU build's and raise NotImplementedError there.
at::Tensor mul_mat_metal(const at::Tensor& blocks, const at::Tensor& x, int64_t ggml_type,
                         int64_t out_features);
std::vector<at::Tensor> mul_mat_group_metal(at::TensorList blocks, const at::Tensor& x,
                                            at::IntArrayRef ggml_types,
                                            at::IntArrayRef out_features);
at::Tensor mul_mat_id_metal(const at::Tensor& blocks, const at::Tensor& x, const at::Tensor& ids,
                            int64_t ggml_type, int64_t out_features);
at::Tensor dequantize_metal(const at::Tensor& blocks, int64_t ggml_type, int64_t rows, int64_t cols,
                            at::ScalarType dtype);
at::Tensor get_rows_metal(const at::Tensor& blocks, const at::Tensor& indices, int64_t ggml_type,
                          int64_t cols, at::ScalarType dtype);
at::Tensor quantize_metal(const at::Tensor& x, int64_t ggml_type,
                          const std::optional<at::Tensor>& imatrix);
at::Tensor repack_metal(const at::Tensor& blocks, int64_t ggml_type);
at::Tensor unrepack_metal(const at::Tensor& blocks, int64_t ggml_type);
std::vector<int64_t> repacked_types_metal();

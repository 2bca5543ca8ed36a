// Argument checks every backend of ggml-quantization makes (ValueError / TypeError in Python).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "ggml_runtime.h"

namespace ggml_quantization::checks {

// Values per packed row of a product's weight, from the row's byte size; ValueError if it is not
// whole blocks, or more values than ggml's dot products count (they take the row length as an int).
int64_t cols_of(const at::Tensor& blocks, ggml_type type, const char* name);

// Activations x (..., K) (mul_mat, mul_mat_vec, mul_mat_group: any leading dims, the output keeps
// them) or (T, K) when `tokens_only` (mul_mat_id).
void check_activations(const at::Tensor& x, int64_t k, const at::Tensor& blocks, ggml_type type,
                       bool tokens_only = false);

// x's shape with the last dim replaced by n: the shape of x @ W.T for a weight of n rows.
at::DimVector rows_shape(const at::Tensor& x, int64_t n);

// One packed weight (N, row_bytes) of `type` in a product with x (..., K), the float32 product
// within kMaxTensorBytes: returns K.
int64_t check_weight_operand(const at::Tensor& blocks, ggml_type type, int64_t out_features,
                             const at::Tensor& x, const char* name);

// dequantize's and get_rows' output dtype: float32, float16 or bfloat16.
void check_out_dtype(at::ScalarType dtype);

// blocks (rows, row_bytes) of `type` with `cols` values a row, for dequantize and get_rows.
void check_rows_operand(const at::Tensor& blocks, ggml_type type, int64_t cols);

// dequantize's rows: all of blocks', their float32 values (rows, cols) within kMaxTensorBytes.
void check_dequantized_rows(const at::Tensor& blocks, int64_t rows, int64_t cols);

// mul_mat_id's experts (E, N, row_bytes) with x (T, K) and ids (T, n_ids), the float32 product
// (T, n_ids, N) within kMaxTensorBytes: returns K.
int64_t check_experts(const at::Tensor& blocks, ggml_type type, int64_t out_features,
                      const at::Tensor& x, const at::Tensor& ids);

// get_rows' indices (n,) into `rows` rows of `cols` values, the float32 result (n, cols) within
// kMaxTensorBytes.
void check_row_indices(const at::Tensor& indices, int64_t rows, int64_t cols);

}  // namespace ggml_quantization::checks

#include "checks.h"

#include <c10/util/Exception.h>

#include <limits>

#include "ggml_torch.h"

using namespace ggml_kernels;

namespace ggml_quantization::checks {

int64_t cols_of(const at::Tensor& blocks, ggml_type type, const char* name) {
  const auto& G = ggml();
  const int64_t rb = blocks.size(-1);
  const int64_t ts = static_cast<int64_t>(G.ggml_type_size(type));
  TORCH_CHECK_VALUE(rb > 0 && rb % ts == 0, name, " rows of ", rb,
                    " bytes are not a whole number of ", type_name(type), " blocks (", ts,
                    " bytes each)");
  const int64_t k = rb / ts * G.ggml_blck_size(type);
  TORCH_CHECK_VALUE(k <= std::numeric_limits<int32_t>::max(), name, " rows hold ", k,
                    " values; ggml's dot "
                    "products take at most 2^31 - 1");
  return k;
}

void check_activations(const at::Tensor& x, int64_t k, const at::Tensor& blocks, ggml_type type,
                       bool tokens_only) {
  check_device(x, "x");
  check_dtype(x, {at::kFloat, at::kHalf, at::kBFloat16}, "x");
  if (tokens_only) {
    check_dim(x, 2, "x");
  } else {
    TORCH_CHECK_VALUE(x.dim() >= 1, "x must be (..., K) with at least one dim, got a 0-D tensor");
  }
  TORCH_CHECK_VALUE(x.size(-1) == k, "x has ", x.size(-1), " features (shape ", x.sizes(),
                    ") but the ", type_name(type), " weight rows hold ", k, " values (",
                    blocks.size(-1), " bytes)");
}

at::DimVector rows_shape(const at::Tensor& x, int64_t n) {
  at::DimVector shape(x.sizes());
  shape.back() = n;
  return shape;
}

void check_out_dtype(at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "dtype must be float32, float16 or bfloat16, got ", dtype);
}

int64_t check_weight_operand(const at::Tensor& blocks, ggml_type type, int64_t out_features,
                             const at::Tensor& x, const char* name) {
  check_device(blocks, name);
  check_dtype(blocks, {at::kByte}, name);
  check_dim(blocks, 2, name);
  const int64_t k = cols_of(blocks, type, name);
  check_packed(blocks, type, k, name);
  TORCH_CHECK_VALUE(blocks.size(0) == out_features, "out_features=", out_features, " but ", name,
                    " has ", blocks.size(0), " rows");
  check_activations(x, k, blocks, type);
  check_size(rows_shape(x, out_features), at::kFloat, "the product");
  return k;
}

void check_rows_operand(const at::Tensor& blocks, ggml_type type, int64_t cols) {
  check_device(blocks, "blocks");
  check_dtype(blocks, {at::kByte}, "blocks");
  check_dim(blocks, 2, "blocks");
  check_packed(blocks, type, cols, "blocks");
}

void check_dequantized_rows(const at::Tensor& blocks, int64_t rows, int64_t cols) {
  TORCH_CHECK_VALUE(blocks.size(0) == rows, "rows=", rows, " but blocks has ", blocks.size(0),
                    " rows");
  check_size({rows, cols}, at::kFloat, "the dequantized rows");
}

int64_t check_experts(const at::Tensor& blocks, ggml_type type, int64_t out_features,
                      const at::Tensor& x, const at::Tensor& ids) {
  check_device(blocks, "blocks");
  check_dtype(blocks, {at::kByte}, "blocks");
  check_dim(blocks, 3, "blocks");
  const int64_t k = cols_of(blocks, type, "blocks");
  check_packed(blocks, type, k, "blocks");
  TORCH_CHECK_VALUE(blocks.size(1) == out_features, "out_features=", out_features,
                    " but each expert in blocks has ", blocks.size(1), " rows");
  check_activations(x, k, blocks, type, /*tokens_only=*/true);
  check_device(ids, "ids");
  check_dtype(ids, {at::kInt, at::kLong}, "ids");
  check_dim(ids, 2, "ids");
  TORCH_CHECK_VALUE(ids.size(0) == x.size(0), "ids has ", ids.size(0), " rows but x has ",
                    x.size(0), " tokens");
  check_size({x.size(0), ids.size(1), out_features}, at::kFloat, "the product");
  check_indices(ids, blocks.size(0), "ids (expert indices)");
  return k;
}

void check_row_indices(const at::Tensor& indices, int64_t rows, int64_t cols) {
  check_device(indices, "indices");
  check_dtype(indices, {at::kInt, at::kLong}, "indices");
  check_dim(indices, 1, "indices");
  check_size({indices.size(0), cols}, at::kFloat, "the gathered rows");
  check_indices(indices, rows, "indices");
}

}  // namespace ggml_quantization::checks

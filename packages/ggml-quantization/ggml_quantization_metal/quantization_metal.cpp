// ggml-quantization on Metal: every op is one ggml graph (mul_mat, mul_mat_id, get_rows) that
// upstream's Metal backend runs (common/metal/). Its host code picks the kernel from the whole
// shape: a mat-vec (kernel_mul_mv_*) for one activation row, the mat-vec-ext kernels for 2-8 rows
// of the types that have them, the tiled mat-mat (kernel_mul_mm_*) beyond, and for mul_mat_id the
// per-expert mat-vec or the mapped tiled product.
//
// Activations are float32 (x is converted once); the kernels dequantize the weight blocks
// themselves, so no activation quantization happens (unlike ggml-cpu's dot products). Weights are
// the plain GGUF layout only: ggml-cpu's repacked layout is meaningless to Metal's kernels, and
// quantize (ggml-cpu's row quantizers) stays a CPU op.
#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace ggml_quantization::checks;

namespace {

// Type ids at and above this name ggml-cpu's repacked layout (repack.h's kRepackedFlag).
constexpr int64_t kRepackedFlag = 1024;

ggml_type check_plain_type(int64_t type_id) {
  TORCH_CHECK_VALUE(type_id < kRepackedFlag, "type id ", type_id,
                    " names ggml-cpu's repacked layout; the Metal build takes weights in the "
                    "plain GGUF layout (unrepack them on the CPU build first)");
  return check_storage_type(type_id);
}

// One packed weight (N, row_bytes) of a product with x (..., K); returns its type and K.
std::pair<ggml_type, int64_t> check_weight(const at::Tensor& blocks, int64_t type_id,
                                           int64_t out_features, const at::Tensor& x,
                                           const char* name) {
  const ggml_type type = check_plain_type(type_id);
  const int64_t k = check_weight_operand(blocks, type, out_features, x, name);
  return {type, k};
}

// Experts per token for which upstream's mapped tiled product (MUL_MAT_ID with many tokens) has a
// kernel: mul_mm.metal instantiates kernel_mul_mm_id_map0_ne20_<n> for these n only, and the host
// code asks for kernel_mul_mm_id_map0_ne20_<n_ids> whatever n_ids is (on a Mac, 3 or 7 experts per
// token fail to compile a pipeline). Other counts are split into slots of these sizes, one
// MUL_MAT_ID node each in the op's one graph.
constexpr int64_t kMappedIdCounts[] = {22, 16, 10, 8, 6, 5, 4, 2, 1};

// [first slot, slots) groups covering n_ids slots, each of a count in kMappedIdCounts.
std::vector<std::pair<int64_t, int64_t>> slot_groups(int64_t n_ids) {
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t j0 = 0; j0 < n_ids;) {
    const int64_t left = n_ids - j0;
    const int64_t* count = std::find_if(std::begin(kMappedIdCounts), std::end(kMappedIdCounts),
                                        [&](int64_t c) { return c <= left; });
    groups.emplace_back(j0, *count);
    j0 += *count;
  }
  return groups;
}

// Packed rows `indices` (int32, (n,)) of blocks, as float32 (n, cols) in `dtype`: GET_ROWS.
at::Tensor gathered_rows(const at::Tensor& blocks, ggml_type type, int64_t cols,
                         const at::Tensor& indices32, at::ScalarType dtype) {
  auto out = at::empty({indices32.size(0), cols}, blocks.options().dtype(at::kFloat));
  Graph g(8);
  ggml_tensor* rows =
      ggml().ggml_get_rows(g.ctx(), g.packed(blocks, type, cols), g.view(indices32));
  g.compute(rows, out);
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace

at::Tensor mul_mat(const at::Tensor& blocks, const at::Tensor& x, int64_t type_id,
                   int64_t out_features) {
  const auto [type, k] = check_weight(blocks, type_id, out_features, x, "blocks");
  const int64_t m = x.numel() / k;
  auto out = at::empty(rows_shape(x, out_features), x.options().dtype(at::kFloat));
  if (m == 0 || out_features == 0) return out;
  const at::Tensor xf = float32_contiguous(x);
  Graph g(8);
  ggml_tensor* y = ggml().ggml_mul_mat(g.ctx(), g.packed(blocks, type, k), g.view(xf.view({m, k})));
  g.compute(y, out.view({m, out_features}));
  return out;
}

std::vector<at::Tensor> mul_mat_group(at::TensorList blocks, const at::Tensor& x,
                                      at::IntArrayRef type_ids, at::IntArrayRef out_features) {
  const size_t n = blocks.size();
  TORCH_CHECK_VALUE(n > 0, "mul_mat_group needs at least one weight");
  TORCH_CHECK_VALUE(type_ids.size() == n && out_features.size() == n, "mul_mat_group got ", n,
                    " weights, ", type_ids.size(), " ggml types and ", out_features.size(),
                    " out_features: one each");
  std::vector<ggml_type> types(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string name = "blocks[" + std::to_string(i) + "]";
    types[i] = check_weight(blocks[i], type_ids[i], out_features[i], x, name.c_str()).first;
  }
  std::vector<at::Tensor> outs(n);
  for (size_t i = 0; i < n; ++i)
    outs[i] = at::empty(rows_shape(x, out_features[i]), x.options().dtype(at::kFloat));
  const int64_t k = x.size(-1), m = x.numel() / k;
  if (m == 0) return outs;
  // one graph: the weights' products share the uploaded activations and one command buffer
  const at::Tensor xf = float32_contiguous(x);
  Graph g(static_cast<int>(3 * n + 4));
  ggml_tensor* xt = g.view(xf.view({m, k}));
  std::vector<ggml_tensor*> results;
  for (size_t i = 0; i < n; ++i) {
    if (out_features[i] == 0) continue;
    ggml_tensor* y = ggml().ggml_mul_mat(g.ctx(), g.packed(blocks[i], types[i], k), xt);
    g.bind(y, outs[i].view({m, out_features[i]}));
    results.push_back(y);
  }
  g.compute_bound(results);
  return outs;
}

at::Tensor mul_mat_id(const at::Tensor& blocks, const at::Tensor& x, const at::Tensor& ids,
                      int64_t type_id, int64_t out_features) {
  const ggml_type type = check_plain_type(type_id);
  const int64_t k = check_experts(blocks, type, out_features, x, ids);
  const int64_t t = x.size(0), n_ids = ids.size(1);
  auto out = at::empty({t, n_ids, out_features}, x.options().dtype(at::kFloat));
  if (t == 0 || n_ids == 0 || out_features == 0) return out;
  const at::Tensor xf = float32_contiguous(x);
  const at::Tensor ids32 = ids.to(at::kInt).contiguous();
  const auto slots = slot_groups(n_ids);
  Graph g(static_cast<int>(4 * slots.size() + 4));
  ggml_tensor* experts = g.packed(blocks, type, k);
  ggml_tensor* xt = g.view(xf.view({t, 1, k}));  // one row per token, shared by its experts
  std::vector<ggml_tensor*> results;
  for (const auto& [j0, count] : slots) {
    ggml_tensor* y =
        ggml().ggml_mul_mat_id(g.ctx(), experts, xt, g.view(ids32.narrow(1, j0, count)));
    g.bind(y, out.narrow(1, j0, count));  // {N, count, T}
    results.push_back(y);
  }
  g.compute_bound(results);
  return out;
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t type_id, int64_t rows, int64_t cols,
                      at::ScalarType dtype) {
  const ggml_type type = check_plain_type(type_id);
  check_out_dtype(dtype);
  check_rows_operand(blocks, type, cols);
  check_dequantized_rows(blocks, rows, cols);
  if (rows == 0) return at::empty({0, cols}, blocks.options().dtype(dtype));
  // every row, through Metal's get_rows kernels (they dequantize each type's blocks)
  return gathered_rows(blocks, type, cols, at::arange(rows, blocks.options().dtype(at::kInt)),
                       dtype);
}

at::Tensor get_rows(const at::Tensor& blocks, const at::Tensor& indices, int64_t type_id,
                    int64_t cols, at::ScalarType dtype) {
  const ggml_type type = check_plain_type(type_id);
  check_out_dtype(dtype);
  check_rows_operand(blocks, type, cols);
  check_row_indices(indices, blocks.size(0), cols);
  if (indices.size(0) == 0) return at::empty({0, cols}, blocks.options().dtype(dtype));
  return gathered_rows(blocks, type, cols, indices.to(at::kInt).contiguous(), dtype);
}

at::Tensor quantize(const at::Tensor&, int64_t, const std::optional<at::Tensor>&) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "quantize runs on the CPU build only: it is ggml-cpu's row "
                              "quantizers, and ggml-metal has no kernel for them");
}

at::Tensor repack(const at::Tensor&, int64_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "repack makes ggml-cpu's repacked layout, which only the CPU build "
                              "reads; the Metal build takes the plain GGUF layout");
}

at::Tensor unrepack(const at::Tensor&, int64_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "unrepack reads ggml-cpu's repacked layout: use the CPU build");
}

std::vector<int64_t> repacked_types() { return {}; }

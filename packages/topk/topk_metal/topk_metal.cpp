// topk on Metal: MoE routing as llama.cpp builds it (soft_max -> argsort_top_k -> get_rows
// [-> sum_rows, clamp, div]), one ggml graph per call. With softmax, float32 logits and at most
// 1024 experts, upstream's Metal backend fuses the chain into one kernel (kernel_topk_moe_*);
// otherwise it runs soft_max, the argsort / top-k kernels and get_rows. The chosen experts come
// largest first; ties are the kernel's (ggml's), not torch.topk's, as for the CPU build's
// top_k_ggml. The renormalisation divides by max(sum, 2^-14), llama.cpp's clamp (a sum of k
// softmax values of E experts is at least k / E, so it never binds for E <= 2^14).
#include <c10/util/Exception.h>

#include <cmath>
#include <tuple>

#include "checks.h"
#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace topk_ops;

namespace {

constexpr float kMinWeightSum = 6.103515625e-5f;  // 2^-14, llama.cpp's clamp of the sum

// weights (T, k) float32 and indices (T, k) int32 of xf (T, E) float32, contiguous.
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& xf, int64_t k, bool softmax,
                                         bool normalize) {
  const auto& G = ggml();
  const int64_t t = xf.size(0), e = xf.size(1);
  auto weights = at::empty({t, k}, xf.options());
  auto idx32 = at::empty({t, k}, xf.options().dtype(at::kInt));
  Graph g(24);
  ggml_context* ctx = g.ctx();
  ggml_tensor* x = g.view(xf);                                              // {E, T}
  ggml_tensor* p = softmax ? G.ggml_soft_max(ctx, x) : x;                   // probabilities
  ggml_tensor* chosen = G.ggml_argsort_top_k(ctx, p, static_cast<int>(k));  // I32 {k, T} view
  ggml_tensor* w = G.ggml_get_rows(ctx, G.ggml_reshape_3d(ctx, p, 1, e, t), chosen);  // {1, k, T}
  if (normalize) {
    ggml_tensor* w2 = G.ggml_reshape_2d(ctx, w, k, t);
    ggml_tensor* sum = G.ggml_clamp(ctx, G.ggml_sum_rows(ctx, w2), kMinWeightSum, INFINITY);
    w = G.ggml_reshape_3d(ctx, G.ggml_div(ctx, w2, sum), 1, k, t);
  }
  ggml_tensor* ids = G.ggml_cont(ctx, chosen);  // the chosen experts, dense
  g.bind(w, weights.view({t, k, 1}));
  g.bind(ids, idx32);
  g.compute_bound({w, ids});
  return {weights, idx32};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> top_k(const at::Tensor& logits, int64_t k, bool softmax,
                                         bool normalize, std::optional<at::ScalarType> dtype,
                                         std::optional<at::ScalarType> index_dtype) {
  check_args(logits, k, softmax, normalize);
  const auto [wdt, idt] = output_dtypes(logits, dtype, index_dtype);
  const int64_t rows = logits.size(0);
  if (rows == 0)
    return {at::empty({0, k}, logits.options().dtype(wdt)),
            at::empty({0, k}, logits.options().dtype(idt))};
  const at::Tensor xf = float32_contiguous(logits);  // ggml's soft_max takes float32 rows
  refuse_rows_ggml_cannot_route(xf, softmax, "top_k");
  auto [weights, idx32] = route(xf, k, softmax, normalize);
  return {weights.to(wdt), idx32.to(idt)};
}

std::tuple<at::Tensor, at::Tensor> top_k_ggml(const at::Tensor& logits, int64_t k, bool softmax,
                                              bool normalize) {
  return top_k(logits, k, softmax, normalize, std::nullopt, std::nullopt);
}

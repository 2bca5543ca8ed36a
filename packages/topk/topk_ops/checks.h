// Argument checks every backend of topk makes, and the logits rows no routing can take.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <utility>

namespace topk_ops {

// Rows with a problem, found inside the parallel loop and reported after it (a worker never
// throws). Each slot keeps the first offending row.
struct RowErrors {
  std::atomic<int64_t> nan{INT64_MAX};
  std::atomic<int64_t> all_neg_inf{INT64_MAX};
  std::atomic<int64_t> pos_inf{INT64_MAX};

  static void note(std::atomic<int64_t>& slot, int64_t row) {
    int64_t cur = slot.load(std::memory_order_relaxed);
    while (row < cur && !slot.compare_exchange_weak(cur, row, std::memory_order_relaxed)) {
    }
  }

  void raise_if_any(const at::Tensor& logits) const {
    const int64_t row_nan = nan.load(), row_ninf = all_neg_inf.load();
    TORCH_CHECK_VALUE(row_nan == INT64_MAX, "logits contain NaN (first in token row ", row_nan,
                      " of ", logits.size(0), "): no expert can be chosen for it");
    TORCH_CHECK_VALUE(row_ninf == INT64_MAX, "every logit of token row ", row_ninf,
                      " is -inf: softmax is undefined there (all experts masked out)");
  }
};

// logits (T, E) float32/bf16/f16 on this backend's device, 1 <= k <= E, normalize only with
// softmax.
void check_args(const at::Tensor& logits, int64_t k, bool softmax, bool normalize);

// The weights' dtype (default: the logits') and the indices' (default int64), checked.
std::pair<at::ScalarType, at::ScalarType> output_dtypes(const at::Tensor& logits,
                                                        std::optional<at::ScalarType> dtype,
                                                        std::optional<at::ScalarType> index_dtype);

// The rows ggml's routing cannot take (xf: float32 (T, E), contiguous), refused before any graph
// runs: NaN, and with softmax a row of -inf only or one holding +inf (ggml's soft_max turns it into
// NaN, which its top_k then takes). `op` names the op in the message.
void refuse_rows_ggml_cannot_route(const at::Tensor& xf, bool softmax, const char* op);

}  // namespace topk_ops

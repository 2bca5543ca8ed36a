#include "checks.h"

#include <c10/util/Exception.h>

#include <limits>

#include "ggml_torch.h"

using namespace ggml_kernels;

namespace topk_ops {

namespace {
constexpr float kInf = std::numeric_limits<float>::infinity();
}  // namespace

void check_args(const at::Tensor& logits, int64_t k, bool softmax, bool normalize) {
  check_device(logits, "logits");
  check_dtype(logits, {at::kFloat, at::kBFloat16, at::kHalf}, "logits");
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be 2-D (tokens, experts), got shape ",
                    logits.sizes());
  const int64_t experts = logits.size(1);
  TORCH_CHECK_VALUE(k >= 1, "k must be at least 1, got k=", k);
  TORCH_CHECK_VALUE(k <= experts, "k=", k, " is larger than the number of experts (", experts,
                    ", logits shape ", logits.sizes(), ")");
  TORCH_CHECK_VALUE(experts <= std::numeric_limits<int32_t>::max(), "too many experts: ", experts);
  TORCH_CHECK_VALUE(softmax || !normalize,
                    "normalize=True needs softmax=True (renormalising raw logits is not defined)");
}

std::pair<at::ScalarType, at::ScalarType> output_dtypes(const at::Tensor& logits,
                                                        std::optional<at::ScalarType> dtype,
                                                        std::optional<at::ScalarType> index_dtype) {
  const at::ScalarType wdt = dtype.value_or(logits.scalar_type());
  TORCH_CHECK_TYPE(wdt == at::kFloat || wdt == at::kBFloat16 || wdt == at::kHalf,
                   "dtype (of the weights) must be float32, bfloat16 or float16, got ", wdt);
  const at::ScalarType idt = index_dtype.value_or(at::kLong);
  TORCH_CHECK_TYPE(idt == at::kLong || idt == at::kInt, "index_dtype must be int64 or int32, got ",
                   idt);
  return {wdt, idt};
}

void refuse_rows_ggml_cannot_route(const at::Tensor& xf, bool softmax, const char* op) {
  const int64_t rows = xf.size(0), n = xf.size(1);
  RowErrors errors;
  const float* xp = xf.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    bool nan = false;
    float mx = -kInf;
    for (int64_t i = 0; i < n; ++i) {
      const float f = xp[r * n + i];
      nan |= f != f;
      mx = f > mx ? f : mx;
    }
    if (nan) RowErrors::note(errors.nan, r);
    if (softmax && mx == -kInf) RowErrors::note(errors.all_neg_inf, r);
    if (softmax && mx == kInf) RowErrors::note(errors.pos_inf, r);
  }
  errors.raise_if_any(xf);
  TORCH_CHECK_VALUE(errors.pos_inf.load() == INT64_MAX, op, ": token row ", errors.pos_inf.load(),
                    " holds +inf, which ggml's soft_max turns into NaN (top_k "
                    "takes it)");
}

}  // namespace topk_ops

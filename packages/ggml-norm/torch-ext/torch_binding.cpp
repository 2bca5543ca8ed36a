// Op schemas of ggml-norm and their per-backend implementations.
#include "torch_binding.h"

#include "registration.h"

GGML_KERNELS_LIBRARY(m) {
  // x (..., n) normalised over its last dim: x / sqrt(mean(x^2) + eps), then * weight (or
  // * (1 + weight) if zero_centered), then + bias. Output in x's dtype; with cast_before_weight
  // (Llama's rounding) the norm is rounded to x's dtype first and the output takes
  // promote(x, weight).
  m.def(
      "rms_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, bool zero_centered, "
      "bool cast_before_weight) -> Tensor");
  // rms_norm(x) * weight * silu(z), z of x's shape; output in x's dtype.
  m.def(
      "rms_norm_gated(Tensor x, Tensor z, Tensor weight, float eps, bool cast_before_weight) -> "
      "Tensor");
  // mode "clamp": x / max(||x||, eps) (ggml_l2_norm); "rsqrt": x / sqrt(||x||^2 + eps).
  m.def("l2_norm(Tensor x, float eps, str mode) -> Tensor");
}

GGML_KERNELS_LIBRARY_IMPL(GGML_KERNELS_DISPATCH_KEY, m) {
  m.impl("rms_norm", &norm_ops::rms_norm);
  m.impl("rms_norm_gated", &norm_ops::rms_norm_gated);
  m.impl("l2_norm", &norm_ops::l2_norm);
}

GGML_KERNELS_PYTHON_MODULE()

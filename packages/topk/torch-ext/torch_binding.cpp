// Op schemas of topk and their per-backend implementations.
#include "torch_binding.h"

#include "registration.h"

GGML_KERNELS_LIBRARY(m) {
  // logits (T, E) float32/bf16/f16 -> weights (T, k), indices (T, k), sorted by weight, largest
  // first, ties ordered as torch.topk orders them on the CPU.
  //   softmax=True:   weights are softmax(logits) (computed in float32) of the chosen experts,
  //                   renormalised to sum to 1 when normalize=True (MoE routing, norm_topk_prob).
  //   softmax=False:  weights are the logits' own top-k values (torch.topk); normalize must be
  //   False.
  // dtype: weights dtype (None: the logits' dtype); index_dtype: int64 (None) or int32.
  m.def(
      "top_k(Tensor logits, int k, bool softmax=True, bool normalize=False, ScalarType? "
      "dtype=None, "
      "ScalarType? index_dtype=None) -> (Tensor, Tensor)");
  // The same routing as a ggml graph (soft_max_ext -> top_k -> get_rows [-> sum_rows, div]), kept
  // to compare against; ties are ggml's, not torch's.
  m.def(
      "top_k_ggml(Tensor logits, int k, bool softmax=True, bool normalize=False) -> (Tensor, "
      "Tensor)");
}

GGML_KERNELS_LIBRARY_IMPL(GGML_KERNELS_DISPATCH_KEY, m) {
  m.impl("top_k", &top_k);
  m.impl("top_k_ggml", &top_k_ggml);
}

GGML_KERNELS_PYTHON_MODULE()

// Op schemas of ggml-attn and their per-backend implementations.
#include "torch_binding.h"

#include "registration.h"

GGML_KERNELS_LIBRARY(m) {
  // q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv) -> (B, Sq, Hq, Dv) in q's dtype.
  // mask: bool (True = attend) or additive float, broadcastable to (B, Hq, Sq, Skv); causal masks
  // keys after the query's position, aligned bottom-right. scale 0 means 1/sqrt(D); softcap 0 =
  // off; sinks: one logit per query head (attention sinks), or None.
  m.def(
      "flash_attn(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale, "
      "float softcap, Tensor? sinks) -> Tensor");
  // Rotary position embedding of transformers' Llama family on its own cos / sin, both q and k:
  // x * cos + rotate_half(x) * sin, q (B, Hq, T, D), k (B, Hk, T, D), cos / sin (B or 1, T, D).
  m.def("rotary_half(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  // A key/value cache append: k (..., n, D) and v (..., n, Dv) written into rows [position,
  // position + n) of the buffers keys (..., capacity, D) and values (..., capacity, Dv), in place.
  m.def("kv_write(Tensor(a!) keys, Tensor(b!) values, Tensor k, Tensor v, int position) -> ()");
}

GGML_KERNELS_LIBRARY_IMPL(GGML_KERNELS_DISPATCH_KEY, m) {
  m.impl("flash_attn", &flash_attn);
  m.impl("rotary_half", &rotary_half);
  m.impl("kv_write", &kv_write);
}

GGML_KERNELS_PYTHON_MODULE()

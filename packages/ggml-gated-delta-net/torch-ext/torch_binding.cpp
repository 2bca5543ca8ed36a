// Op schemas of ggml-gated-delta-net and their per-backend implementations.
#include "torch_binding.h"

#include "registration.h"

GGML_KERNELS_LIBRARY(m) {
  // Gated delta rule, transformers' layout: q, k (B, T, Hk, D), v (B, T, Hv, D), g and beta
  // (B, T, Hv), state (B, Hv, D, D) float32 or None -> (output (B, T, Hv, D) in q's dtype,
  // final state (B, Hv, D, D) float32). Value head h reads key head h // (Hv / Hk).
  m.def(
      "gated_delta_net(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? state, "
      "bool l2_normalize_qk, float? scale) -> (Tensor, Tensor)");
  // The same, with the final state written over `state` (ggml's layout: a state gated_delta_net
  // returned, or a zeros_like of one) -> output. Decode with a cache: no new state, no copy back.
  m.def(
      "gated_delta_net_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
      "bool l2_normalize_qk, float? scale) -> Tensor");
  // Short causal depthwise conv with a rolling state: x (B, C, T), weight (C, 1, K) or (C, K),
  // state (B, C, W >= K - 1) or None -> (y (B, C, T) in x's dtype, new state (B, C, W or K)).
  m.def(
      "causal_conv1d(Tensor x, Tensor weight, Tensor? state, Tensor? bias, str? activation) "
      "-> (Tensor, Tensor)");
  // The same, with the new rolling state written over `state` -> y. Decode with a cache: the
  // state is rolled in place and the conv reads it there.
  m.def(
      "causal_conv1d_(Tensor x, Tensor weight, Tensor(a!) state, Tensor? bias, str? activation) -> "
      "Tensor");
  // x * rsqrt(sum(x^2) + eps) over the last dim, as Qwen3.5 (and FLA) normalise q and k.
  m.def("l2_norm(Tensor x, float eps) -> Tensor");
  // g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); float32.
  m.def("gates(Tensor A_log, Tensor a, Tensor dt_bias, Tensor b) -> (Tensor, Tensor)");
  // weight * rms_norm(x) * silu(gate) over the last dim (Qwen3.5's gated RMSNorm).
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor");
  // Diagnostics: how many times the ops' own code read or wrote tensor memory from the host since
  // load (the CPU build's fast paths; always 0 on a Metal build, whose tensors may be device
  // memory). Takes no tensor, so it has no dispatch key: a plain (catch-all) kernel.
  m.def("_host_tensor_accesses() -> int", &gdn_ops::host_tensor_accesses);
}

GGML_KERNELS_LIBRARY_IMPL(GGML_KERNELS_DISPATCH_KEY, m) {
  m.impl("gated_delta_net", &gdn_ops::gated_delta_net);
  m.impl("gated_delta_net_", &gdn_ops::gated_delta_net_inplace);
  m.impl("causal_conv1d", &causal_conv1d);
  m.impl("causal_conv1d_", &causal_conv1d_inplace);
  m.impl("l2_norm", &gdn_ops::l2_norm);
  m.impl("gates", &gdn_ops::gates);
  m.impl("gated_rms_norm", &gdn_ops::gated_rms_norm);
}

GGML_KERNELS_PYTHON_MODULE()

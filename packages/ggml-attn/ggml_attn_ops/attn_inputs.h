// The inputs of ggml-attn's ops as every backend checks and prepares them: argument checks with
// the same exception types and words on each backend, ggml's additive f16 mask, float32 sinks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace attn_ops {

constexpr int64_t kMaxHeadDim = 1024;

// q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv): one float dtype, Hq % Hkv == 0; the
// float32 output (B, Sq, Hq, Dv) within kMaxTensorBytes.
void check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, double softcap);

// The additive f16 mask ggml reads: (Bm, Hm, Sq, Skv), Bm in {1, B}, Hm in {1, Hq}, contiguous,
// -inf where a key is hidden (the caller's mask and / or causal, aligned bottom-right), within
// kMaxTensorBytes, made by torch on `device` (q's: a Metal build binds only storages of the op's
// device into its graph). Undefined when nothing is masked.
at::Tensor additive_mask(const std::optional<at::Tensor>& mask, bool causal, int64_t b, int64_t hq,
                         int64_t sq, int64_t skv, at::Device device);

// The sinks as float32 (one per query head), undefined when there are none.
at::Tensor float32_sinks(const std::optional<at::Tensor>& sinks, int64_t hq);

// t with a dense innermost dim, as ggml reads rows (t itself when it has one; other strides kept).
at::Tensor dense_rows(const at::Tensor& t);

// q as ggml's flash attention takes it: float32, dense rows.
at::Tensor float32_query(const at::Tensor& q);

// 1/sqrt(D) for scale 0, else scale.
float attention_scale(double scale, int64_t head_dim);

// out (B, Sq, Hq, Dv): the rows of queries whose keys are all masked set to zero (the value every
// path gives them), where a kernel's softmax sum without a zero guard left NaN.
void zero_fully_masked_rows(at::Tensor& out, const at::Tensor& mask, int64_t b, int64_t hq);

// rotary_half's q, k (B, H, T, D) float32 and cos / sin (B or 1, T, D) float32, one shape, D even.
void check_rotary_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                         const at::Tensor& sin);

// kv_write's cache buffers and rows: float32, float16 or bfloat16 caches, the rows of the same
// dtype and leading dims, in range, apart from the rows they are written to.
void check_kv_write_inputs(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k,
                           const at::Tensor& v, int64_t position);

}  // namespace attn_ops

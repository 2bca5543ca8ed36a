// ggml-attn's inputs as every backend checks and prepares them (attn_inputs.h).
#include "attn_inputs.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <utility>

#include "ggml_torch.h"

using namespace ggml_kernels;

namespace attn_ops {

namespace {

void check_rotary_input(const at::Tensor& x, const char* name, const at::Tensor& table) {
  check_device(x, name);
  check_dtype(x, {at::kFloat}, name);
  check_dim(x, 4, name);
  TORCH_CHECK_VALUE(x.size(2) == table.size(1) && x.size(3) == table.size(2) &&
                        (table.size(0) == 1 || table.size(0) == x.size(0)),
                    name, " (batch, heads, tokens, head dim) ", x.sizes(),
                    " does not match cos / sin (batch or 1, tokens, head dim) ", table.sizes());
  TORCH_CHECK_VALUE(x.stride(3) == 1 || x.size(3) == 1, name,
                    "'s last dim must be dense, got strides ", x.strides());
}

void check_cache_rows(const at::Tensor& buf, const at::Tensor& x, int64_t position,
                      const char* buf_name, const char* x_name) {
  check_device(buf, buf_name);
  check_device(x, x_name);
  check_dtype(buf, {at::kFloat, at::kHalf, at::kBFloat16}, buf_name);
  TORCH_CHECK_TYPE(buf.scalar_type() == x.scalar_type(), x_name, " has dtype ", x.scalar_type(),
                   " but ", buf_name, " holds ", buf.scalar_type());
  TORCH_CHECK_VALUE(buf.dim() >= 2 && x.dim() == buf.dim(), x_name, " ", x.sizes(), " and ",
                    buf_name, " ", buf.sizes(),
                    " must both be (..., rows, D) with the same number of dims");
  for (int64_t i = 0; i < buf.dim(); ++i) {
    TORCH_CHECK_VALUE(i == buf.dim() - 2 || buf.size(i) == x.size(i), x_name, " ", x.sizes(),
                      " does not fit ", buf_name, " ", buf.sizes(),
                      ": all dims but the rows must match");
  }
  const int64_t rows = x.size(-2), capacity = buf.size(-2);
  // (as `position <= capacity - rows`: position + rows can overflow)
  TORCH_CHECK_INDEX(position >= 0 && rows <= capacity && position <= capacity - rows, "position ",
                    position, " + ", rows, " rows of ", x_name, " do not fit in the ", capacity,
                    " rows of ", buf_name);
  TORCH_CHECK_VALUE(buf.stride(-1) == 1 || buf.size(-1) <= 1, buf_name,
                    "'s last dim must be dense, got strides ", buf.strides());
  check_no_internal_overlap(buf, buf_name);
}

// x must not share memory with the rows of buf it is written to (a row copied after another row
// overwrote it would be wrong), as torch's copy_ refuses. Only a buffer x lies in needs the view.
void check_apart(const at::Tensor& buf, const at::Tensor& x, int64_t position,
                 const char* rows_name, const char* x_name) {
  if (may_overlap(buf, x))
    check_no_overlap(buf.narrow(-2, position, x.size(-2)), rows_name, x, x_name);
}

}  // namespace

void check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, double softcap) {
  check_device(q, "query");
  check_device(k, "key");
  check_device(v, "value");
  for (auto [t, name] : {std::pair{&q, "query"}, {&k, "key"}, {&v, "value"}}) {
    check_dtype(*t, {at::kFloat, at::kHalf, at::kBFloat16}, name);
    check_dim(*t, 4, name);
  }
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
                   "query, key and value must share one dtype, got ", q.scalar_type(), ", ",
                   k.scalar_type(), ", ", v.scalar_type());
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(3), hkv = k.size(1), dv = v.size(3);
  TORCH_CHECK_VALUE(k.size(0) == b && v.size(0) == b, "batch sizes differ: query ", b, ", key ",
                    k.size(0), ", value ", v.size(0));
  TORCH_CHECK_VALUE(v.size(1) == hkv && v.size(2) == k.size(2), "key ", k.sizes(), " and value ",
                    v.sizes(), " must have the same heads and length");
  TORCH_CHECK_VALUE(hkv > 0 && hq % hkv == 0, "query heads (", hq,
                    ") must be a multiple of key/value heads (", hkv, ")");
  TORCH_CHECK_VALUE(k.size(3) == d, "query head dim ", d, " != key head dim ", k.size(3));
  TORCH_CHECK_VALUE(d >= 1 && d <= kMaxHeadDim && dv >= 1 && dv <= kMaxHeadDim, "head dim ", d, "/",
                    dv, " is not supported (1..", kMaxHeadDim, ")");
  TORCH_CHECK_VALUE(fits_float32(scale) && fits_float32(softcap) && softcap >= 0,
                    "scale must be finite and softcap finite and >= 0", kFloat32Range,
                    ", got scale ", scale, ", softcap ", softcap);
  check_size({b, q.size(2), hq, dv}, at::kFloat, "the attention output");
}

// The additive f16 mask ggml reads: (Bm, Hm, Sq, Skv), Bm in {1, B}, Hm in {1, Hq}, contiguous.
// Undefined when nothing is masked.
at::Tensor additive_mask(const std::optional<at::Tensor>& mask, bool causal, int64_t b, int64_t hq,
                         int64_t sq, int64_t skv, at::Device device) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    at::Tensor mm = *mask;
    check_device(mm, "mask");
    check_dtype(mm, {at::kBool, at::kFloat, at::kHalf, at::kBFloat16}, "mask");
    TORCH_CHECK_VALUE(mm.dim() >= 2 && mm.dim() <= 4, "mask must be (Sq, Skv), (B, Sq, Skv) or ",
                      "(B, 1 or Hq, Sq, Skv), got shape ", mm.sizes());
    if (mm.dim() == 2) mm = mm.view({1, 1, mm.size(0), mm.size(1)});
    if (mm.dim() == 3) mm = mm.unsqueeze(1);
    TORCH_CHECK_VALUE(
        mm.size(3) == skv && mm.size(2) == sq && (mm.size(1) == 1 || mm.size(1) == hq) &&
            (mm.size(0) == 1 || mm.size(0) == b),
        "mask of shape ", mask->sizes(), " does not broadcast to (B, Hq, Sq, Skv) = (", b, ", ", hq,
        ", ", sq, ", ", skv, ")");
    check_size(mm.sizes(), at::kHalf, "the additive f16 mask");
    if (mm.scalar_type() == at::kBool) {
      m = at::zeros(mm.sizes(), mm.options().dtype(at::kHalf));
      m.masked_fill_(mm.logical_not(), neg_inf);
    } else {
      m = mm.to(at::kHalf).contiguous();  // below f16's range is -inf: still masked
    }
  }
  // Causal, aligned bottom-right: query i sees keys j <= i + (Skv - Sq). One query sees them all.
  const bool causal_masks_something = causal && sq > 1;
  if (causal_masks_something || (causal && skv < sq)) {
    if (!m.defined()) check_size({sq, skv}, at::kHalf, "the additive f16 causal mask");
    const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
    at::Tensor hidden =
        at::arange(skv, opts).unsqueeze(0) > (at::arange(sq, opts).unsqueeze(1) + (skv - sq));
    if (!m.defined()) m = at::zeros({1, 1, sq, skv}, opts.dtype(at::kHalf));
    m.masked_fill_(hidden, neg_inf);
  }
  return m.defined() ? m.contiguous() : m;
}

// The sinks as float32 (one per query head), undefined when there are none.
at::Tensor float32_sinks(const std::optional<at::Tensor>& sinks, int64_t hq) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  check_device(*sinks, "sinks");
  check_dtype(*sinks, {at::kFloat, at::kHalf, at::kBFloat16}, "sinks");
  TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->size(0) == hq,
                    "sinks must hold one value per query head (", hq, "), got shape ",
                    sinks->sizes());
  return float32_contiguous(*sinks);
}

at::Tensor dense_rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

at::Tensor float32_query(const at::Tensor& q) {
  return q.scalar_type() != at::kFloat ? q.to(at::kFloat).contiguous() : dense_rows(q);
}

float attention_scale(double scale, int64_t head_dim) {
  return scale == 0.0 ? 1.0f / std::sqrt(static_cast<float>(head_dim)) : static_cast<float>(scale);
}

void zero_fully_masked_rows(at::Tensor& out, const at::Tensor& mask, int64_t b, int64_t hq) {
  if (!mask.defined()) return;
  at::Tensor dead = (mask == -std::numeric_limits<float>::infinity()).all(-1);  // (Bm, Hm, Sq)
  dead = dead.expand({b, hq, mask.size(2)}).permute({0, 2, 1}).unsqueeze(-1);   // (B, Sq, Hq, 1)
  if (dead.any().item<bool>()) out.masked_fill_(dead, 0.0f);
}

void check_rotary_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                         const at::Tensor& sin) {
  for (auto [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check_device(*t, name);
    check_dtype(*t, {at::kFloat}, name);
    check_dim(*t, 3, name);
  }
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes(), "cos ", cos.sizes(), " and sin ", sin.sizes(),
                    " must have one shape");
  TORCH_CHECK_VALUE(cos.size(2) % 2 == 0, "the rotated head dim must be even, got ", cos.size(2));
  check_rotary_input(q, "q", cos);
  check_rotary_input(k, "k", cos);
  TORCH_CHECK_VALUE(k.size(0) == q.size(0), "q has batch ", q.size(0), " but k has ", k.size(0));
}

void check_kv_write_inputs(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k,
                           const at::Tensor& v, int64_t position) {
  check_cache_rows(keys, k, position, "keys", "k");
  check_cache_rows(values, v, position, "values", "v");
  check_apart(keys, k, position, "the rows of keys written", "k");
  check_apart(values, v, position, "the rows of values written", "v");
}

}  // namespace attn_ops

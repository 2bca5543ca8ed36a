// ggml-attn on Metal: each op is one ggml graph that upstream's Metal backend runs, its host code
// choosing the kernels.
//
// flash_attn: one ggml_flash_attn_ext over the whole call (all batch entries and heads): torch q
// (B, Hq, Sq, D) is ggml's {D, Sq, Hq, B}, K/V stay in the caller's dtype (ggml-metal has kernels
// for float32, float16 and bfloat16 caches), the mask is ggml's additive f16 one with its batch and
// head broadcast, the result {Dv, Hq, Sq, B} is torch's (B, Sq, Hq, Dv). Upstream takes its vec
// kernels below 20 queries (head dims that are multiples of 32) and the tiled simdgroup-matrix ones
// otherwise. It has kernels for some (key, value) head dim pairs only (kMetalHeadDims): others
// raise NotImplementedError before anything is built (its supports_op lets some of them through,
// whose pipelines then fail to build).
//
// rotary_half: transformers' cos / sin tables are not ggml's ROPE (which computes its angles from
// positions), so the rotation is ggml's element-wise ops on the two halves of each row:
// [x1 c1 - x2 s1, x2 c2 + x1 s2], each product rounded, then the sum, as the CPU loop and
// transformers' torch ops round.
//
// kv_write: ggml's SET_ROWS (llama.cpp's own KV-cache write) of the new rows into the cache, both
// caches in one graph; the caches are the graph's in-place results.
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include "attn_inputs.h"
#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace attn_ops;

namespace {

constexpr int64_t kMaxQueries = 65535;  // ggml-metal's flash attention takes ne01 < 65536

// The (key, value) head dims upstream instantiates its flash-attention kernels for, vec and tiled
// alike (METAL_HEAD_DIM_PAIRS in ggml_attn/_checks.py, which says the same words).
constexpr std::pair<int64_t, int64_t> kMetalHeadDims[] = {
    {32, 32},   {40, 40},   {48, 48},   {64, 64},   {72, 72},   {80, 80},   {96, 64},   {96, 96},
    {112, 112}, {128, 128}, {192, 128}, {192, 192}, {256, 256}, {320, 256}, {512, 512}, {576, 512}};

void check_metal_head_dims(int64_t d, int64_t dv) {
  const auto pair = std::pair{d, dv};
  if (std::find(std::begin(kMetalHeadDims), std::end(kMetalHeadDims), pair) !=
      std::end(kMetalHeadDims))
    return;
  std::ostringstream pairs;
  const char* separator = "";
  for (const auto& [key, value] : kMetalHeadDims) {
    pairs << separator << key << "/" << value;
    separator = ", ";
  }
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "ggml-metal has no kernel for FLASH_ATTN_EXT with key head dim ", d,
      " and value head dim ", dv, "; its kernels take the key/value head dims ", pairs.str(),
      " (supports_flash_attn says which), the CPU build any up to ", kMaxHeadDim);
}

// t's rows [at, at + n) of its innermost dim, ggml tensor `x` ({D, ...}) seen through a view.
ggml_tensor* half_rows(ggml_context* ctx, ggml_tensor* x, int64_t at, int64_t n) {
  const auto& G = ggml();
  return G.ggml_view_4d(ctx, x, n, x->ne[1], x->ne[2], x->ne[3], x->nb[1], x->nb[2], x->nb[3],
                        static_cast<size_t>(at) * x->nb[0]);
}

// cos / sin (Bc, T, D) contiguous as ggml's {D, T, 1, Bc}: broadcast over the heads.
ggml_tensor* table(Graph& g, const at::Tensor& t) {
  const size_t es = sizeof(float), row = static_cast<size_t>(t.size(2)) * es,
               plane = row * static_cast<size_t>(t.size(1));
  ggml_tensor* view = g.raw(GGML_TYPE_F32, t.data_ptr(), {t.size(2), t.size(1), 1, t.size(0)},
                            {es, row, plane, plane});
  g.note(view, t);  // a backend that binds storages (MPS) finds it in t's
  return view;
}

// x * cos + rotate_half(x) * sin of x (B, H, T, D) float32 into a new (B, H, T, D) tensor.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s) {
  const auto& G = ggml();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const int64_t half = x.size(3) / 2;
  Graph g(32);
  ggml_context* ctx = g.ctx();
  ggml_tensor* xt = g.view(x);
  ggml_tensor *ct = table(g, c), *st = table(g, s);
  ggml_tensor *x1 = half_rows(ctx, xt, 0, half), *x2 = half_rows(ctx, xt, half, half);
  ggml_tensor *c1 = half_rows(ctx, ct, 0, half), *c2 = half_rows(ctx, ct, half, half);
  ggml_tensor *s1 = half_rows(ctx, st, 0, half), *s2 = half_rows(ctx, st, half, half);
  ggml_tensor* lo = G.ggml_sub(ctx, G.ggml_mul(ctx, x1, c1), G.ggml_mul(ctx, x2, s1));
  ggml_tensor* hi = G.ggml_add(ctx, G.ggml_mul(ctx, x2, c2), G.ggml_mul(ctx, x1, s2));
  g.compute(G.ggml_concat(ctx, lo, hi, 0), out);
  return out;
}

// buf (..., capacity, D) contiguous as ggml's {D, capacity, rows of all leading dims}.
ggml_tensor* cache_view(Graph& g, const at::Tensor& buf) {
  const int64_t d = buf.size(-1), cap = buf.size(-2),
                lead = buf.numel() / std::max<int64_t>(1, d * cap);
  const size_t es = static_cast<size_t>(buf.element_size()), row = static_cast<size_t>(d) * es;
  const size_t plane = row * static_cast<size_t>(cap);
  ggml_tensor* view = g.raw(ggml_type_of(buf.scalar_type()), buf.data_ptr(), {d, cap, lead, 1},
                            {es, row, plane, plane * static_cast<size_t>(lead)});
  g.note(view, buf);
  return view;
}

// The new rows x (..., n, D) as SET_ROWS takes them: float32 or float16, contiguous (bfloat16
// rows go through float32, exactly).
at::Tensor rows_source(const at::Tensor& x) {
  return (x.scalar_type() == at::kBFloat16 ? x.to(at::kFloat) : x).contiguous();
}

}  // namespace

at::Tensor flash_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& mask, bool causal, double scale,
                      double softcap, const std::optional<at::Tensor>& sinks) {
  check_attention_inputs(q, k, v, scale, softcap);
  check_metal_head_dims(q.size(3), v.size(3));
  TORCH_CHECK_VALUE(q.size(2) <= kMaxQueries, "ggml-metal's flash attention takes at most ",
                    kMaxQueries, " query rows per call, got ", q.size(2));
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), skv = k.size(2), dv = v.size(3);
  const at::Tensor sinks32 = float32_sinks(sinks, hq);
  const at::Tensor m = additive_mask(mask, causal, b, hq, sq, skv, q.device());
  const at::Tensor q32 = float32_query(q), kd = dense_rows(k), vd = dense_rows(v);
  at::Tensor out = at::empty({b, sq, hq, dv}, q.options().dtype(at::kFloat));
  if (out.numel() > 0 && skv == 0) out.zero_();  // nothing to attend to
  if (out.numel() > 0 && skv > 0) {
    const auto& G = ggml();
    Graph g(16);
    ggml_tensor* r = G.ggml_flash_attn_ext(
        g.ctx(), g.view(q32), g.view(kd), g.view(vd), m.defined() ? g.view(m) : nullptr,
        attention_scale(scale, q.size(3)), 0.0f, static_cast<float>(softcap));
    G.ggml_flash_attn_ext_set_prec(r, GGML_PREC_F32);
    if (sinks32.defined()) G.ggml_flash_attn_ext_add_sinks(r, g.view(sinks32));
    g.compute(r, out);
    zero_fully_masked_rows(out, m, b, hq);
  }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> rotary_half(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary_inputs(q, k, cos, sin);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  return {rotate(q, c, s), rotate(k, c, s)};
}

void kv_write(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k,
              const at::Tensor& v, int64_t position) {
  check_kv_write_inputs(keys, values, k, v, position);
  const int64_t n = k.size(-2), nv = v.size(-2);
  if ((n == 0 || k.numel() == 0) && (nv == 0 || v.numel() == 0)) return;
  // SET_ROWS writes a contiguous cache in place; another layout is written through a copy.
  at::Tensor kc = keys.contiguous(), vc = values.contiguous();
  const auto& G = ggml();
  Graph g(16);
  ggml_context* ctx = g.ctx();
  std::vector<ggml_tensor*> written;
  std::vector<at::Tensor> keep;
  for (auto [buf, x] : {std::pair{&kc, &k}, std::pair{&vc, &v}}) {
    if (x->numel() == 0) continue;
    keep.push_back(at::arange(position, position + x->size(-2), x->options().dtype(at::kLong)));
    keep.push_back(rows_source(*x));
    ggml_tensor* rows = cache_view(g, keep.back());
    written.push_back(
        G.ggml_set_rows(ctx, cache_view(g, *buf), rows, g.view(keep[keep.size() - 2])));
  }
  g.compute_bound(written);
  if (!kc.is_same(keys)) keys.copy_(kc);
  if (!vc.is_same(values)) values.copy_(vc);
}

// topk on the CPU: mixture-of-experts routing (softmax over the experts -> top-k -> optional
// renormalisation of the chosen weights) for a batch of token rows.
//
// top_k is one fused pass per token row in our own C++: the row is read once into float32 (its max
// and any NaN found on the way), exponentiated, normalised, and the k largest are chosen with the
// very standard-library algorithms torch.topk runs on the CPU (partial_sort when k * 64 <= E,
// nth_element + sort otherwise, comparing with `>`): the same comparisons on the same values put
// tied experts in the same order as torch. Token rows are split over torch's threads.
//
// top_k_ggml builds the same routing as a ggml graph per slice of rows (ggml-cpu's soft_max_ext ->
// top_k -> get_rows [-> sum_rows, div], as llama.cpp routes its MoE layers). It is kept to compare
// against (README: slower in all but one cell measured); ggml's top_k chooses among tied
// experts its own way, so its ties are not torch's.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "checks.h"
#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace topk_ops;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Rows worth of work each thread takes at least: ~8K logits, so that decode (one token) and small
// batches run inline on the calling thread where waking another would cost more than it saves.
int64_t min_rows_per_task(int64_t experts) { return std::max<int64_t>(1, 8192 / experts); }

// torch.topk(v, k, largest=True, sorted=True) on the CPU, as indices into v: the same standard
// library algorithm torch picks for this (k, n), with the same comparisons, so tied values come out
// in torch's order (which is not "lowest index first"; it is whatever partial_sort's heap or
// nth_element's partitioning leaves). The algorithms move (value, index) pairs, as torch's general
// path does; which elements they move depends only on the comparisons, so moving pairs, or indices
// as torch's unit-stride path does, ends in the same order. v holds no NaN here; `pairs` is n long.
using Pair = std::pair<float, int32_t>;
__attribute__((noinline)) void select_top_k(const float* v, int64_t n, int64_t k, int32_t* idx,
                                            Pair* pairs) {
  for (int64_t i = 0; i < n; ++i) pairs[i] = {v[i], static_cast<int32_t>(i)};
  const auto greater = [](const Pair& a, const Pair& b) { return a.first > b.first; };
  if (k * 64 <= n) {
    std::partial_sort(pairs, pairs + k, pairs + n, greater);
  } else {
    std::nth_element(pairs, pairs + k - 1, pairs + n, greater);
    std::sort(pairs, pairs + k - 1, greater);
  }
  for (int64_t j = 0; j < k; ++j) idx[j] = pairs[j].second;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Writes w into element i of a weights row of dtype `dt` (rounding to nearest even, as .to() does).
inline void store_weight(void* row, at::ScalarType dt, int64_t i, float w) {
  switch (dt) {
    case at::kFloat: static_cast<float*>(row)[i] = w; break;
    case at::kBFloat16: static_cast<c10::BFloat16*>(row)[i] = c10::BFloat16(w); break;
    default: static_cast<c10::Half*>(row)[i] = c10::Half(w); break;
  }
}

constexpr int64_t kFastMaxK = 16;  // the fast path's k at most

// ---- the per-row work, written once with GCC's generic vectors
// ----------------------------------- 8 float lanes: the baseline x86-64 build runs them as two
// SSE2 halves, the AVX2 build (same source, compiled a second time with target("avx2"), picked at
// load time) as one register. No FMA in either, and every sum is taken in one fixed order whatever
// the width, so both give the same bits.
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint16_t vu16x8 __attribute__((vector_size(16)));

#define TOPK_INLINE __attribute__((always_inline)) inline

TOPK_INLINE vf8 load8(const float* p) {
  vf8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
TOPK_INLINE void store8(float* p, vf8 v) { __builtin_memcpy(p, &v, sizeof(v)); }
TOPK_INLINE vf8 splat(float x) { return vf8{} + x; }
TOPK_INLINE vf8 vmax(vf8 a, vf8 b) { return a > b ? a : b; }

TOPK_INLINE float hmax8(vf8 x) {
  x = vmax(x, __builtin_shuffle(x, vi8{4, 5, 6, 7, 0, 1, 2, 3}));
  x = vmax(x, __builtin_shuffle(x, vi8{2, 3, 0, 1, 6, 7, 4, 5}));
  x = vmax(x, __builtin_shuffle(x, vi8{1, 0, 3, 2, 5, 4, 7, 6}));
  return x[0];
}

// exp(x) for x <= 0 (or -inf). Range reduction x = n ln2 + r (|r| <= ln2/2; ln2 split in two parts
// so that n ln2 is exact), e^r by its Taylor polynomial to degree 7 (truncation < 1e-8 relative),
// times 2^n built in the exponent bits: within ~2 ulp of the correctly rounded value. Below -87.33,
// where e^x leaves the normal floats, the result is 0.
TOPK_INLINE vf8 exp_nonpositive(vf8 x) {
  const vf8 lo = splat(-87.33654f);
  const vi8 under = x < lo;
  x = under ? lo : x;
  const vf8 shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf8 n = (x * 1.44269504088896341f + shifter) - shifter;
  vf8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf8 p = splat(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi8 bits = (__builtin_convertvector(n, vi8) + 127) << 23;
  vf8 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const vf8 e = p * scale;
  return under ? vf8{} : e;
}

// v[i] = exp(v[i] - mx) for the row; returns the sum of the v[i] (8 running sums, then the tail).
TOPK_INLINE float exp_sum(float* v, int64_t n, float mx) {
  vf8 acc = vf8{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vf8 e = exp_nonpositive(load8(v + i) - mx);
    store8(v + i, e);
    acc += e;
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) {
    v[i] = exp_nonpositive(splat(v[i] - mx))[0];
    sum += v[i];
  }
  return sum;
}

struct RowStats {
  float max;
  int64_t pos_inf;  // how many +inf
  bool nan;
};

TOPK_INLINE void stats_of_block(vf8 x, vf8& mx, vi8& nan, vi8& pinf) {
  nan |= x != x;
  mx = vmax(x, mx);  // NaN lanes keep the old max; the row is refused anyway
  pinf -= x == splat(kInf);
}

// Copies one row into v as float32 and returns its max, NaN and +inf count.
template <typename T>
TOPK_INLINE RowStats load_row(const T* x, int64_t n, float* v) {
  vf8 mx = splat(-kInf);
  vi8 nan = vi8{}, pinf = vi8{};
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 8 <= n; i += 8) {
      const vf8 xv = load8(x + i);
      store8(v + i, xv);
      stats_of_block(xv, mx, nan, pinf);
    }
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 8 <= n; i += 8) {  // bfloat16 is the top half of a float32
      vu16x8 h;
      __builtin_memcpy(&h, x + i, sizeof(h));
      const vi8 bits = __builtin_convertvector(h, vi8) << 16;
      vf8 xv;
      __builtin_memcpy(&xv, &bits, sizeof(xv));
      store8(v + i, xv);
      stats_of_block(xv, mx, nan, pinf);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) v[j] = static_cast<float>(x[j]);
    for (; i + 8 <= n; i += 8) stats_of_block(load8(v + i), mx, nan, pinf);
  }
  RowStats st{hmax8(mx), 0, false};
  for (int l = 0; l < 8; ++l) {
    st.nan |= nan[l] != 0;
    st.pos_inf += pinf[l];
  }
  for (; i < n; ++i) {
    const float f = to_float(x[i]);
    v[i] = f;
    st.nan |= f != f;
    st.max = f > st.max ? f : st.max;
    st.pos_inf += f == kInf;
  }
  return st;
}

// The m (<= 17) largest of s, largest first, in bv / bi. A value equal to the smallest kept is not
// taken in: the kept values are right as a multiset whatever the ties, and any tie among them sends
// the row to select_top_k anyway.
TOPK_INLINE void push(float x, int32_t i, int64_t m, int64_t& cnt, float* bv, int32_t* bi) {
  int64_t j;
  if (cnt < m) {
    j = cnt++;
  } else {
    if (!(x > bv[m - 1])) return;
    j = m - 1;
  }
  while (j > 0 && bv[j - 1] < x) {
    bv[j] = bv[j - 1];
    bi[j] = bi[j - 1];
    --j;
  }
  bv[j] = x;
  bi[j] = i;
}

// With at least m blocks of 8, the m-th largest block maximum is a floor the m largest values all
// reach (m different elements reach it), and few others do: a first pass finds it from the block
// maxima (bm: n / 8 floats of scratch), a second one takes in only the blocks that reach it.
TOPK_INLINE void largest_m(const float* s, int64_t n, int64_t m, float* bv, int32_t* bi,
                           float* bm) {
  int64_t cnt = 0;
  const int64_t blocks = n / 8;
  if (blocks < m) {
    for (int64_t i = 0; i < n; ++i) push(s[i], static_cast<int32_t>(i), m, cnt, bv, bi);
    return;
  }
  float floor_v[kFastMaxK + 1];
  int32_t unused[kFastMaxK + 1];
  int64_t fcnt = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    bm[b] = hmax8(load8(s + 8 * b));
    push(bm[b], 0, m, fcnt, floor_v, unused);
  }
  const float floor = floor_v[m - 1];
  for (int64_t b = 0; b < blocks; ++b) {
    if (!(bm[b] >= floor)) continue;
    const vf8 x = load8(s + 8 * b);
    for (int l = 0; l < 8; ++l)
      if (x[l] >= floor) push(x[l], static_cast<int32_t>(8 * b + l), m, cnt, bv, bi);
  }
  for (int64_t i = 8 * blocks; i < n; ++i)
    if (s[i] >= floor) push(s[i], static_cast<int32_t>(i), m, cnt, bv, bi);
}

struct Scratch {
  std::vector<float> v, bm;
  std::vector<int32_t> idx;
  std::vector<Pair> pairs;
  void reserve(int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) {
      v.resize(n);
      idx.resize(n);
      bm.resize(n / 8 + 1);
      pairs.resize(n);
    }
  }
};

struct Job {
  const void* x;
  int64_t x_stride, n, k;
  bool softmax, normalize;
  void* w;
  at::ScalarType wdt;
  int64_t w_es;
  void* idx;
  bool idx64;
  RowErrors* errors;
};

// Step 1 of a row: its scores in v, whose order is the order of the final weights v[i] * inv (inv
// returned). NaN (and, with softmax, a row of -inf only) is noted in errors, and the row skipped.
template <typename T>
TOPK_INLINE bool row_scores(const Job& job, int64_t r, float* v, float& inv) {
  const int64_t n = job.n;
  const RowStats st = load_row(static_cast<const T*>(job.x) + r * job.x_stride, n, v);
  if (st.nan) {
    RowErrors::note(job.errors->nan, r);
    return false;
  }
  inv = 1.0f;
  if (!job.softmax) return true;
  if (st.max == -kInf) {
    RowErrors::note(job.errors->all_neg_inf, r);
    return false;
  }
  if (st.pos_inf > 0) {  // softmax's limit: the +inf share 1, the rest get 0
    for (int64_t i = 0; i < n; ++i) v[i] = v[i] == kInf ? 1.0f : 0.0f;
    inv = 1.0f / static_cast<float>(st.pos_inf);
  } else {
    inv = 1.0f / exp_sum(v, n, st.max);  // torch scales by the reciprocal of the sum too
  }
  return true;
}

// The k experts chosen for a row, largest first: their indices, and their weights in `weights`, or
// null when the weights are v[idx[j]].
struct Chosen {
  const int32_t* idx;
  const float* weights;
  float weight(const float* v, int64_t j) const { return weights ? weights[j] : v[idx[j]]; }
};

// Per-thread room for step 2: the fast path's k + 1 largest (values, indices, final weights).
struct FastPicks {
  float values[kFastMaxK + 1], weights[kFastMaxK + 1];
  int32_t idx[kFastMaxK + 1];
};

// Step 2: choose. Fast path: the k + 1 largest values all different; then the k chosen and their
// order are the same for every selection algorithm, torch's included. Otherwise (ties) torch's own
// algorithm runs on the final values (v scaled by inv in place).
TOPK_INLINE Chosen choose(const Job& job, float* v, float inv, Scratch& s, FastPicks& fast) {
  const int64_t n = job.n, k = job.k;
  if (k <= kFastMaxK) {
    const int64_t m = std::min(k + 1, n);  // the k chosen and the best one left out
    largest_m(v, n, m, fast.values, fast.idx, s.bm.data());
    bool unique = true;
    for (int64_t j = 0; j < m; ++j) {
      fast.weights[j] = fast.values[j] * inv;
      unique &= j == 0 || fast.weights[j] < fast.weights[j - 1];
    }
    if (unique) return {fast.idx, fast.weights};
  }
  if (inv != 1.0f)
    for (int64_t i = 0; i < n; ++i) v[i] *= inv;
  select_top_k(v, n, k, s.idx.data(), s.pairs.data());
  return {s.idx.data(), nullptr};
}

// Step 3: the row's k weights (divided by their sum when normalizing, as torch does) and indices.
TOPK_INLINE void write_row(const Job& job, int64_t r, const Chosen& chosen, const float* v) {
  const int64_t k = job.k;
  void* w_row = static_cast<char*>(job.w) + r * k * job.w_es;
  if (job.normalize) {
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) total += chosen.weight(v, j);
    // (total > 0: it holds the row's max)
    for (int64_t j = 0; j < k; ++j) store_weight(w_row, job.wdt, j, chosen.weight(v, j) / total);
  } else {
    for (int64_t j = 0; j < k; ++j) store_weight(w_row, job.wdt, j, chosen.weight(v, j));
  }
  if (job.idx64) {
    auto* out = static_cast<int64_t*>(job.idx) + r * k;
    for (int64_t j = 0; j < k; ++j) out[j] = chosen.idx[j];
  } else {
    auto* out = static_cast<int32_t*>(job.idx) + r * k;
    for (int64_t j = 0; j < k; ++j) out[j] = chosen.idx[j];
  }
}

template <typename T>
TOPK_INLINE void route_chunk_body(const Job& job, int64_t r0, int64_t r1) {
  thread_local Scratch s;
  s.reserve(job.n);
  float* v = s.v.data();
  FastPicks fast;
  for (int64_t r = r0; r < r1; ++r) {
    float inv;
    if (!row_scores<T>(job, r, v, inv)) continue;
    write_row(job, r, choose(job, v, inv, s, fast), v);
  }
}

template <typename T>
void route_chunk_x64(const Job& job, int64_t r0, int64_t r1) {
  route_chunk_body<T>(job, r0, r1);
}
template <typename T>
__attribute__((target("avx2"))) void route_chunk_avx2(const Job& job, int64_t r0, int64_t r1) {
  route_chunk_body<T>(job, r0, r1);
}

// AVX2 when the CPU has it, unless the ggml runtime is forced to the baseline level
// (GGML_KERNELS_CPU_VARIANT=x64 keeps every op of the build on baseline x86-64 code).
bool use_avx2() {
  static const bool yes = [] {
    const char* forced = std::getenv("GGML_KERNELS_CPU_VARIANT");
    if (forced != nullptr && std::string(forced) == "x64") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}

template <typename T>
void route_rows(const at::Tensor& logits, int64_t k, bool softmax, bool normalize,
                const at::Tensor& weights, const at::Tensor& indices, RowErrors& errors) {
  const Job job{logits.data_ptr(),
                logits.stride(0),
                logits.size(1),
                k,
                softmax,
                normalize,
                weights.data_ptr(),
                weights.scalar_type(),
                static_cast<int64_t>(weights.element_size()),
                indices.data_ptr(),
                indices.scalar_type() == at::kLong,
                &errors};
  const auto chunk = use_avx2() ? route_chunk_avx2<T> : route_chunk_x64<T>;
  parallel_chunks(logits.size(0), min_rows_per_task(job.n), 1, 2,
                  [&](int64_t r0, int64_t r1) { chunk(job, r0, r1); });
}

// A view with a dense last dim (strided rows are fine), else a contiguous copy.
at::Tensor dense_rows(const at::Tensor& t) {
  return t.stride(1) == 1 || t.size(1) == 1 ? t : t.contiguous();
}

// ---- top_k_ggml's steps ----

// Rows [r0, r1) of xf (T, E) float32 routed by one ggml graph: soft_max_ext -> top_k -> get_rows
// [-> sum_rows, div], the k chosen of each row written into weights / idx32 (T, k) in ggml's order.
void ggml_route_rows(const at::Tensor& xf, int64_t k, bool softmax, bool normalize, int64_t r0,
                     int64_t r1, at::Tensor& weights, at::Tensor& idx32) {
  const auto& G = ggml();
  const int64_t m = r1 - r0, n = xf.size(1);
  Graph g(16);
  ggml_context* ctx = g.ctx();
  ggml_tensor* x = g.view(xf.narrow(0, r0, m));  // {E, m}
  ggml_tensor* p = softmax ? G.ggml_soft_max_ext(ctx, x, nullptr, 1.0f, 0.0f) : x;
  ggml_tensor* sel = G.ggml_top_k(ctx, p, static_cast<int>(k));  // I32 {k, m}, in no order
  sel->data = idx32.narrow(0, r0, m).data_ptr();                 // computed straight into ours
  ggml_tensor* w = G.ggml_get_rows(ctx, G.ggml_reshape_3d(ctx, p, 1, n, m), sel);  // {1, k, m}
  if (normalize) {
    ggml_tensor* w2 = G.ggml_reshape_2d(ctx, w, k, m);
    g.compute(G.ggml_div(ctx, w2, G.ggml_sum_rows(ctx, w2)), weights.narrow(0, r0, m));
  } else {
    g.compute(w, weights.narrow(0, r0, m).view({m, k, 1}));
  }
}

// ggml leaves the k chosen in no particular order: rows [r0, r1) sorted largest first, ties by
// index.
void sort_chosen(at::Tensor& weights, at::Tensor& idx32, int64_t r0, int64_t r1) {
  const int64_t k = weights.size(1);
  std::vector<int32_t> order(k), irow(k);
  std::vector<float> wrow(k);
  for (int64_t r = r0; r < r1; ++r) {
    float* wr = weights.data_ptr<float>() + r * k;
    int32_t* ir = idx32.data_ptr<int32_t>() + r * k;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return wr[a] > wr[b] || (wr[a] == wr[b] && ir[a] < ir[b]);
    });
    std::copy(ir, ir + k, irow.begin());
    std::copy(wr, wr + k, wrow.begin());
    for (int64_t j = 0; j < k; ++j) {
      wr[j] = wrow[order[j]];
      ir[j] = irow[order[j]];
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> top_k(const at::Tensor& logits_in, int64_t k, bool softmax,
                                         bool normalize, std::optional<at::ScalarType> dtype,
                                         std::optional<at::ScalarType> index_dtype) {
  check_args(logits_in, k, softmax, normalize);
  const auto [wdt, idt] = output_dtypes(logits_in, dtype, index_dtype);
  const int64_t rows = logits_in.size(0);
  auto weights = at::empty({rows, k}, logits_in.options().dtype(wdt));
  auto indices = at::empty({rows, k}, logits_in.options().dtype(idt));
  if (rows == 0) return {weights, indices};

  const at::Tensor logits = dense_rows(logits_in);
  RowErrors errors;
  switch (logits.scalar_type()) {
    case at::kFloat:
      route_rows<float>(logits, k, softmax, normalize, weights, indices, errors);
      break;
    case at::kBFloat16:
      route_rows<c10::BFloat16>(logits, k, softmax, normalize, weights, indices, errors);
      break;
    default: route_rows<c10::Half>(logits, k, softmax, normalize, weights, indices, errors); break;
  }
  errors.raise_if_any(logits);
  return {weights, indices};
}

std::tuple<at::Tensor, at::Tensor> top_k_ggml(const at::Tensor& logits_in, int64_t k, bool softmax,
                                              bool normalize) {
  check_args(logits_in, k, softmax, normalize);
  const int64_t rows = logits_in.size(0);
  auto weights = at::empty({rows, k}, logits_in.options().dtype(at::kFloat));
  auto idx32 = at::empty({rows, k}, logits_in.options().dtype(at::kInt));
  if (rows == 0) return {weights.to(logits_in.scalar_type()), idx32.to(at::kLong)};

  const at::Tensor xf = float32_contiguous(logits_in);  // ggml's soft_max takes float32 rows
  refuse_rows_ggml_cannot_route(xf, softmax, "top_k_ggml");
  parallel_chunks(rows, min_rows_per_task(xf.size(1)), 1, 2, [&](int64_t r0, int64_t r1) {
    ggml_route_rows(xf, k, softmax, normalize, r0, r1, weights, idx32);
    sort_chosen(weights, idx32, r0, r1);
  });
  return {weights.to(logits_in.scalar_type()), idx32.to(at::kLong)};
}

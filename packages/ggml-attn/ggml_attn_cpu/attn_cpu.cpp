// ggml-attn on the CPU: ggml-cpu's flash_attn_ext on views of the torch tensors.
//
// Layout: torch q (B, Hq, Sq, D) is ggml's {D, Sq, Hq, B}; ggml's result {Dv, Hq, Sq, B} is torch's
// (B, Sq, Hq, Dv), the layout transformers wants back. GQA is native (query head h reads KV head
// h / (Hq / Hkv), as transformers' repeat_kv). Masks become ggml's additive f16 mask.
//
// Work split: prefill slices the query rows of each batch entry over torch's threads, one
// single-threaded graph per slice (aligned to ggml's 64-row tiles, several a thread, the last rows
// first: kPrefillSlicesPerThread); decode (one query row) runs one
// graph per batch entry on torch's threads when there are enough entries; a single sequence splits
// its KV heads over torch's threads (one graph each) up to a few thousand keys, beyond that ggml's
// own pool divides the keys between its threads (split-KV).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "attn_inputs.h"
#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace attn_ops;

namespace {

constexpr int64_t kQueryTile = 64;    // ggml-cpu's flash-attention query tile (GGML_FA_TILE_Q)
constexpr int64_t kSplitKvMin = 512;  // ggml splits one query's keys over threads from here
// Below kSplitKvMin, one sequence's decode step splits its KV heads (with their query heads) over
// torch's threads, one graph per thread, once Hq * Skv * D reaches this. Measured in one process (2
// threads, a hot loop of the op alone), single graph -> split: Hq/Hkv/D = 9/3/64 (SmolLM2) 65 keys
// 8.3 -> 9.6 us (worse: under the threshold), 192 keys 18.4 -> 13.9, 400 keys 34.4 -> 24.5;
// 8/2/256 (Qwen3.5) 65 keys 14.6 -> 9.3 us, 400 keys 73.0 -> 35.8.
constexpr int64_t kSplitHeadsMinWork = 96 * 1024;
// ... and beyond kSplitKvMin up to this many keys when the KV heads divide evenly between the
// threads: 8/2/256 512 keys 72 -> 54 us, 1024 keys 133 -> 107, 2048 keys 229 -> 212; 16/4/256 512
// keys 122 -> 106, 1024 keys 258 -> 211, 2048 keys 455 -> 417. At 4096 keys ggml's own split of the
// keys was as fast or faster (16/4/256: 1.03 vs 1.45 ms in one run).
constexpr int64_t kSplitHeadsMaxKeys = 2048;
// ... and on Intel CPUs at every key count, where ggml's pool, whose workers sleep between graphs,
// woke late: Intel Xeon (2 vCPUs, KVM), 2 threads, 9 alternating rounds against ggml's own op
// (`versus_ggml ggml-attn --only 'decode_kv'`, 2026-12-07), ggml's split -> the heads split:
// 8/2/256 4096 keys 1.65 -> 1.27 ms (0.78 -> 1.02x ggml's op), 16/4/256 3.21 -> 2.57 ms (0.88 ->
// 1.02x); at 16384 keys 9.04 -> 7.53 ms (0.80 -> 0.89x) and 19.8 -> 19.3 ms (0.93 -> 1.02x).
int64_t split_heads_max_keys() {
  return backend::kIntelCpu ? std::numeric_limits<int64_t>::max() : kSplitHeadsMaxKeys;
}

// Slices of a prefill's query rows per thread. ggml skips the key tiles a mask hides entirely, so
// under a causal mask a query row's work grows with its position: one slice per thread left the
// thread holding the last rows three times the work of the first (512 causal rows on 2 threads).
// Several slices a thread, the costliest (last rows) taken first, even the threads out.
constexpr int64_t kPrefillSlicesPerThread = 4;

// Heads [h0, h1) of batch entry bi of t (B, H, S, D) as ggml's {D, S, h1 - h0}, without torch
// views.
ggml_tensor* heads(Graph& g, const at::Tensor& t, int64_t bi, int64_t h0, int64_t h1) {
  const size_t es = static_cast<size_t>(t.element_size());
  const size_t nb2 = static_cast<size_t>(t.stride(1)) * es;
  return g.raw(
      ggml_type_of(t.scalar_type()),
      static_cast<const char*>(t.data_ptr()) +
          (bi * t.stride(0) + h0 * t.stride(1)) * static_cast<int64_t>(es),
      {t.size(3), t.size(2), h1 - h0, 1},
      {es, static_cast<size_t>(t.stride(2)) * es, nb2, nb2 * static_cast<size_t>(h1 - h0)});
}

// One flash_attn call: its inputs as ggml reads them (q float32, K/V rows dense, the additive f16
// mask, float32 sinks) and its float32 output (B, Sq, Hq, Dv), which the graphs write in slices.
// Each graph reads tensors that outlive it: these members, or a mask slice its caller holds.
class AttentionCall {
 public:
  AttentionCall(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& mask, bool causal, double scale, double softcap,
                at::Tensor sinks32)
      : b_(q.size(0)),
        hq_(q.size(1)),
        sq_(q.size(2)),
        d_(q.size(3)),
        hkv_(k.size(1)),
        skv_(k.size(2)),
        dv_(v.size(3)),
        scale_(attention_scale(scale, d_)),
        softcap_(static_cast<float>(softcap)),
        q32_(float32_query(q)),
        k_(dense_rows(k)),
        v_(dense_rows(v)),
        mask_(additive_mask(mask, causal, b_, hq_, sq_, skv_, q.device())),
        sinks32_(std::move(sinks32)),
        out_(at::empty({b_, sq_, hq_, dv_}, q.options().dtype(at::kFloat))) {}

  // The float32 result (B, Sq, Hq, Dv).
  at::Tensor run() {
    if (out_.numel() == 0) return out_;
    if (skv_ == 0) return out_.zero_();  // nothing to attend to
    if (sq_ > 1) {
      prefill();
    } else {
      decode();
    }
    return out_;
  }

 private:
  // Rows [i0, i0 + n) of batch entry bi's mask, contiguous as ggml needs it (a copy when the mask
  // has several heads and the rows are a slice): the caller holds it until its graph has run.
  at::Tensor mask_rows(int64_t bi, int64_t i0, int64_t n) const {
    if (!mask_.defined()) return mask_;
    return mask_.select(0, mask_.size(0) == 1 ? 0 : bi).narrow(1, i0, n).unsqueeze(0).contiguous();
  }

  ggml_tensor* attention(Graph& g, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v,
                         const at::Tensor& mask, const at::Tensor& sinks) const {
    const auto& G = ggml();
    ggml_tensor* out = G.ggml_flash_attn_ext(
        g.ctx(), q, k, v, mask.defined() ? g.view(mask) : nullptr, scale_, 0.0f, softcap_);
    G.ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    if (sinks.defined()) G.ggml_flash_attn_ext_add_sinks(out, g.view(sinks));
    return out;
  }

  // Query rows of each batch entry over torch's threads: kPrefillSlicesPerThread slices a thread
  // (aligned to ggml's query tiles from the last row), taken from a shared counter last rows first.
  void prefill() {
    const int64_t work_per_row = hq_ * skv_ * std::max(d_, dv_);
    const int64_t min_rows =
        std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, work_per_row));
    const int64_t align = sq_ >= 2 * kQueryTile ? kQueryTile : 1;
    for (int64_t bi = 0; bi < b_; ++bi) {
      parallel_chunks(
          sq_, min_rows, align, kPrefillSlicesPerThread, [&](int64_t from_end0, int64_t from_end1) {
            const int64_t i0 = sq_ - from_end1, i1 = sq_ - from_end0;
            Graph g(16);
            const at::Tensor mask = mask_rows(bi, i0, i1 - i0);
            ggml_tensor* r = attention(g, g.view(q32_.select(0, bi).narrow(1, i0, i1 - i0)),
                                       g.view(k_, bi), g.view(v_, bi), mask, sinks32_);
            g.compute(r, out_.select(0, bi).narrow(0, i0, i1 - i0));
          });
    }
  }

  // One query row per batch entry: split by KV heads, by batch entries, or by keys (ggml's pool).
  void decode() {
    const int64_t threads = at::get_num_threads();
    const int64_t parts = std::min(threads, hkv_);
    const bool split_heads =
        b_ == 1 && parts > 1 && !mask_.defined() &&
        hq_ * skv_ * std::max(d_, dv_) >= kSplitHeadsMinWork &&
        (skv_ < kSplitKvMin || (hkv_ % parts == 0 && skv_ <= split_heads_max_keys()));
    if (split_heads) {
      decode_split_heads(parts);
    } else if (b_ >= threads || threads == 1) {
      parallel_chunks(b_, 1, 1, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t bi = b0; bi < b1; ++bi) decode_entry(bi, 1);
      });
    } else {
      for (int64_t bi = 0; bi < b_; ++bi)
        decode_entry(bi, skv_ >= kSplitKvMin ? static_cast<int>(threads) : 1);
      if (skv_ >= kSplitKvMin) zero_fully_masked_rows(out_, mask_, b_, hq_);
    }
  }

  void decode_entry(int64_t bi, int n_threads) {
    Graph g(16);
    const at::Tensor mask = mask_rows(bi, 0, 1);
    ggml_tensor* r = attention(g, g.view(q32_, bi), g.view(k_, bi), g.view(v_, bi), mask, sinks32_);
    g.compute(r, out_, bi, n_threads);
  }

  // A single sequence's KV heads (and the query heads reading them) over the threads, one graph
  // each; out (1, 1, Hq, Dv).
  void decode_split_heads(int64_t parts) {
    const int64_t gqa = hq_ / hkv_;
    const size_t es = sizeof(float);
    at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t h0 = hkv_ * t / parts, h1 = hkv_ * (t + 1) / parts, q0 = h0 * gqa,
                      nq = (h1 - h0) * gqa;
        Graph g(16);
        const at::Tensor sinks = sinks32_.defined() ? sinks32_.narrow(0, q0, nq) : sinks32_;
        ggml_tensor* r = attention(g, heads(g, q32_, 0, q0, q0 + nq), heads(g, k_, 0, h0, h1),
                                   heads(g, v_, 0, h0, h1), mask_, sinks);
        const size_t row = static_cast<size_t>(dv_) * es * static_cast<size_t>(nq);
        g.compute(r, out_.data_ptr<float>() + q0 * dv_,
                  {es, static_cast<size_t>(dv_) * es, row, row});
      }
    });
  }

  const int64_t b_, hq_, sq_, d_, hkv_, skv_, dv_;
  const float scale_, softcap_;
  const at::Tensor q32_, k_, v_, mask_, sinks32_;
  at::Tensor out_;
};

// How many leading keys a single query's boolean mask shows, where it shows exactly those (true for
// keys [0, n), false after, 0 < n): a decode step on a static cache, whose mask hides the positions
// not written yet. 0 for anything else (another dtype or shape, a hole, nothing visible), which the
// general path validates and masks.
int64_t visible_prefix(const std::optional<at::Tensor>& mask, int64_t sq, int64_t skv) {
  if (sq != 1 || !mask.has_value() || !mask->defined()) return 0;
  const at::Tensor& m = *mask;
  if (m.scalar_type() != at::kBool || !m.device().is_cpu() || m.dim() < 2 || m.dim() > 4 ||
      m.size(-1) != skv || m.numel() != skv)
    return 0;
  const bool* p = m.data_ptr<bool>();
  const int64_t step = m.stride(-1);
  int64_t n = 0;
  while (n < skv && p[n * step]) ++n;
  for (int64_t j = n; j < skv; ++j)
    if (p[j * step]) return 0;
  return n;
}

}  // namespace

at::Tensor flash_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& mask, bool causal, double scale,
                      double softcap, const std::optional<at::Tensor>& sinks) {
  check_attention_inputs(q, k, v, scale, softcap);
  at::Tensor sinks32 = float32_sinks(sinks, q.size(1));
  // A mask showing a prefix of the keys: those keys alone, unmasked. The same sums (ggml skips
  // masked keys), without an f16 mask per call, and the KV heads can split over the threads.
  const int64_t seen = visible_prefix(mask, q.size(2), k.size(2));
  const at::Tensor out =
      seen > 0 ? AttentionCall(q, k.narrow(2, 0, seen), v.narrow(2, 0, seen), std::nullopt, causal,
                               scale, softcap, std::move(sinks32))
                     .run()
               : AttentionCall(q, k, v, mask, causal, scale, softcap, std::move(sinks32)).run();
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// ---------------------------------------------------------------------------------------------
// rotary_half: transformers' apply_rotary_pos_emb (rotate_half form) on its own cos / sin tables.
// ggml's rope computes its angles from positions and a frequency base, which transformers' function
// is not given, so this is a plain element-wise loop over the caller's tables: out = x * cos +
// rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]], with the same float32 roundings as
// transformers' torch ops (each product rounded, then the sum). One call does q and k: a decode
// step of a Llama layer is otherwise ~14 small torch ops.

namespace {

at::Tensor rotate(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  at::Tensor out = at::empty({B, H, T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xt = x.stride(2);
  const int64_t cb = c.size(0) == 1 ? 0 : c.stride(0), ct = c.stride(1);
  at::parallel_for(0, B * H * T, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) {
                       const int64_t b = r / (H * T), h = (r / T) % H, t = r % T;
                       const float* xr = xp + b * xb + h * xh + t * xt;
                       const float* cr = cp + b * cb + t * ct;
                       const float* sr = sp + b * cb + t * ct;
                       float* o = op + r * D;
                       for (int64_t i = 0; i < half; ++i) {
                         const float a = xr[i] * cr[i], m = -xr[i + half] * sr[i];
                         o[i] = a + m;
                       }
                       for (int64_t i = half; i < D; ++i) {
                         const float a = xr[i] * cr[i], m = xr[i - half] * sr[i];
                         o[i] = a + m;
                       }
                     }
                   });
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_half(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin) {
  attn_ops::check_rotary_inputs(q, k, cos, sin);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  return {rotate(q, c, s), rotate(k, c, s)};
}

// ---------------------------------------------------------------------------------------------
// kv_write: a decode step's key/value cache append, both tensors in one call. A plain row copy (the
// cache is torch's, in the model's dtype); as a torch narrow + copy_ per tensor it cost ~2 us each,
// a third of a Llama layer's non-kernel time per token.

namespace {

// src (..., n, D) -> rows [row0, row0 + n) of dst (..., capacity, D); both with a dense last dim.
void copy_rows(const at::Tensor& dst, int64_t row0, const at::Tensor& src) {
  const int64_t nd = src.dim(), n = src.size(-2), d = src.size(-1);
  if (n == 0 || d == 0 || src.numel() == 0) return;
  const int64_t es = static_cast<int64_t>(src.element_size()), lead = src.numel() / (n * d);
  char* dp = static_cast<char*>(dst.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < lead; ++i) {
    int64_t rem = i, doff = 0, soff = 0;
    for (int64_t j = nd - 3; j >= 0; --j) {
      const int64_t idx = rem % src.size(j);
      rem /= src.size(j);
      doff += idx * dst.stride(j);
      soff += idx * src.stride(j);
    }
    for (int64_t r = 0; r < n; ++r) {
      std::memmove(dp + (doff + (row0 + r) * dst.stride(-2)) * es,
                   sp + (soff + r * src.stride(-2)) * es, static_cast<size_t>(d * es));
    }
  }
}

}  // namespace

void kv_write(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k,
              const at::Tensor& v, int64_t position) {
  attn_ops::check_kv_write_inputs(keys, values, k, v, position);
  copy_rows(keys, position, k.stride(-1) == 1 ? k : k.contiguous());
  copy_rows(values, position, v.stride(-1) == 1 ? v : v.contiguous());
}

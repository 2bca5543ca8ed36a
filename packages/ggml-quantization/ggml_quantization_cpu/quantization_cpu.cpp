// ggml-quantization on the CPU: every op runs ggml-cpu's own code on views of the torch tensors.
//
// mul_mat / mul_mat_id are one-op ggml graphs, so the numerics are llama.cpp's CPU backend's:
// activation rows are quantized to the weight type's vec_dot_type (once per call, by ggml-cpu's
// own converter), then ggml's SIMD dot products (or llamafile's sgemm for larger batches) run. The
// weight's rows are split over torch's threads, one single-threaded graph per slice writing its
// columns of the output, as ggml's own threadpool would split them. dequantize / get_rows /
// quantize call ggml's per-type row converters directly.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "ggml_torch.h"
#include "repack_cpu.h"
#include "torch_binding.h"

using namespace ggml_kernels;
using namespace ggml_quantization::checks;
using ggml_quantization::check_storage;
using ggml_quantization::kRepackRows;
using ggml_quantization::Storage;

namespace {

// Rows a dequantizing thread unpacks at a time from a repacked weight (whole groups; ~64 KiB of
// values, the unpacked bytes stay in cache for to_float).
int64_t rows_per_pass(int64_t cols) {
  return std::max<int64_t>(1, (1 << 14) / cols / kRepackRows) * kRepackRows;
}

// out (n, cols) float32: packed rows `row_ids[i]` (or i when row_ids is null) of `blocks`,
// dequantized by ggml's to_float. A repacked weight's rows are unpacked first, without an unpacked
// copy of the whole weight: a few groups at a time for all rows, a row's own group for row_ids.
void dequantize_rows(const at::Tensor& blocks, ggml_type type, bool repacked, int64_t cols,
                     const int64_t* row_ids, int64_t n, float* out) {
  const auto to_float = ggml().ggml_get_type_traits(type)->to_float;
  TORCH_CHECK(to_float != nullptr, "ggml has no dequantizer for ", type_name(type));
  const auto* base = static_cast<const uint8_t*>(blocks.data_ptr());
  const int64_t rb = blocks.size(-1), pass = rows_per_pass(cols);
  at::parallel_for(0, (n + pass - 1) / pass, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> unpacked(repacked ? pass * rb : 0);
    for (int64_t i0 = p0 * pass; i0 < std::min(n, p1 * pass); i0 += pass) {
      const int64_t rows = std::min(pass, n - i0);
      if (repacked && !row_ids)
        ggml_quantization::unrepack_groups(type, base, rb, rb, i0 / kRepackRows,
                                           (i0 + rows) / kRepackRows, unpacked.data());
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t r = row_ids ? row_ids[i0 + i] : i0 + i;
        const uint8_t* row = base + r * rb;
        if (repacked && row_ids) {
          const int64_t g = r / kRepackRows;
          ggml_quantization::unrepack_groups(type, base, rb, rb, g, g + 1, unpacked.data());
          row = unpacked.data() + (r % kRepackRows) * rb;
        } else if (repacked) {
          row = unpacked.data() + i * rb;
        }
        to_float(row, out + (i0 + i) * cols, cols);
      }
    }
  });
}

// Packed rows of a float type reinterpreted as a (rows, cols) tensor of that dtype (no copy).
at::Tensor float_view(const at::Tensor& blocks, ggml_type type, int64_t cols) {
  const at::ScalarType dt = type == GGML_TYPE_F32   ? at::kFloat
                            : type == GGML_TYPE_F16 ? at::kHalf
                                                    : at::kBFloat16;
  return blocks.view(dt).view({blocks.size(0), cols});
}

// Weight rows a chunk takes at least: ~256 KiB of packed weights for one activation row, since
// every chunk is a ggml graph of its own and small matrices are done before another thread would
// wake up: a 1024x1024 Q4_0 weight (576 KiB) makes two chunks, a 9216x2560 Q4_K one eight (threads
// take them as they go). With m activation rows a chunk has m times the work: the bytes shrink with
// m (to a sixteenth), so that a short prompt's small matrices are split too (SmolLM2's 576x576
// Q4_1, 207 KiB, ran on one thread at 16 rows).
int64_t min_rows_per_task(int64_t row_bytes, int64_t m = 1) {
  const int64_t bytes = (int64_t{1} << 18) / std::clamp<int64_t>(m, 1, 16);
  return std::max<int64_t>(16, bytes / row_bytes);
}

// The activations as ggml-cpu's dot products read them: each row of x (M, K) float32 converted to
// the weight type's vec_dot_type (Q8_0, Q8_1, Q8_K, F16, BF16) by ggml-cpu's own from_float, the
// step ggml_mul_mat would otherwise repeat inside every slice's graph. Returns uint8
// (M, row_size), or an undefined tensor when the dot product reads float32 as it is.
at::Tensor activations_for(const at::Tensor& xf, ggml_type type) {
  const auto& G = ggml();
  const ggml_type vdt = G.ggml_get_type_traits_cpu(type)->vec_dot_type;
  if (vdt == GGML_TYPE_F32) return {};
  const auto from_float = G.ggml_get_type_traits_cpu(vdt)->from_float;
  TORCH_CHECK(from_float != nullptr, "ggml-kernels: no activation converter for ", type_name(vdt));
  const int64_t k = xf.size(-1), m = xf.numel() / k;  // xf: contiguous float32 rows (..., K)
  const int64_t rs = static_cast<int64_t>(G.ggml_row_size(vdt, k));
  auto q = new_tensor_like(xf, {m, rs}, at::kByte);
  const float* src = xf.data_ptr<float>();
  uint8_t* dst = q.data_ptr<uint8_t>();
  at::parallel_for(0, m, std::max<int64_t>(1, (int64_t{1} << 15) / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) from_float(src + r * k, dst + r * rs, k);
  });
  return q;
}

bool is_float_type(ggml_type t) {
  return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

// A quantized type whose dot products read the activations quantized (activations_for).
bool reads_quantized_x(ggml_type t) {
  return !is_float_type(t) && ggml().ggml_get_type_traits_cpu(t)->vec_dot_type != GGML_TYPE_F32;
}

// How a product of a plain (not repacked) weight runs, by activation rows m. The same rule on every
// x86 CPU but for the prefetch: each path runs ggml-cpu's own dot products (ggml's CPU level picks
// the instructions; no CPU feature picks a path), and each thread reads its weight rows in order,
// as ggml's do.
//
//   m     path                                  split over threads              prefetch
//   1-8   ggml's vec_dot per weight row and     one run of about equal bytes    2 KiB ahead on
//         activation row, no graph              per thread, a group's weights   Intel CPUs,
//         (direct_dot_rows; from 5 rows only    end to end; >= 64 KiB each; a   none elsewhere
//         rows of >= 1 KiB, at 8 rows no IQ     thread done early takes the     (prefetch_ahead)
//         type: see takes_dot_rows); from 2     others' next 64 KiB (DotRuns)   sgemm: the next
//         rows sgemm's types on llamafile's     (sgemm: whole 4-row tiles)      8 KiB piece on
//         sgemm (sgemm_rows_range)                                              Intel CPUs
//   2-128 ggml's mul_mat, one single-thread     equal rows per thread; >= 64    none (as ggml)
//   (the  graph per thread (share_products)     KiB of weight x m per thread
//   rest)
//   129-  ggml's mul_mat, one single-thread     slices of >= 256 KiB / m bytes  none (as ggml)
//         graph per slice (mul_mat_slices)      (min_rows_per_task), taken from
//                                               a shared counter
//
// For one row ggml's mul_mat computes exactly these dot products for every type (x86 type traits
// have nrows == 1, and llamafile's sgemm declines a single column), so the results are
// bit-identical, minus a graph's building and planning, a good part of a decode step's small
// products. From 2 rows ggml's mul_mat hands Q4_0, Q5_0, Q8_0 and IQ4_NL weights to llamafile's
// sgemm (x86 with AVX), which direct_dot_rows then calls itself (sgemm_rows_range: the same bits;
// sgemm ran 1.1-2x faster than the dot products at 2-8 rows here), and from 8 rows the K-quants
// and most IQ types to its tiled K-quant kernel (other
// sums, so other bits); below that it computes every type with the same vec_dot per (weight row,
// activation row), in blocks of 16 weight rows. direct_dot_rows does the same in blocks of a
// 64 KiB piece's rows: each piece's rows are read from DRAM once and then from the cache for the
// other activation rows, and up to 7 rows the results are bit-identical to ggml's op. At 8 rows
// they are those of 1-7 rows (each output the vec_dot of its row alone), where ggml's op gives the
// tiled kernel's sums for the K-quants: within the tests' tolerances of either. With ggml's 16-row
// blocks (23 KiB of a 2560-column Q4_K weight) walked through each thread's own run, as a graph per
// thread walks them, a Q4_K 9216x2560 product at 2 / 4 rows ran at 0.81 / 0.85x ggml's own op on an
// Intel Xeon (2 threads; ggml's op deals its 16-row chunks to the threads in turn), with 64 KiB
// pieces 1.07-1.13x. Intel Xeon (AVX-512 + AMX, 2 vCPUs), one process, alternating, 7-11 rounds
// (2026-12-06):
// - against ggml's op, Q4_1 / Q4_K / Q6_K on 9216x2560 and 2560x9216, 2 and 4 rows, 1 and 2
//   threads: the graph per thread (share_products) 0.82-1.07x, these dot products 0.98-1.13x;
// - against share_products on 576-3584-column Q4_1 / Q4_K / Q5_K / Q6_K weights, 2 and 4 rows:
//   0.99-1.54x (1 and 2 threads). At 8 rows (here the vec_dot graph) they lost 0.77-0.89x on Q4_K
//   and Q5_K rows of 576-704 bytes (1024 columns), whose 16-row blocks stay in the L1 in ggml's
//   loop: hence no more than 4 rows on rows under 1 KiB.
// At 8 rows on rows of >= 1 KiB, against ggml's op (2026-12-07, 2 threads, 9 rounds): Q4_K / Q6_K
// on 1024x3584, 2560x9216 and 9216x2560 1.19-1.45x (the tiled kernel's 16-row tiles here read
// slower than 64 KiB pieces), Q4_1 (ggml's vec_dot graph) 1.00-1.09x; in one-off runs on
// 9216x2560 / 2560x9216 Q3_K 1.13x, Q2_K 0.99x / 1.70-1.87x, Q5_K 1.00x / 0.99-1.10x,
// Q5_1 1.06-1.07x. Not the IQ types: their dot products decode each block's grid again for every
// activation row, which the tiled kernel does once for all 8 (IQ3_S 9216x2560 10.2 against
// ggml's 3.8 ms, IQ4_XS 4.2 against 3.6; IQ2_S 3.98 against 3.88). At 16 rows the tiled kernel wins
// (Q4_K / Q6_K 1024x3584 0.87 / 0.90x these dot products), and at 16 and 64 rows ggml's tiled and
// 16x16 blocked kernels 1.2-2.6x. Not measured on the EPYC.
//
// One run per thread, not ggml-cpu's 64-row chunks from a shared counter: a decode step streams
// every weight from DRAM once, and a thread's contiguous run is one long stream for the hardware
// prefetchers where chunks break it every 64 rows (23 KiB of a 576-column Q4_1 weight). AMD EPYC
// (zen4, 2 threads), one process, alternating, 9-11 rounds, weights cycled through 96-128 MB
// (2026-12-05): SmolLM2's Q4_1 576x576 / 1536x576 / 576x1536 1.19 / 1.30-1.36 / 1.10-1.12x, its
// q/k/v and gate/up groups 1.09-1.15 / 1.22-1.34x; 9216x2560 and 2560x9216 Q4_K, Q6_K, Q8_0, Q4_1
// 0.93-1.33x (median 1.00x); whole decode steps (kDirectDotRows's path in every projection) SmolLM2
// 1.15x and Qwen3.5-0.8B-shaped Q4_K_M 1.26x faster (1.12x / 1.17x built apart, fresh processes in
// turn, 4 rounds).
//
// Software prefetch (prefetch_ahead): on Intel CPUs each weight row's bytes 2 KiB ahead are asked
// for with prefetcht0 (into every cache level) as the row is read. A decode step reads every
// weight once from DRAM, and an Intel core alone keeps too few misses in flight to stream it: the
// prefetch raises a thread's stream from ~6 GB/s. Intel Xeon (AVX-512 VNNI/BF16/AMX, 2 vCPUs,
// KVM), one build switched in one process (2026-12-06):
// - a decode step's products in the step's order, against ggml's own op per weight
//   (tools/bench/step_products.py, 11-15 alternating rounds): Qwen3.5-0.8B-shaped Q4_K_M 0.95-0.98x
//   -> 1.29-1.36x (30.0 -> 21.1 ms, 2 threads; 2, 4 and 8 KiB ahead alike), SmolLM2-135M Q4_1
//   1.04x -> 1.30x on 2 threads (6.8 -> 4.6 ms), 0.96x -> 1.21x on one;
// - one-row products of Q4_0 / Q4_1 / Q4_K / Q6_K / Q8_0 on 9216x2560 and 2560x9216, 2 threads,
//   against ggml's op (tools/bench/versus_ggml.py, 9 rounds): 0.89-1.01x -> 1.07-1.44x; at 4 rows
//   Q4_1 / Q4_K / Q6_K 1.00-1.17x -> 1.06-1.33x.
// The non-temporal prefetchnta instead, ~4 KB ahead, had made a 9216x2560 Q4_K product there
// 2.25 ms on one thread against ggml's 0.76 ms (a non-temporal prefetch fills the L1 alone, and the
// L2's streaming prefetcher does not see the stream). Not on other CPUs: on an AMD EPYC (zen4, 2
// cores) prefetchnta and prefetcht0 ~4 KB ahead alike cost up to 1.5x on 9216-column rows
// (2560x9216 Q6_K 2.58 against 1.74 ms, one thread, 128 MB cycled) and won 1.05-1.17x only on
// SmolLM2's short rows (2026-12-05; docs/benchmarks.md, "One-row products"); 2 KiB ahead is not
// measured there.
constexpr int64_t kDirectDotRows = 8;
// ... of which rows up to kShortRowsDotRows for weights whose rows hold fewer than kLongRowBytes,
// and up to kGridDotRows for the IQ types: one below ggml's tiled kernel's 8 rows.
constexpr int64_t kShortRowsDotRows = 4;
constexpr int64_t kLongRowBytes = 1024;
constexpr int64_t kGridDotRows = 7;

// The IQ types whose blocks index a grid of values: ggml quantizes them by a grid search.
bool is_grid_search_type(ggml_type t) {
  switch (t) {
    case GGML_TYPE_IQ1_S:
    case GGML_TYPE_IQ1_M:
    case GGML_TYPE_IQ2_XXS:
    case GGML_TYPE_IQ2_XS:
    case GGML_TYPE_IQ2_S:
    case GGML_TYPE_IQ3_XXS:
    case GGML_TYPE_IQ3_S: return true;
    default: return false;
  }
}

// The IQ types ggml's vec_dot runs (IQ4_NL goes to llamafile's sgemm): their blocks index grids
// or a non-linear table, decoded again for every activation row (see kDirectDotRows).
bool decodes_grids(ggml_type type) { return is_grid_search_type(type) || type == GGML_TYPE_IQ4_XS; }

// Whether ggml-cpu's mul_mat of a `type` weight over m > 1 activation rows hands it to llamafile's
// sgemm (x86 with AVX, Arm with dot products) rather than to its vec_dot: the float types and
// Q4_0, Q5_0, Q8_0, IQ4_NL.
bool sgemm_takes(ggml_type type) {
  return is_float_type(type) || type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q5_0 ||
         type == GGML_TYPE_Q8_0 || type == GGML_TYPE_IQ4_NL;
}

// Whether a product of a plain `type` weight over m activation rows runs as llamafile's sgemm on
// pieces of rows (sgemm_rows_range) inside direct_dot_rows: the quantized types sgemm takes, from
// 2 rows (see kDirectDotRows).
bool takes_sgemm_pieces(ggml_type type, int64_t m) {
  return m >= 2 && sgemm_takes(type) && !is_float_type(type);
}

// Whether a plain weight's product over m activation rows (rows of row_bytes) runs as
// direct_dot_rows (see kDirectDotRows): a quantized type whose vec_dot takes one row at a time
// (fewer rows on short rows and for the IQ types), or sgemm's quantized types on pieces of rows.
bool takes_dot_rows(ggml_type type, int64_t m, int64_t row_bytes) {
  const auto* traits = ggml().ggml_get_type_traits_cpu(type);
  const int64_t most = takes_sgemm_pieces(type, m) ? kDirectDotRows
                       : row_bytes < kLongRowBytes ? kShortRowsDotRows
                       : decodes_grids(type)       ? kGridDotRows
                                                   : kDirectDotRows;
  return m >= 1 && m <= most && traits->vec_dot_type != GGML_TYPE_F32 && traits->nrows == 1 &&
         (m == 1 || !sgemm_takes(type) || takes_sgemm_pieces(type, m));
}

// One packed weight of a product over m <= kDirectDotRows activation rows: its rows, its dot
// product, the m activation rows quantized to that dot product's type (x_stride bytes apart), and
// where its outputs go ((m, rows), out_stride floats apart).
struct DotRows {
  const uint8_t* w;
  int64_t stride, row_bytes, rows;
  ggml_vec_dot_t vec_dot;
  const uint8_t* xq;
  int64_t x_stride, m;
  float* out;
  int64_t out_stride;
  ggml_type type = GGML_TYPE_COUNT, x_type = GGML_TYPE_COUNT;  // the weight's and xq's, for sgemm
  bool sgemm = false;  // llamafile's sgemm on pieces of rows (sgemm_rows_range), not vec_dot
};

// Weight bytes a thread takes at least: below ~64 KiB the second thread's start and join cost more
// than the rows it would take (a 192x576 Q4_1 projection, 69 KiB, runs on one thread).
constexpr int64_t kMinBytesPerThread = int64_t{1} << 16;

// Threads for products over `total` bytes of weights: at least kMinBytesPerThread each.
int64_t threads_for(int64_t total) {
  return std::clamp<int64_t>(total / kMinBytesPerThread, 1, std::max(1, at::get_num_threads()));
}

// Thread t's share of weights laid end to end (`total` bytes), cut into runs of about equal bytes:
// of the weight of `rows` rows (row_bytes each) starting at byte `base`, the rows [r0, r1) whose
// first byte lies in the thread's run, both ends rounded up to a multiple of `align`.
std::pair<int64_t, int64_t> share_rows(int64_t total, int64_t t, int64_t threads, int64_t base,
                                       int64_t rows, int64_t row_bytes, int64_t align = 1) {
  auto first_row_at = [&](int64_t byte) {
    const int64_t r = std::clamp<int64_t>((byte - base + row_bytes - 1) / row_bytes, 0, rows);
    return std::min(rows, (r + align - 1) / align * align);
  };
  return {first_row_at(total * t / threads), first_row_at(total * (t + 1) / threads)};
}

// Runs share(t) for every t in [0, threads) on torch's threads (inline for one, or when nested).
// The workers get no copy of torch's thread-local state: shares run no torch ops.
template <typename F>
void run_shares(int64_t threads, const F& share) {
  if (threads == 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < threads; ++t) share(t);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) share(t);
  });
}

int64_t total_bytes(const std::vector<DotRows>& dots) {
  int64_t total = 0;
  for (const auto& d : dots) total += d.rows * d.row_bytes;
  return total;
}

// Bytes ahead of the weight row being read that direct_dot_rows asks the caches for: 2 KiB on
// Intel CPUs, 0 (none) elsewhere; see kDirectDotRows for the measurements.
int64_t prefetch_ahead() { return backend::kIntelCpu ? int64_t{2048} : int64_t{0}; }

// prefetcht0 for each cache line of [p, p + bytes) that lies before `end`.
void prefetch_range(const uint8_t* p, int64_t bytes, const uint8_t* end) {
  for (const uint8_t* line = p; line < p + bytes && line < end; line += 64)
    __builtin_prefetch(line, 0, 3);
}

// The rows sgemm_rows_range gives one sgemm call at a time on Intel CPUs: ~kSgemmPieceBytes of
// weight, whole 4-row tiles, the next piece asked for (prefetcht0) before each call; rows of
// kSgemmPrefetchRowBytes or more get one call per range, unprefetched. 0: one call per range.
// sgemm reads a tile's 4 rows side by side, 4 streams of one row each: on short rows the Intel
// Xeon's prefetchers hardly start on them (Q4_0 9216x2560, 1440-byte rows, 2 rows on one thread:
// 3.3 ms in ggml's op against 2.2 ms for the same bytes in 2560x9216's 5184-byte rows). Intel Xeon
// (AVX-512 + AMX, 2 vCPUs), against ggml's op, 2026-12-07:
// - one thread, Q4_0 9216x2560 at 2 / 4 rows: pieces of 4-16 rows with the next one prefetched
//   2.6-2.9 / 3.7 ms against 3.3 / 4.1; two pieces ahead or 32-row pieces less; prefetcht1 alike;
// - versus_ggml, 7 rounds, 2 / 1 threads: 9216x2560 Q4_0 at 2 / 4 rows 1.20-1.21x / 1.11-1.13x,
//   Q8_0 (2720-byte rows) at 2 / 4 / 8 rows 0.96-1.08x / 1.02-1.07x / 1.12-1.14x, 3584x1024 and
//   1024x1024 at 8 rows 0.97-1.30x (from 0.93x for Q4_0 1024x1024 on the graph); Q5_0 / IQ4_NL
//   (one side per process, 2 threads) 9216x2560 at 2 rows 1.13-1.27x, at 8 0.94-1.04x;
// - rows of 3808 bytes (Q8_0 1024x3584) 0.92x prefetched, 0.98-1.01x not; 5184-byte rows (Q4_0
//   2560x9216) 2.3-2.4 ms prefetched at any distance or level against 2.1 unprefetched: the
//   prefetchers stream those rows themselves, and these stay at ggml's op's speed (0.94-0.98x in
//   versus_ggml, 1.00x in a process of one side alone: the same kernel on the same tiles).
// Not measured on the EPYC: there one call per range, as ggml.
constexpr int64_t kSgemmTileRows = 4;
constexpr int64_t kSgemmPieceBytes = 8192;
constexpr int64_t kSgemmPrefetchRowBytes = 3072;
int64_t sgemm_piece_rows(int64_t row_bytes) {
  if (!backend::kIntelCpu || row_bytes >= kSgemmPrefetchRowBytes) return 0;
  return std::max<int64_t>(1, kSgemmPieceBytes / row_bytes / kSgemmTileRows) * kSgemmTileRows;
}

// The weight's last byte + 1, where the prefetches stop: they run on past a range's end into the
// rows after it, the thread's next chunk (DotRuns) but at the end of its run. Stopped at the
// range's end instead, each 64 KiB chunk began unprefetched. Intel Xeon (AVX-512 + AMX, 2 vCPUs),
// the same build switched in one process, 11 rounds (2026-12-07), faster by, 1 / 2 threads: Q8_0
// 9216x2560 at 2 rows 1.06 / 1.08x; Q4_0 9216x2560 at 1 row 1.04 / 0.98x, at 2 rows 1.02 / 1.01x;
// Q4_K at one row 9216x2560 1.02 / 1.01x, 3584x1024 1.00 / 0.98x; Q8_0 2560x9216 at 2 rows
// (sgemm's long rows, not prefetched) 1.00 / 1.00x.
const uint8_t* weight_end(const DotRows& d) { return d.w + (d.rows - 1) * d.stride + d.row_bytes; }

// out[j, r] = W[r] . x[j] for the rows [r0, r1) of one weight and every activation row j, with
// ggml-cpu's vec_dot, in row order for each j: the rows are read from memory for the first and
// from the cache for the others.
void vec_dot_rows_range(const DotRows& d, int64_t k, int64_t r0, int64_t r1) {
  const int64_t ahead = prefetch_ahead();
  const uint8_t* end = weight_end(d);
  for (int64_t j = 0; j < d.m; ++j) {
    const uint8_t* x = d.xq + j * d.x_stride;
    float* out = d.out + j * d.out_stride;
    for (int64_t i = r0; i < r1; ++i) {
      const uint8_t* row = d.w + i * d.stride;
      if (j == 0 && ahead > 0) prefetch_range(row + ahead, d.row_bytes, end);
      d.vec_dot(static_cast<int>(k), out + i, 0, row, 0, x, 0, 1);
    }
  }
}

// The same with llamafile's sgemm (d.sgemm), which ggml's mul_mat runs for these types from 2 rows:
// in pieces of sgemm_piece_rows, so that each piece's bytes can be asked for ahead. Where this
// CPU level's sgemm declines the type (no AVX), vec_dot as ggml's mul_mat then does.
void sgemm_rows_range(const DotRows& d, int64_t k, int64_t r0, int64_t r1) {
  const auto& G = ggml();
  const int64_t a_size = G.ggml_type_size(d.type), b_size = G.ggml_type_size(d.x_type);
  const int64_t blocks = k / G.ggml_blck_size(d.type), piece = sgemm_piece_rows(d.row_bytes);
  const uint8_t* end = weight_end(d);
  for (int64_t i = r0; i < r1; i += piece > 0 ? piece : r1 - r0) {
    const int64_t rows = piece > 0 ? std::min(piece, r1 - i) : r1 - i;
    if (piece > 0) prefetch_range(d.w + (i + piece) * d.stride, piece * d.stride, end);
    if (!G.gk_llamafile_sgemm(rows, d.m, blocks, d.w + i * d.stride, d.stride / a_size, d.xq,
                              d.x_stride / b_size, d.out + i, d.out_stride, d.type, d.x_type,
                              GGML_TYPE_F32))
      return vec_dot_rows_range(d, k, i, r1);
  }
}

// Rows [r0, r1) of d's products, on its kernel.
void dot_rows_range(const DotRows& d, int64_t k, int64_t r0, int64_t r1) {
  if (r0 >= r1) return;
  if (d.sgemm) return sgemm_rows_range(d, k, r0, r1);
  vec_dot_rows_range(d, k, r0, r1);
}

// Piece t of `pieces` of the products `dots` (`total` bytes of weights): the weights laid
// end to end and cut into pieces of about equal bytes (share_rows), each read in row order.
void dot_share(const std::vector<DotRows>& dots, int64_t k, int64_t total, int64_t t,
               int64_t pieces) {
  int64_t base = 0;
  for (const auto& d : dots) {
    const int64_t align = d.sgemm ? kSgemmTileRows : 1;  // ggml's op's tiles, so its bits
    const auto [r0, r1] = share_rows(total, t, pieces, base, d.rows, d.row_bytes, align);
    base += d.rows * d.row_bytes;
    dot_rows_range(d, k, r0, r1);
  }
}

// Bytes of weight rows a thread of direct_dot_rows takes at a time from a run (DotRuns).
constexpr int64_t kDotChunkBytes = int64_t{1} << 16;

// The products `dots` (`total` bytes of weights) cut for `threads` threads: the weights
// laid end to end in one run of about equal bytes per thread (see kDirectDotRows), each run in
// chunks of about kDotChunkBytes taken from a counter of its own. A thread works through its own
// run in order, then takes the next chunks of the others' runs, so a thread that starts late (a
// worker woken late, as on the Intel Xeon's virtual CPUs) leaves its rows to the others instead of
// holding the product back. Intel Xeon (2 vCPUs, AVX-512 + AMX, KVM), 2 threads, one row,
// alternating against ggml's op (2026-12-06): Q4_K 9216x2560 / 2560x9216 / 3584x1024 /
// 1024x3584 0.84 / 0.81 / 0.80 / 0.85x with one fixed run per thread, 0.90 / 0.91 / 1.00 / 0.95x
// with the others' chunks taken; Q4_0 0.85-0.93x -> 0.96-1.05x; Q6_K and Q8_0 unchanged
// (0.93-1.07x). Where both threads start together it reads as one run each. On one thread there is
// nobody to take chunks: the run is one range, so sgemm's types make one call instead of one per
// chunk (2560x9216 Q4_0 / Q8_0 at 2-8 rows: 202 / 382 calls). With mul_mat's torch-op-free path
// (new_tensor_like, float32_contiguous) 1.003-1.015x faster there on one thread: the same build
// switched in one process, 11 rounds, Intel Xeon (2026-12-07).
class DotRuns {
 public:
  DotRuns(const std::vector<DotRows>& dots, int64_t k, int64_t total, int64_t threads)
      : dots_(dots),
        k_(k),
        total_(total),
        threads_(threads),
        chunks_(threads == 1 ? 1 : std::max<int64_t>(1, total / threads / kDotChunkBytes)),
        next_(std::make_unique<std::atomic<int64_t>[]>(threads)) {}

  // Thread t's work: its own run, then what is left of the others'.
  void work(int64_t t) const {
    for (int64_t j = 0; j < threads_; ++j) {
      const int64_t run = (t + j) % threads_;
      for (int64_t c; (c = next_[run].fetch_add(1, std::memory_order_relaxed)) < chunks_;)
        dot_share(dots_, k_, total_, run * chunks_ + c, threads_ * chunks_);
    }
  }

 private:
  const std::vector<DotRows>& dots_;
  const int64_t k_, total_, threads_, chunks_;
  std::unique_ptr<std::atomic<int64_t>[]> next_;
};

// out_w = x @ W.T for a few activation rows and every weight W of `dots` (each with k columns, all
// over the same m rows), with ggml-cpu's vec_dot, one run of rows per thread (DotRuns). Several
// weights that read the same activations (q/k/v, gate/up) so share one parallel region, and small
// ones are not left to a single thread.
void direct_dot_rows(const std::vector<DotRows>& dots, int64_t k, int64_t m) {
  const int64_t total = total_bytes(dots), threads = threads_for(total * m);
  const DotRuns runs(dots, k, total, threads);
  run_shares(threads, [&](int64_t t) { runs.work(t); });
}

// xq: (m, row_size) activations quantized; out: (m, N) float32 rows out_stride floats apart.
DotRows dot_rows(const at::Tensor& blocks, ggml_type type, const at::Tensor& xq, float* out,
                 int64_t out_stride) {
  const auto* traits = ggml().ggml_get_type_traits_cpu(type);
  return {static_cast<const uint8_t*>(blocks.data_ptr()),
          blocks.stride(0),
          blocks.size(1),
          blocks.size(0),
          traits->vec_dot,
          static_cast<const uint8_t*>(xq.data_ptr()),
          xq.stride(0),
          xq.size(0),
          out,
          out_stride,
          type,
          traits->vec_dot_type,
          takes_sgemm_pieces(type, xq.size(0))};
}

// The same into an (m, N) float32 tensor with a dense last dim.
DotRows dot_rows(const at::Tensor& blocks, ggml_type type, const at::Tensor& xq,
                 const at::Tensor& out2) {
  return dot_rows(blocks, type, xq, out2.data_ptr<float>(), out2.stride(0));
}

// (token, expert) pairs up to which mul_mat_id calls the dot products itself, as mul_mat does for
// one row: a decode step (its top-k experts for gate/up, then one expert per row for down) and a
// short prompt's few tokens, whose experts mostly get one token each. ggml's mul_mat_id computes
// the same per-row dot products, so the results are bit-identical. Qwen3.5 MoE (top-8), 2 threads:
// first token after 4 tokens (32 pairs) 70-78 -> 62-64 ms with 64 here instead of 16; 16 tokens
// (128 pairs) the same either way.
constexpr int64_t kDirectDotPairs = 64;

// out (t, n_ids, n)[i, j] = W[ids[i, j]] @ x[i], ggml-cpu's vec_dot on the quantized rows xq (t,
// *). The (pair, weight row) items are split into one contiguous run per thread, each row's bytes
// prefetch_ahead() ahead asked for within its expert as direct_dot_rows does (on Intel CPUs; on
// the AMD EPYC a prefetchnta ~4 KB ahead cost 1.1-1.3x on 64-expert 512x2048 Q4_K, Q6_K and Q8_0
// experts at 1 and 4 tokens, one thread).
void direct_dot_mul_mat_id(const at::Tensor& blocks, ggml_type type, int64_t k,
                           const at::Tensor& xq, const at::Tensor& ids32, at::Tensor& out) {
  const auto vec_dot = ggml().ggml_get_type_traits_cpu(type)->vec_dot;
  const auto* w = static_cast<const uint8_t*>(blocks.data_ptr());
  const auto* xp = static_cast<const uint8_t*>(xq.data_ptr());
  const int32_t* id = ids32.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t n_ids = ids32.size(1), n = out.size(2);
  const int64_t expert_stride = blocks.stride(0), row_stride = blocks.stride(1),
                x_stride = xq.stride(0);
  const int64_t row_bytes = blocks.size(2);
  const int64_t min_items = std::max<int64_t>(16, (int64_t{1} << 16) / row_bytes);
  auto row = [&](int64_t item) {  // weight row of item (pair * n + r)
    return w + id[item / n] * expert_stride + (item % n) * row_stride;
  };
  const int64_t ahead = prefetch_ahead();
  parallel_chunks(out.size(0) * n_ids * n, min_items, 16, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t pair = i / n;
      const uint8_t* r = row(i);
      if (ahead > 0) prefetch_range(r + ahead, row_bytes, row(pair * n + n - 1) + row_bytes);
      vec_dot(static_cast<int>(k), o + i, 0, r, 0, xp + (pair / n_ids) * x_stride, 0, 1);
    }
  });
}

// (token, expert) pairs per expert, on average, up to which mul_mat_id groups the pairs by expert
// and calls the dot products itself (grouped_dot_mul_mat_id, above kDirectDotPairs): a prompt of up
// to 32 tokens on a top-8 layer of 64 experts. ggml's mul_mat_id walks each expert's rows in 16-row
// blocks for every token (vec_dot, the tiled kernel for an expert's 8 or more), as its mul_mat
// does. Qwen3.5-MoE-shaped layer (64 experts, top 8, gate/up Q4_K 512x1024, down Q6_K 1024x256),
// Intel Xeon, 2 threads, against ggml's op (`versus_ggml --only 'MulMatId'`, 9 rounds, 2026-12-07),
// ggml's graph on slices -> grouped: gate/up at 16 / 24 / 32 tokens 1.08 / 0.91 / 0.96x -> 1.26 /
// 1.22 / 1.20x, down 1.24 / 1.20 / 1.15x -> 1.41 / 1.46 / 1.27x; at 48 tokens (6 per expert)
// gate/up 0.94 -> 1.03x but down 1.15 -> 1.11x, at 64 (8) 1.02 -> 0.88x and 1.13 -> 1.10x. Not the
// IQ types (not measured: their dot products decode each block again for every row).
constexpr int64_t kGroupedPairsPerExpert = 4;

// out (t, n_ids, n)[i, j] = W[ids[i, j]] @ x[i] with the pairs grouped by expert: each expert's
// tokens' activation rows gathered (in pair order) and its weight read once for all of them, as
// direct_dot_rows reads a weight for a few rows (64 KiB pieces, each dotted with every row of its
// expert while in cache; one run per thread, the others' pieces taken when done), then the outputs
// put back in pair order. The same vec_dot per output as the per-pair path.
void grouped_dot_mul_mat_id(const at::Tensor& blocks, ggml_type type, int64_t k,
                            const at::Tensor& xq, const at::Tensor& ids32, at::Tensor& out) {
  const int64_t experts = blocks.size(0), n = out.size(2), n_ids = ids32.size(1);
  const int64_t pairs = ids32.numel(), x_bytes = xq.size(1);
  const int32_t* id = ids32.data_ptr<int32_t>();
  std::vector<int64_t> start(experts + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++start[id[p] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[next[id[p]]++] = p;
  auto xg = at::empty({pairs, x_bytes}, xq.options());
  auto og = at::empty({pairs, n}, out.options());
  const auto* xp = static_cast<const uint8_t*>(xq.data_ptr());
  auto* xgp = static_cast<uint8_t*>(xg.data_ptr());
  for (int64_t i = 0; i < pairs; ++i)
    std::memcpy(xgp + i * x_bytes, xp + (order[i] / n_ids) * xq.stride(0), x_bytes);
  const auto vec_dot = ggml().ggml_get_type_traits_cpu(type)->vec_dot;
  const auto* w = static_cast<const uint8_t*>(blocks.data_ptr());
  float* ogp = og.data_ptr<float>();
  std::vector<DotRows> dots;
  int64_t work = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = start[e + 1] - start[e];
    if (m == 0) continue;
    dots.push_back({w + e * blocks.stride(0), blocks.stride(1), blocks.size(2), n, vec_dot,
                    xgp + start[e] * x_bytes, x_bytes, m, ogp + start[e] * n, n});
    work += n * blocks.size(2) * m;
  }
  const int64_t total = total_bytes(dots), threads = threads_for(work);
  const DotRuns runs(dots, k, total, threads);
  run_shares(threads, [&](int64_t t) { runs.work(t); });
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < pairs; ++i) std::memcpy(o + order[i] * n, ogp + i * n, n * sizeof(float));
}

// A repacked weight holds whole groups of kRepackRows rows.
void check_repacked_rows(const at::Tensor& blocks, const Storage& st, const char* name) {
  TORCH_CHECK_VALUE(!st.repacked || blocks.size(-2) % kRepackRows == 0, name, " is a repacked ",
                    type_name(st.type), " weight of ", blocks.size(-2),
                    " rows; repacked weights hold a multiple of ", kRepackRows);
}

// Checks one packed weight (N, row_bytes) of a product with x (..., K); returns its storage and K.
std::pair<Storage, int64_t> check_weight(const at::Tensor& blocks, int64_t type_id,
                                         int64_t out_features, const at::Tensor& x,
                                         const char* name) {
  const Storage st = check_storage(type_id);
  const int64_t k = check_weight_operand(blocks, st.type, out_features, x, name);
  check_repacked_rows(blocks, st, name);
  return {st, k};
}

// quantize's importance matrix: float32 (cols,), finite, >= 0, contiguous; undefined when not given
// (ValueError if the type needs one).
at::Tensor checked_imatrix(const std::optional<at::Tensor>& imatrix, int64_t cols, ggml_type type) {
  if (!imatrix.has_value() || !imatrix->defined()) {
    TORCH_CHECK_VALUE(
        !ggml().ggml_quantize_requires_imatrix(type), type_name(type),
        " quantization needs an importance matrix: pass imatrix (float32, one value per "
        "column; torch.ones(cols) weighs all columns equally)");
    return {};
  }
  check_device(*imatrix, "imatrix");
  check_dtype(*imatrix, {at::kFloat}, "imatrix");
  TORCH_CHECK_VALUE(imatrix->dim() == 1 && imatrix->size(0) == cols, "imatrix must be 1-D with ",
                    cols, " values (one importance per column), got shape ", imatrix->sizes());
  at::Tensor im = imatrix->contiguous();
  TORCH_CHECK_VALUE(at::isfinite(im).all().item<bool>() && (im >= 0).all().item<bool>(),
                    "imatrix values must be finite and >= 0");
  return im;
}

// ggml's grid-search quantizers overflow float32 in their search on very large inputs or
// importances, and then abort the process (a point off the grid, a NaN scale). Fuzzing the pinned
// ggml (20000 rows per type, constant, gaussian, spiky and all-magnitude rows and importances)
// found no abort with |x| and imatrix up to 2^40, and aborts from 2^44 for both (from |x| = 2^24
// with an importance of 2^90, from |x| = 2^50 with importances of 1). quantize takes up to 2^32 of
// each. Far below that the values are out of the formats' reach anyway: a block's scale is a
// float16.
constexpr double kGridSearchLimit = 4294967296.0;  // 2^32

// x (finite, float32) and the importances within the grid-search quantizers' range.
void check_grid_search_range(ggml_type type, const at::Tensor& xf, const at::Tensor& im) {
  if (!is_grid_search_type(type)) return;
  const double x_max = xf.abs().max().item<double>();
  TORCH_CHECK_VALUE(x_max <= kGridSearchLimit, type_name(type), " quantization takes |x| <= 2^32 (",
                    kGridSearchLimit,
                    "), beyond which ggml's quantizer overflows float32 and aborts; x holds ",
                    x_max);
  if (!im.defined()) return;
  const double im_max = im.max().item<double>();
  TORCH_CHECK_VALUE(im_max <= kGridSearchLimit, type_name(type),
                    " quantization takes imatrix values <= 2^32 (", kGridSearchLimit,
                    "), beyond which ggml's quantizer overflows float32 and aborts; imatrix holds ",
                    im_max);
}

// Weight bytes x activation rows from which a product's rows are cut into 4 slices per thread
// (taken from a shared counter, for balance) instead of one: below it the slices' graphs cost more
// than the balance wins. Qwen3.5-0.8B Q4_K_M, 2 threads, first token after 16 / 64 / 128 / 512
// tokens: 78 / 168 / 293 / 1061 ms with 4 slices always, 69-72 / 146-160 / 259-281 / 1054-1085 ms
// with this rule.
constexpr int64_t kManySlicesWork = int64_t{1} << 28;

// out (M, N) = x (M, K) @ W.T with ggml's mul_mat on plain packed rows: the weight's rows split
// over torch's threads, one single-threaded graph per slice. xq: x quantized to the dot product's
// type (undefined when it reads float32). `plain_rows(n0, n1)` gives rows [n0, n1) in the plain
// layout.
template <typename PlainRows>
void mul_mat_slices(ggml_type type, int64_t k, int64_t row_bytes, int64_t n, const at::Tensor& xf2,
                    const at::Tensor& xq, const at::Tensor& out2, const PlainRows& plain_rows) {
  const ggml_type vdt = ggml().ggml_get_type_traits_cpu(type)->vec_dot_type;
  const int64_t m = xf2.size(0), per_thread = n * row_bytes * m >= kManySlicesWork ? 4 : 1;
  parallel_chunks(n, min_rows_per_task(row_bytes, m), 16, per_thread, [&](int64_t n0, int64_t n1) {
    const at::Tensor rows = plain_rows(n0, n1);
    Graph g(8);
    ggml_tensor* w = g.packed(rows, type, k);
    ggml_tensor* xt = xq.defined() ? g.packed(xq, vdt, k) : g.view(xf2);
    ggml_tensor* y = ggml().ggml_mul_mat(g.ctx(), w, xt);  // {n1 - n0, M}
    g.compute(y, out2.narrow(1, n0, n1 - n0));
  });
}

void mul_mat_plain(const at::Tensor& blocks, ggml_type type, int64_t k, const at::Tensor& xf2,
                   const at::Tensor& xq, const at::Tensor& out2) {
  mul_mat_slices(type, k, blocks.size(1), blocks.size(0), xf2, xq, out2,
                 [&](int64_t n0, int64_t n1) { return blocks.narrow(0, n0, n1 - n0); });
}

// Activation rows up to which plain quantized weights run on share_products, a group's together
// (one parallel region, rather than one weight after another): a decode step's batch or a prompt of
// up to 128 tokens. A single weight too: its threads by weight bytes x m (threads_for), equal rows
// each, one graph per thread. Above it mul_mat_slices' slices, taken from a shared counter, balance
// a long prompt's minutes of work between threads. AMD EPYC (zen4), 2 threads, one process,
// alternating: at 2-8 rows (against mul_mat_slices' slices of >= 256 KiB / m, which left small
// weights on one thread) SmolLM2's 576x576 Q4_1 at 2 rows 0.53x -> 0.88x ggml's own op, 192x576 at
// 2 / 4 rows 0.51 / 0.52x -> 0.70 / 0.76x, 512x1024 Q4_K 0.90 -> 1.00x; at 9-128 rows (against the
// same slices, 2026-12-05) a whole first token 1.03-1.07x faster: Qwen3.5-0.8B-shaped Q4_K_M after
// 16 / 64 / 128 tokens 110 -> 101, 262 -> 246, 467 -> 437 ms; single products 0.99-1.06x at 16-128
// rows (Q4_K 6144x1024, 1024x3584, 2048x1024, Q6_K 1024x3584, Q4_1 1536x576, 576x576; Q6_K at 128
// rows 1.17x) and 0.99-1.00x at 256 and 512, so the slices stay there.
constexpr int64_t kShareRows = 128;

// One weight of a product over a few activation rows, computed in slices by share_products: its
// blocks, type and layout, the activations as its kernels read them, and its output (M, N). A
// repacked weight's kernels (ggml's repacked gemv / gemm) take x float32 and quantize it
// themselves; a plain weight's mul_mat takes x already quantized to its dot product's type.
struct FewRowsProduct {
  at::Tensor blocks;
  ggml_type type;
  bool repacked;
  at::Tensor x;  // (M, K) float32, or (M, row_size) of x_type
  ggml_type x_type;
  at::Tensor out2;
};

// Thread t's share of the products `ws` over a few activation rows: one graph holding the thread's
// rows of every weight, on ggml's mul_mat. Each weight's rows are divided equally between the
// threads (at whole groups of kRepackRows for repacked weights, multiples of 16 rows for plain
// ones): the types differ in cost per byte and per value, so that shares of the weights laid end
// to end leave one thread more work (a Q4_K_M layer's 6144-row Q4_K and 2048-row Q6_K
// projections at 8 rows: 0.88x the two products one after another, cut by bytes or by values).
// One graph per thread: every graph costs its building, which finer slices do not win back
// (3584x1024 Q4_K repacked, 2 threads, one row: 75 us with 4 slices per thread, 56 us with one).
// And one parallel region for a layer's siblings: one weight after another, a short prompt's
// q/k/v were three regions and a 192-row k or v projection ran on one thread (SmolLM2's 192x576
// Q4_1 at 4 rows: 27 us against ggml's 15-20 us on two).
void share_products(const std::vector<FewRowsProduct>& ws, int64_t k, int64_t t, int64_t threads) {
  Graph g(static_cast<int>(3 * ws.size() + 2));
  std::vector<ggml_tensor*> results;
  for (const auto& w : ws) {
    const int64_t rows = w.blocks.size(0), align = w.repacked ? kRepackRows : 16;
    const auto [r0, r1] = share_rows(rows, t, threads, 0, rows, 1, align);
    if (r0 >= r1) continue;
    ggml_tensor* wt = g.packed(w.blocks.narrow(0, r0, r1 - r0), w.type, k);
    if (w.repacked) ggml_quantization::mark_repacked(wt);
    ggml_tensor* xt = w.x_type == GGML_TYPE_F32 ? g.view(w.x) : g.packed(w.x, w.x_type, k);
    ggml_tensor* y = ggml().ggml_mul_mat(g.ctx(), wt, xt);  // {r1 - r0, M}
    g.bind(y, w.out2.narrow(1, r0, r1 - r0));
    results.push_back(y);
  }
  g.compute_bound(results);
}

// Weight bytes the products `ws` over m activation rows read, a plain weight's counted once per row
// (m times the dot products; a repacked weight's gemm reads each block once for all rows).
int64_t weighed_bytes(const std::vector<FewRowsProduct>& ws, int64_t m) {
  int64_t total = 0;
  for (const auto& w : ws) total += w.blocks.size(0) * w.blocks.size(1) * (w.repacked ? 1 : m);
  return total;
}

// The products `ws` over m activation rows in one parallel region (share_products).
void few_rows_products(const std::vector<FewRowsProduct>& ws, int64_t k, int64_t m) {
  const int64_t threads = threads_for(weighed_bytes(ws, m));
  run_shares(threads, [&](int64_t t) { share_products(ws, k, t, threads); });
}

// Activation rows from which a repacked weight's product is faster on ggml's plain kernels (each
// slice's rows unpacked first) than on its repacked gemm. Measured on 3584x1024 and 1024x3584 Q4_K
// weights, 2 threads (AVX-512 CPU): the repacked gemm is 1.2-1.6x the plain kernels at 2-16 rows,
// 0.86-0.98x at 32 and 0.53-0.62x at 512; unpacking first is 0.73-0.78x at 64.
constexpr int64_t kPlainLayoutRows = 48;

// out (M, N) = x (M, K) @ W.T for a weight in the repacked layout: ggml's repacked kernels
// (share_products), or for many rows its plain kernels on each slice unpacked.
void mul_mat_repacked(const at::Tensor& blocks, ggml_type type, int64_t k, const at::Tensor& xf2,
                      const at::Tensor& out2) {
  const int64_t m = xf2.size(0), n = blocks.size(0), rb = blocks.size(1);
  if (m < kPlainLayoutRows) {
    few_rows_products({{blocks, type, true, xf2, GGML_TYPE_F32, out2}}, k, m);
    return;
  }
  const at::Tensor xq = activations_for(xf2, type);
  const auto* w = blocks.data_ptr<uint8_t>();
  mul_mat_slices(type, k, rb, n, xf2, xq, out2, [&](int64_t n0, int64_t n1) {
    auto rows = at::empty({n1 - n0, rb}, blocks.options());
    ggml_quantization::unrepack_groups(type, w, rb, rb, n0 / kRepackRows, n1 / kRepackRows,
                                       rows.data_ptr<uint8_t>());
    return rows;
  });
}

// A repacked weight (rows, row_bytes) in the plain layout, as a new tensor.
at::Tensor plain_layout(const at::Tensor& blocks, ggml_type type) {
  auto plain = at::empty({blocks.size(0), blocks.size(1)}, blocks.options());
  const int64_t rb = blocks.size(1), groups = blocks.size(0) / kRepackRows;
  const auto* src = blocks.data_ptr<uint8_t>();
  auto* dst = plain.data_ptr<uint8_t>();
  at::parallel_for(
      0, groups, std::max<int64_t>(1, (1 << 16) / (kRepackRows * rb)), [&](int64_t g0, int64_t g1) {
        ggml_quantization::unrepack_groups(type, src, rb, rb, g0, g1, dst + g0 * kRepackRows * rb);
      });
  return plain;
}

}  // namespace

at::Tensor mul_mat(const at::Tensor& blocks, const at::Tensor& x, int64_t type_id,
                   int64_t out_features) {
  const auto [st, k] = check_weight(blocks, type_id, out_features, x, "blocks");
  const ggml_type type = st.type;
  const int64_t m = x.numel() / k;  // x (..., K): m rows, out (..., N)
  auto out = new_tensor_like(x, rows_shape(x, out_features), at::kFloat);
  if (m == 0 || out_features == 0) return out;

  const at::Tensor xf = float32_contiguous(x);
  if (!st.repacked && takes_dot_rows(type, m, blocks.size(1))) {  // a decode step's: no views
    const at::Tensor xq = activations_for(xf, type);
    direct_dot_rows({dot_rows(blocks, type, xq, out.data_ptr<float>(), out_features)}, k, m);
    return out;
  }
  const at::Tensor out2 = out.view({m, out_features});
  if (st.repacked) {
    mul_mat_repacked(blocks, type, k, xf.view({m, k}), out2);
    return out;
  }
  const at::Tensor xq = activations_for(xf, type);  // once, shared by every slice
  const auto* traits = ggml().ggml_get_type_traits_cpu(type);
  if (m <= kShareRows && reads_quantized_x(type)) {
    few_rows_products({{blocks, type, false, xq, traits->vec_dot_type, out2}}, k, m);
    return out;
  }
  mul_mat_plain(blocks, type, k, xf.view({m, k}), xq, out2);
  return out;
}

std::vector<at::Tensor> mul_mat_group(at::TensorList blocks, const at::Tensor& x,
                                      at::IntArrayRef type_ids, at::IntArrayRef out_features) {
  const size_t n = blocks.size();
  TORCH_CHECK_VALUE(n > 0, "mul_mat_group needs at least one weight");
  TORCH_CHECK_VALUE(type_ids.size() == n && out_features.size() == n, "mul_mat_group got ", n,
                    " weights, ", type_ids.size(), " ggml types and ", out_features.size(),
                    " out_features: one each");
  // x (..., K) checked against every weight below; m rows of it
  const int64_t m = x.dim() >= 1 && x.size(-1) > 0 ? x.numel() / x.size(-1) : 0;
  std::vector<Storage> stored(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string name = "blocks[" + std::to_string(i) + "]";
    stored[i] = check_weight(blocks[i], type_ids[i], out_features[i], x, name.c_str()).first;
  }
  // Each weight's path: dot products (plain weights, takes_dot_rows), ggml's mul_mat on plain
  // weights (others up to kShareRows rows), ggml's repacked kernels (repacked weights, fewer than
  // kPlainLayoutRows rows), or mul_mat on its own. The first three run together: the activations
  // quantized once per dot-product type (Q4_K and Q6_K share Q8_K), then one parallel region over
  // all their rows, each thread taking its share of every kind.
  // a plain quantized weight, whose dot products read x quantized (once per type, shared)
  auto is_plain_quantized = [&](const Storage& st) {
    return !st.repacked && reads_quantized_x(st.type);
  };
  auto is_direct = [&](size_t i) {
    const Storage& st = stored[i];
    return !st.repacked && !is_float_type(st.type) &&
           takes_dot_rows(st.type, m, blocks[i].size(-1));
  };
  auto is_few_repacked = [&](const Storage& st) {
    return st.repacked && m >= 1 && m < kPlainLayoutRows;
  };
  auto is_few_plain = [&](const Storage& st) {
    return m >= 2 && m <= kShareRows && is_plain_quantized(st);
  };
  std::vector<at::Tensor> outs(n);
  std::vector<DotRows> dots;
  std::vector<FewRowsProduct> few;  // repacked weights, and plain ones at 2-kShareRows rows
  std::vector<std::pair<ggml_type, at::Tensor>> quantized;
  at::Tensor xf;
  for (size_t i = 0; i < n; ++i) {
    const Storage& st = stored[i];
    if (!is_direct(i) && !is_few_repacked(st) && !is_few_plain(st)) {
      outs[i] = mul_mat(blocks[i], x, type_ids[i], out_features[i]);
      continue;
    }
    if (!xf.defined()) xf = float32_contiguous(x);
    outs[i] = new_tensor_like(x, rows_shape(x, out_features[i]), at::kFloat);
    const at::Tensor out2 = outs[i].view({m, out_features[i]});
    if (st.repacked) {
      few.push_back({blocks[i], st.type, true, xf.view({m, x.size(-1)}), GGML_TYPE_F32, out2});
      continue;
    }
    const ggml_type vdt = ggml().ggml_get_type_traits_cpu(st.type)->vec_dot_type;
    auto it = std::find_if(quantized.begin(), quantized.end(),
                           [&](const auto& e) { return e.first == vdt; });
    if (it == quantized.end())
      it = quantized.insert(quantized.end(), {vdt, activations_for(xf, st.type)});
    if (is_direct(i)) {
      dots.push_back(dot_rows(blocks[i], st.type, it->second, out2));
    } else {
      few.push_back({blocks[i], st.type, false, it->second, vdt, out2});
    }
  }
  if (!xf.defined()) return outs;
  const int64_t k = x.size(-1), dot_total = total_bytes(dots);
  const int64_t threads = threads_for(dot_total * m + weighed_bytes(few, m));
  const DotRuns runs(dots, k, dot_total, threads);
  run_shares(threads, [&](int64_t t) {
    if (dot_total > 0) runs.work(t);
    if (!few.empty()) share_products(few, k, t, threads);
  });
  return outs;
}

at::Tensor mul_mat_id(const at::Tensor& blocks, const at::Tensor& x, const at::Tensor& ids,
                      int64_t type_id, int64_t out_features) {
  const Storage st = check_storage(type_id);
  TORCH_CHECK_VALUE(!st.repacked,
                    "mul_mat_id takes expert weights in the plain GGUF layout, not "
                    "repacked ones (type id ",
                    type_id, ")");
  const ggml_type type = st.type;
  const int64_t k = check_experts(blocks, type, out_features, x, ids);
  const int64_t experts = blocks.size(0);
  const int64_t t = x.size(0), n_ids = ids.size(1);
  auto out = new_tensor_like(x, {t, n_ids, out_features}, at::kFloat);
  if (t == 0 || n_ids == 0 || out_features == 0) return out;

  const at::Tensor xf = float32_contiguous(x);
  const at::Tensor xq = activations_for(xf, type);  // once, shared by every slice
  const auto* traits = ggml().ggml_get_type_traits_cpu(type);
  const ggml_type vdt = traits->vec_dot_type;
  const at::Tensor ids32 = ids.to(at::kInt).contiguous();
  if (t * n_ids <= kDirectDotPairs && xq.defined() && traits->nrows == 1) {
    direct_dot_mul_mat_id(blocks, type, k, xq, ids32, out);
    return out;
  }
  if (t * n_ids <= kGroupedPairsPerExpert * experts && xq.defined() && traits->nrows == 1 &&
      !decodes_grids(type)) {
    grouped_dot_mul_mat_id(blocks, type, k, xq, ids32, out);
    return out;
  }
  // every (token, expert) pair reads one expert's slice: the work of a product of t * n_ids rows.
  // A slice's rows n0..n1 are those rows of every expert, so it weighs rb x experts bytes a row,
  // each read by pairs / experts activation rows on average. Weighed by rb alone, a 16-token
  // prompt's 128 pairs over 64 experts made one slice of each 256-row expert weight, on one thread:
  // 0.49-0.60x ggml's own op (Qwen3.5-MoE-shaped Q4_K / Q6_K experts, Intel Xeon, 2 threads).
  const int64_t pairs = t * n_ids, rb = blocks.size(2);
  const int64_t per_thread = out_features * rb * pairs >= kManySlicesWork ? 4 : 1;
  const int64_t slice_rows =
      min_rows_per_task(rb * experts, std::max<int64_t>(1, pairs / std::max<int64_t>(1, experts)));
  parallel_chunks(out_features, slice_rows, 16, per_thread, [&](int64_t n0, int64_t n1) {
    Graph g(8);
    ggml_tensor* as = g.packed(blocks.narrow(1, n0, n1 - n0), type, k);  // {K, n1 - n0, E}
    // one activation row per token ({K, 1, T}), shared by the token's experts
    ggml_tensor* xt =
        xq.defined() ? g.packed(xq.view({t, 1, xq.size(1)}), vdt, k) : g.view(xf.view({t, 1, k}));
    ggml_tensor* y = ggml().ggml_mul_mat_id(g.ctx(), as, xt, g.view(ids32));
    g.compute(y, out.narrow(2, n0, n1 - n0));  // {n1 - n0, n_ids, T}
  });
  return out;
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t type_id, int64_t rows, int64_t cols,
                      at::ScalarType dtype) {
  const Storage st = check_storage(type_id);
  const ggml_type type = st.type;
  check_out_dtype(dtype);
  check_rows_operand(blocks, type, cols);
  check_dequantized_rows(blocks, rows, cols);
  check_repacked_rows(blocks, st, "blocks");
  if (rows == 0) return at::empty({0, cols}, blocks.options().dtype(dtype));
  if (is_float_type(type))
    return float_view(blocks, type, cols).to(dtype, /*non_blocking=*/false, /*copy=*/true);
  auto out = at::empty({rows, cols}, blocks.options().dtype(at::kFloat));
  dequantize_rows(blocks, type, st.repacked, cols, nullptr, rows, out.data_ptr<float>());
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor get_rows(const at::Tensor& blocks, const at::Tensor& indices, int64_t type_id,
                    int64_t cols, at::ScalarType dtype) {
  const Storage st = check_storage(type_id);
  const ggml_type type = st.type;
  check_out_dtype(dtype);
  check_rows_operand(blocks, type, cols);
  check_repacked_rows(blocks, st, "blocks");
  check_row_indices(indices, blocks.size(0), cols);
  const int64_t n = indices.size(0);
  if (n == 0) return at::empty({0, cols}, blocks.options().dtype(dtype));
  const at::Tensor idx = indices.to(at::kLong).contiguous();
  if (is_float_type(type)) return float_view(blocks, type, cols).index_select(0, idx).to(dtype);
  auto out = at::empty({n, cols}, blocks.options().dtype(at::kFloat));
  dequantize_rows(blocks, type, st.repacked, cols, idx.data_ptr<int64_t>(), n,
                  out.data_ptr<float>());
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor quantize(const at::Tensor& x, int64_t type_id,
                    const std::optional<at::Tensor>& imatrix) {
  const ggml_type type = check_storage_type(type_id);
  const auto& G = ggml();
  check_device(x, "x");
  check_dtype(x, {at::kFloat, at::kHalf, at::kBFloat16}, "x");
  check_dim(x, 2, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t rb = packed_row_bytes(type, cols);
  const at::Tensor im = checked_imatrix(imatrix, cols, type);
  auto out = at::empty({rows, rb}, x.options().dtype(at::kByte));
  if (rows == 0) return out;
  const at::Tensor xf = float32_contiguous(x);
  if (!is_float_type(type)) {
    TORCH_CHECK_VALUE(at::isfinite(xf).all().item<bool>(), "x contains NaN or infinity; ",
                      type_name(type), " cannot represent it");
  }
  check_grid_search_range(type, xf, im);
  G.ggml_quantize_init(type);  // builds the IQ grids once, before the threads need them
  const float* src = xf.data_ptr<float>();
  const float* weights = im.defined() ? im.data_ptr<float>() : nullptr;
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / cols);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    G.ggml_quantize_chunk(type, src, dst, begin * cols, end - begin, cols, weights);
  });
  return out;
}

namespace {
// The (rows, row_bytes) weight repack and unrepack take: its plain type and values per row.
std::pair<ggml_type, int64_t> check_layout_operand(const at::Tensor& blocks, int64_t type_id) {
  const ggml_type type = check_storage_type(type_id);
  check_device(blocks, "blocks");
  check_dtype(blocks, {at::kByte}, "blocks");
  check_dim(blocks, 2, "blocks");
  const int64_t cols = cols_of(blocks, type, "blocks");
  check_packed(blocks, type, cols, "blocks");
  return {type, cols};
}
}  // namespace

at::Tensor repack(const at::Tensor& blocks, int64_t type_id) {
  const auto [type, cols] = check_layout_operand(blocks, type_id);
  return ggml_quantization::repack(blocks, type, cols);
}

at::Tensor unrepack(const at::Tensor& blocks, int64_t type_id) {
  const ggml_type type = check_layout_operand(blocks, type_id).first;
  check_repacked_rows(blocks, check_storage(type_id + ggml_quantization::kRepackedFlag), "blocks");
  return plain_layout(blocks, type);
}

std::vector<int64_t> repacked_types() {
  std::vector<int64_t> out;
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    if (ggml_quantization::has_repacked_layout(static_cast<ggml_type>(t))) out.push_back(t);
  }
  return out;
}

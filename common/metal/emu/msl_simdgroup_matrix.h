// MSL's SIMD-group matrices for the translated kernels (msl.h): 8x8 tiles, loads, stores and the
// multiply-accumulate, each a collective of the SIMD group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "emu_runtime.h"
#include "msl_simd.h"
#include "msl_types.h"

namespace metal {

// ---- SIMD-group matrices ----
// Every lane holds the whole 8x8 tile (row-major): the same values in every lane. Products are
// SIMD-group collectives computed once per group; loads, stores and barriers are rendezvous points
// of the SIMD group, so a lane never reads a tile before the group's writes.

inline void simd_rendezvous(const char* what) {
  ggml_kernels::metal::emu::simd_collective(nullptr, nullptr, 0, &detail::nothing, 0, what);
}
inline void simdgroup_barrier(mem_flags::flags) { simd_rendezvous("simdgroup_barrier"); }
// The convergence points the translator puts around a lane-0 branch (metal_translate.py).
inline void gk_simd_converge() {
  if (ggml_kernels::metal::emu::lane_zero_convergence()) simd_rendezvous("lane-0 branch");
}

template <typename T, int Cols, int Rows = Cols>
struct simdgroup_matrix {
  T e[Rows * Cols];
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (auto& x : m.e) x = value;
  return m;
}

// origin (x: column, y: row) in elements; `transpose` reads rows as columns
template <typename T, int C, int R, typename P>
void simdgroup_load(simdgroup_matrix<T, C, R>& m, const P* src, long elements_per_row = C,
                    vec<uint64_t, 2> origin = vec<uint64_t, 2>(0), bool transpose = false) {
  simd_rendezvous("simdgroup_load");
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const long row = static_cast<long>(origin.y) + (transpose ? c : r);
      const long col = static_cast<long>(origin.x) + (transpose ? r : c);
      m.e[r * C + c] = static_cast<T>(src[row * elements_per_row + col]);
    }
}

template <typename T, int C, int R, typename P>
void simdgroup_store(const simdgroup_matrix<T, C, R>& m, P* dst, long elements_per_row = C,
                     vec<uint64_t, 2> origin = vec<uint64_t, 2>(0), bool transpose = false) {
  for (int r = 0; r < R; ++r)  // every lane writes the same tile
    for (int c = 0; c < C; ++c) {
      const long row = static_cast<long>(origin.y) + (transpose ? c : r);
      const long col = static_cast<long>(origin.x) + (transpose ? r : c);
      dst[row * elements_per_row + col] = static_cast<P>(m.e[r * C + c]);
    }
  simd_rendezvous("simdgroup_store");
}

namespace detail {
// One lane's operands of a multiply-accumulate: pointers into its (suspended) fiber's frame.
template <typename TD, typename TA, typename TB, typename TC, int N>
struct MacOperands {
  simdgroup_matrix<TD, N, N>* d;
  const simdgroup_matrix<TA, N, N>* a;
  const simdgroup_matrix<TB, N, N>* b;
  const simdgroup_matrix<TC, N, N>* c;
};

template <typename M>
bool same_tile(const M* x, const M* y) {
  return std::memcmp(x, y, sizeof(M)) == 0;
}

// Resolves the SIMD group's multiply-accumulate once: every lane holds the same tiles, so the first
// live lane's are multiplied (each element summed over k in order, in float) and the product is
// written to every lane's d. Lanes holding different tiles would be a bug of this shim.
template <typename TD, typename TA, typename TB, typename TC, int N>
void multiply_accumulate_once(const uint8_t* in, const bool* alive, uint8_t*, size_t, int) {
  using Operands = MacOperands<TD, TA, TB, TC, N>;
  const auto* lanes = reinterpret_cast<const Operands*>(in);
  int first = 0;
  while (!alive[first]) ++first;
  const Operands& o = lanes[first];
  for (int i = first + 1; i < ggml_kernels::metal::emu::kSimdWidth; ++i) {
    if (alive[i] &&
        !(same_tile(lanes[i].a, o.a) && same_tile(lanes[i].b, o.b) && same_tile(lanes[i].c, o.c)))
      throw std::runtime_error("simdgroup_multiply_accumulate: lanes hold different tiles");
  }
  simdgroup_matrix<TD, N, N> out;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = static_cast<float>(o.c->e[i * N + j]);
      for (int k = 0; k < N; ++k)
        acc += static_cast<float>(o.a->e[i * N + k]) * static_cast<float>(o.b->e[k * N + j]);
      out.e[i * N + j] = static_cast<TD>(acc);
    }
  for (int i = first; i < ggml_kernels::metal::emu::kSimdWidth; ++i)
    if (alive[i]) *lanes[i].d = out;
}
}  // namespace detail

// d = a * b + c: a collective of the SIMD group (as on a GPU, where the lanes share the tiles),
// computed once for the group instead of once per lane.
template <typename TD, typename TA, typename TB, typename TC, int N>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, N, N>& d,
                                   const simdgroup_matrix<TA, N, N>& a,
                                   const simdgroup_matrix<TB, N, N>& b,
                                   const simdgroup_matrix<TC, N, N>& c) {
  detail::MacOperands<TD, TA, TB, TC, N> operands{&d, &a, &b, &c}, unused;
  ggml_kernels::metal::emu::simd_collective(&operands, &unused, sizeof(operands),
                                            &detail::multiply_accumulate_once<TD, TA, TB, TC, N>, 0,
                                            "simdgroup_multiply_accumulate");
}

template <typename TD, typename TA, typename TB, int N>
void simdgroup_multiply(simdgroup_matrix<TD, N, N>& d, const simdgroup_matrix<TA, N, N>& a,
                        const simdgroup_matrix<TB, N, N>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, N, N>(TD(0)));
}

}  // namespace metal

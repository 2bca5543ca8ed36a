// The Metal Shading Language as C++, for upstream's kernels translated by
// tools/build/metal_translate.py: scalar and vector types, half, address spaces, math, SIMD-group
// collectives and barriers (rendezvous points of emu_runtime.h), `as_type`, and the binding of a
// kernel's parameters to a dispatch's buffers, threadgroup memory and thread-position builtins.
// Grows with the kernel files translated (see metal_translate.KERNEL_FILES).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "emu_runtime.h"

typedef _Float16 half;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

namespace metal {

// ---- vectors ----

template <typename T, int N>
struct vec_storage;
template <typename T>
struct vec_storage<T, 2> {
  union {
    T v[2];
    struct {
      T x, y;
    };
  };
};
template <typename T>
struct vec_storage<T, 3> {
  union {
    T v[3];
    struct {
      T x, y, z;
    };
  };
};
template <typename T>
struct vec_storage<T, 4> {
  union {
    T v[4];
    struct {
      T x, y, z, w;
    };
  };
};

template <typename T, int N>
struct vec : vec_storage<T, N> {
  using value_type = T;
  static constexpr int size = N;
  vec() = default;
  vec(T s) {  // NOLINT: MSL widens scalars to vectors implicitly
    for (int i = 0; i < N; ++i) this->v[i] = s;
  }
  // other arithmetic scalars too (`bfloat4 x = 0`: int -> bfloat is itself a user conversion)
  template <typename S,
            typename = std::enable_if_t<std::is_arithmetic_v<S> && !std::is_same_v<S, T>>>
  vec(S s) : vec(static_cast<T>(s)) {}  // NOLINT
  template <typename... A, typename = std::enable_if_t<(sizeof...(A) >= 2)>>
  vec(A... parts) {
    int i = 0;
    (append(i, parts), ...);
  }
  template <typename U>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) this->v[i] = static_cast<T>(o.v[i]);
  }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }

 private:
  template <typename U>
  void append(int& i, const U& part) {
    if constexpr (std::is_arithmetic_v<U> || std::is_same_v<U, half>) {
      this->v[i++] = static_cast<T>(part);
    } else {
      for (int j = 0; j < U::size; ++j) this->v[i++] = static_cast<T>(part.v[j]);
    }
  }
};

template <typename T>
struct is_vec : std::false_type {};
template <typename T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

// element-wise operators: R is the element type of the result (T, or bool for comparisons)
#define GK_VEC_ELEMENTWISE(OP, R)                                                          \
  template <typename T, int N>                                                             \
  vec<R, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {                          \
    vec<R, N> r;                                                                           \
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] OP b.v[i];                                 \
    return r;                                                                              \
  }                                                                                        \
  template <typename T, int N, typename S, typename = std::enable_if_t<!is_vec<S>::value>> \
  vec<R, N> operator OP(const vec<T, N>& a, S b) {                                         \
    return a OP vec<T, N>(static_cast<T>(b));                                              \
  }                                                                                        \
  template <typename T, int N, typename S, typename = std::enable_if_t<!is_vec<S>::value>> \
  vec<R, N> operator OP(S a, const vec<T, N>& b) {                                         \
    return vec<T, N>(static_cast<T>(a)) OP b;                                              \
  }
GK_VEC_ELEMENTWISE(+, T)
GK_VEC_ELEMENTWISE(-, T)
GK_VEC_ELEMENTWISE(*, T)
GK_VEC_ELEMENTWISE(/, T)
GK_VEC_ELEMENTWISE(<, bool)
GK_VEC_ELEMENTWISE(>, bool)
GK_VEC_ELEMENTWISE(<=, bool)
GK_VEC_ELEMENTWISE(>=, bool)
GK_VEC_ELEMENTWISE(==, bool)
GK_VEC_ELEMENTWISE(!=, bool)
#undef GK_VEC_ELEMENTWISE

#define GK_VEC_ASSIGN(OP)                                  \
  template <typename T, int N, typename S>                 \
  vec<T, N>& operator OP## = (vec<T, N> & a, const S& b) { \
    return a = a OP b;                                     \
  }
GK_VEC_ASSIGN(+)
GK_VEC_ASSIGN(-)
GK_VEC_ASSIGN(*)
GK_VEC_ASSIGN(/)
#undef GK_VEC_ASSIGN

template <typename T, int N>
vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = -a.v[i];
  return r;
}

#define GK_VEC_TYPES(T, NAME) \
  typedef vec<T, 2> NAME##2;  \
  typedef vec<T, 3> NAME##3;  \
  typedef vec<T, 4> NAME##4;
GK_VEC_TYPES(float, float)
GK_VEC_TYPES(half, half)
GK_VEC_TYPES(int32_t, int)
GK_VEC_TYPES(uint32_t, uint)
GK_VEC_TYPES(int16_t, short)
GK_VEC_TYPES(uint16_t, ushort)
GK_VEC_TYPES(int8_t, char)
GK_VEC_TYPES(uint8_t, uchar)
GK_VEC_TYPES(bool, bool)
#undef GK_VEC_TYPES

// bfloat: 16-bit brain float, converted through float (round to nearest even).
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {  // NOLINT: converts implicitly, as MSL's does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40);  // a quiet NaN
    } else {
      bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  bfloat(int i) : bfloat(static_cast<float>(i)) {}   // NOLINT
  bfloat(half h) : bfloat(static_cast<float>(h)) {}  // NOLINT
  // to floating types only: `c ? b : 0` then converts the 0, as in MSL
  template <typename F,
            typename = std::enable_if_t<std::is_floating_point_v<F> || std::is_same_v<F, half>>>
  operator F() const {  // NOLINT
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return static_cast<F>(f);
  }
};
#define GK_BFLOAT_OP(OP)                                                             \
  inline float operator OP(bfloat a, float b) { return static_cast<float>(a) OP b; } \
  inline float operator OP(float a, bfloat b) { return a OP static_cast<float>(b); } \
  inline float operator OP(bfloat a, bfloat b) {                                     \
    return static_cast<float>(a) OP static_cast<float>(b);                           \
  }
GK_BFLOAT_OP(+)
GK_BFLOAT_OP(-)
GK_BFLOAT_OP(*)
GK_BFLOAT_OP(/)
#undef GK_BFLOAT_OP
typedef vec<bfloat, 2> bfloat2;
typedef vec<bfloat, 3> bfloat3;
typedef vec<bfloat, 4> bfloat4;

// packed vectors: the same layout here (no 16-byte alignment of 3-vectors to undo)
#define GK_PACKED(NAME)             \
  typedef NAME##2 packed_##NAME##2; \
  typedef NAME##3 packed_##NAME##3; \
  typedef NAME##4 packed_##NAME##4;
GK_PACKED(float)
GK_PACKED(half)
GK_PACKED(char)
GK_PACKED(uchar)
GK_PACKED(short)
GK_PACKED(ushort)
GK_PACKED(int)
GK_PACKED(uint)
#undef GK_PACKED

// matrix<T, C, R>: C columns of R rows; m[i] is column i
template <typename T, int C, int R>
struct matrix {
  vec<T, R> columns[C];
  matrix() = default;
  template <typename U>
  explicit matrix(const matrix<U, C, R>& o) {
    for (int i = 0; i < C; ++i) columns[i] = vec<T, R>(o.columns[i]);
  }
  vec<T, R>& operator[](int i) { return columns[i]; }
  const vec<T, R>& operator[](int i) const { return columns[i]; }
};
template <typename T, int C, int R, typename S>
matrix<T, C, R> operator*(const matrix<T, C, R>& m, S s) {
  matrix<T, C, R> r;
  for (int i = 0; i < C; ++i) r.columns[i] = m.columns[i] * s;
  return r;
}
typedef matrix<float, 4, 4> float4x4;
typedef matrix<half, 4, 4> half4x4;
typedef matrix<bfloat, 4, 4> bfloat4x4;
typedef matrix<float, 2, 4> float2x4;
typedef matrix<half, 2, 4> half2x4;
typedef matrix<bfloat, 2, 4> bfloat2x4;

// select(a, b, c): c ? b : a, per component
template <typename T>
T select(T a, T b, bool c) {
  return c ? b : a;
}
template <typename T, int N>
vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = c.v[i] ? b.v[i] : a.v[i];
  return r;
}

// ---- math ----

#define GK_UNARY(NAME, EXPR)                           \
  inline float NAME(float x) { return EXPR; }          \
  inline half NAME(half h) {                           \
    float x = static_cast<float>(h);                   \
    return static_cast<half>(EXPR);                    \
  }                                                    \
  template <typename T, int N>                         \
  vec<T, N> NAME(const vec<T, N>& a) {                 \
    vec<T, N> r;                                       \
    for (int i = 0; i < N; ++i) r.v[i] = NAME(a.v[i]); \
    return r;                                          \
  }
GK_UNARY(sqrt, std::sqrt(x))
GK_UNARY(rsqrt, 1.0f / std::sqrt(x))
GK_UNARY(exp, std::exp(x))
GK_UNARY(log, std::log(x))
GK_UNARY(fabs, std::fabs(x))
GK_UNARY(abs, std::fabs(x))
GK_UNARY(tanh, std::tanh(x))
GK_UNARY(floor, std::floor(x))
GK_UNARY(ceil, std::ceil(x))
GK_UNARY(round, std::round(x))
GK_UNARY(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f)))
GK_UNARY(sin, std::sin(x))
GK_UNARY(cos, std::cos(x))
GK_UNARY(log2, std::log2(x))
GK_UNARY(exp2, std::exp2(x))
GK_UNARY(erf, std::erf(x))
GK_UNARY(trunc, std::trunc(x))
GK_UNARY(log1p, std::log1p(x))
GK_UNARY(expm1, std::expm1(x))
#undef GK_UNARY

#define GK_BINARY(NAME, EXPR)                                                                \
  inline float NAME(float x, float y) { return EXPR; }                                       \
  template <typename T, int N>                                                               \
  vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {                                   \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; ++i)                                                              \
      r.v[i] = static_cast<T>(NAME(static_cast<float>(a.v[i]), static_cast<float>(b.v[i]))); \
    return r;                                                                                \
  }                                                                                          \
  template <typename T, int N, typename S, typename = std::enable_if_t<!is_vec<S>::value>>   \
  vec<T, N> NAME(const vec<T, N>& a, S b) {                                                  \
    return NAME(a, vec<T, N>(static_cast<T>(b)));                                            \
  }                                                                                          \
  template <typename T, int N, typename S, typename = std::enable_if_t<!is_vec<S>::value>>   \
  vec<T, N> NAME(S a, const vec<T, N>& b) {                                                  \
    return NAME(vec<T, N>(static_cast<T>(a)), b);                                            \
  }
GK_BINARY(pow, std::pow(x, y))
GK_BINARY(powr, std::pow(x, y))
GK_BINARY(fmax, std::fmax(x, y))
GK_BINARY(fmin, std::fmin(x, y))
GK_BINARY(fmod, std::fmod(x, y))
#undef GK_BINARY

inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <typename T, int N>
vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}

template <typename T, int N>
T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a.v[0] * b.v[0];
  for (int i = 1; i < N; ++i) s += a.v[i] * b.v[i];
  return s;
}

template <typename T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
T max(T a, T b) {
  return a < b ? b : a;
}
template <typename T>
T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <typename T, int N>
vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = min(a.v[i], b.v[i]);
  return r;
}
template <typename T, int N>
vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = max(a.v[i], b.v[i]);
  return r;
}
template <typename T, int N, typename S>
vec<T, N> clamp(const vec<T, N>& x, S lo, S hi) {
  return min(max(x, vec<T, N>(static_cast<T>(lo))), vec<T, N>(static_cast<T>(hi)));
}

#define M_PI_F 3.14159265358979323846f
#define M_SQRT2_F 1.41421356237309504880f
#define MAXHALF 65504.0f
#define HALF_MAX 65504.0f

namespace precise {
using metal::exp;
using metal::sqrt;
using metal::tanh;
}  // namespace precise
namespace fast {
using metal::exp;
using metal::sqrt;
using metal::tanh;
}  // namespace fast

template <typename To, typename From>
To as_type(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "as_type between types of different sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// ---- SIMD groups and barriers ----

struct mem_flags {
  enum flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
};
inline mem_flags::flags operator|(mem_flags::flags a, mem_flags::flags b) {
  return static_cast<mem_flags::flags>(static_cast<int>(a) | static_cast<int>(b));
}

inline void threadgroup_barrier(mem_flags::flags) {
  ggml_kernels::metal::emu::threadgroup_barrier();
}

namespace detail {
namespace emu = ggml_kernels::metal::emu;
// Folds the live lanes' values in lane order (the same whatever order the lanes arrived in) and
// gives every lane the result.
template <typename T, typename Op>
void reduce_all(const uint8_t* in, const bool* alive, uint8_t* out, size_t size) {
  T acc{};
  bool first = true;
  for (int lane = 0; lane < emu::kSimdWidth; ++lane) {
    if (!alive[lane]) continue;
    T v;
    std::memcpy(&v, in + lane * size, size);
    acc = first ? v : Op{}(acc, v);
    first = false;
  }
  for (int lane = 0; lane < emu::kSimdWidth; ++lane) std::memcpy(out + lane * size, &acc, size);
}
struct Add {
  template <typename T>
  T operator()(const T& a, const T& b) const {
    return a + b;
  }
};
struct Max {
  template <typename T>
  T operator()(const T& a, const T& b) const {
    return max(a, b);
  }
};
struct Min {
  template <typename T>
  T operator()(const T& a, const T& b) const {
    return min(a, b);
  }
};
template <typename T, typename Op>
void reduce(const uint8_t* in, const bool* alive, uint8_t* out, size_t size, int) {
  reduce_all<T, Op>(in, alive, out, size);
}
inline void nothing(const uint8_t*, const bool*, uint8_t*, size_t, int) {}
}  // namespace detail

namespace detail {
// Lane `lane` receives the value of lane `source(lane, arg)` when that lane is in the group and
// alive, else keeps its own.
template <typename T, int (*source)(int, int)>
void shuffle(const uint8_t* in, const bool* alive, uint8_t* out, size_t size, int arg) {
  for (int lane = 0; lane < emu::kSimdWidth; ++lane) {
    const int from = source(lane, arg);
    const bool ok = from >= 0 && from < emu::kSimdWidth && alive[from];
    std::memcpy(out + lane * size, in + (ok ? from : lane) * size, size);
  }
}
inline int from_down(int lane, int delta) { return lane + delta; }
inline int from_up(int lane, int delta) { return lane - delta; }
inline int from_xor(int lane, int mask) { return lane ^ mask; }
inline int from_lane(int, int lane) { return lane; }
}  // namespace detail

#define GK_SHUFFLE(NAME, SOURCE)                                                                 \
  template <typename T>                                                                          \
  T NAME(T v, int arg) {                                                                         \
    T r;                                                                                         \
    ggml_kernels::metal::emu::simd_collective(&v, &r, sizeof(T),                                 \
                                              &detail::shuffle<T, &detail::SOURCE>, arg, #NAME); \
    return r;                                                                                    \
  }
GK_SHUFFLE(simd_shuffle_down, from_down)
GK_SHUFFLE(simd_shuffle_up, from_up)
GK_SHUFFLE(simd_shuffle_xor, from_xor)
GK_SHUFFLE(simd_broadcast, from_lane)
#undef GK_SHUFFLE

namespace detail {
// simd_shuffle's source lane may differ per lane (a gather): it travels with the lane's value.
template <typename T>
struct LaneRequest {
  T v;
  int from;
};
template <typename T>
void gather(const uint8_t* in, const bool* alive, uint8_t* out, size_t, int) {
  const auto* asked = reinterpret_cast<const LaneRequest<T>*>(in);
  auto* got = reinterpret_cast<LaneRequest<T>*>(out);
  for (int lane = 0; lane < emu::kSimdWidth; ++lane) {
    if (!alive[lane]) continue;
    const int from = asked[lane].from;
    const bool ok = from >= 0 && from < emu::kSimdWidth && alive[from];
    got[lane].v = asked[ok ? from : lane].v;
  }
}
}  // namespace detail

template <typename T>
T simd_shuffle(T v, int lane) {
  detail::LaneRequest<T> asked{v, lane}, got{};
  ggml_kernels::metal::emu::simd_collective(&asked, &got, sizeof(asked), &detail::gather<T>, 0,
                                            "simd_shuffle");
  return got.v;
}

#define GK_REDUCTION(NAME, OP)                                                                   \
  template <typename T>                                                                          \
  T NAME(T v) {                                                                                  \
    T r;                                                                                         \
    ggml_kernels::metal::emu::simd_collective(&v, &r, sizeof(T), &detail::reduce<T, detail::OP>, \
                                              0, #NAME);                                         \
    return r;                                                                                    \
  }
GK_REDUCTION(simd_sum, Add)
GK_REDUCTION(simd_max, Max)
GK_REDUCTION(simd_min, Min)
#undef GK_REDUCTION

// ---- atomics: the fibers of a dispatch run on one OS thread, one at a time ----
enum memory_order { memory_order_relaxed };
template <typename T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <typename T, typename U>
T atomic_fetch_add_explicit(volatile atomic<T>* a, U v, memory_order) {
  const T old = a->value;
  a->value = old + static_cast<T>(v);
  return old;
}
template <typename T, typename U>
void atomic_store_explicit(volatile atomic<T>* a, U v, memory_order) {
  a->value = static_cast<T>(v);
}
template <typename T>
T atomic_load_explicit(volatile atomic<T>* a, memory_order) {
  return a->value;
}
template <typename T, typename U>
T atomic_fetch_max_explicit(volatile atomic<T>* a, U v, memory_order) {
  const T old = a->value;
  if (static_cast<T>(v) > old) a->value = static_cast<T>(v);
  return old;
}

// ---- SIMD prefix sums: lane i gets the sum of the live lanes before it (inclusive: and itself)
// ----
namespace detail {
template <typename T, bool Inclusive>
void prefix_sum(const uint8_t* in, const bool* alive, uint8_t* out, size_t size, int) {
  T acc{};
  for (int lane = 0; lane < emu::kSimdWidth; ++lane) {
    T v;
    std::memcpy(&v, in + lane * size, size);
    if (!Inclusive) std::memcpy(out + lane * size, &acc, size);
    if (alive[lane]) acc = acc + v;
    if (Inclusive) std::memcpy(out + lane * size, &acc, size);
  }
}
}  // namespace detail
template <typename T>
T simd_prefix_inclusive_sum(T v) {
  T r;
  ggml_kernels::metal::emu::simd_collective(&v, &r, sizeof(T), &detail::prefix_sum<T, true>, 0,
                                            "simd_prefix_inclusive_sum");
  return r;
}
template <typename T>
T simd_prefix_exclusive_sum(T v) {
  T r;
  ggml_kernels::metal::emu::simd_collective(&v, &r, sizeof(T), &detail::prefix_sum<T, false>, 0,
                                            "simd_prefix_exclusive_sum");
  return r;
}

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

using std::is_same;
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }

}  // namespace metal

// ---- address spaces and attributes: no meaning on the CPU ----
#define device
#define constant const  // the constant address space is read-only
#define threadgroup
#define thread
#define kernel

// ---- binding a kernel's parameters (translated kernels call gk_emu_invoke) ----
namespace ggml_kernels::metal::emu {

template <typename A>
A bind(const ThreadContext& c, const Param& p) {
  if constexpr (std::is_pointer_v<A>) {
    void* ptr =
        p.kind == Param::Kind::Threadgroup ? (*c.tg_memory)[p.index] : (*c.buffers)[p.index];
    return reinterpret_cast<A>(ptr);
  } else if constexpr (std::is_reference_v<A>) {
    return *reinterpret_cast<std::remove_reference_t<A>*>((*c.buffers)[p.index]);
  } else {
    const uint32_t* v = nullptr;
    uint32_t scalar = 0;
    switch (p.index) {
      case kThreadgroupPositionInGrid: v = c.tgpig; break;
      case kThreadPositionInThreadgroup: v = c.tpitg; break;
      case kThreadPositionInGrid: v = c.tpig; break;
      case kThreadsPerThreadgroup: v = c.ntg; break;
      case kThreadgroupsPerGrid: v = c.ntgp; break;
      case kSimdgroupIndexInThreadgroup: scalar = c.simdgroup; break;
      case kThreadIndexInSimdgroup: scalar = c.lane; break;
      case kSimdgroupsPerThreadgroup: scalar = c.simdgroups; break;
      case kThreadIndexInThreadgroup: scalar = c.index; break;
      case kThreadsPerSimdgroup: scalar = kSimdWidth; break;
    }
    if constexpr (::metal::is_vec<A>::value) {
      A r;
      for (int i = 0; i < A::size; ++i)
        r.v[i] = static_cast<typename A::value_type>(v ? v[i] : scalar);
      return r;
    } else {
      return static_cast<A>(v ? v[0] : scalar);
    }
  }
}

template <typename... A, size_t... I>
void invoke_impl(void (*f)(A...), const ThreadContext& c, const Param* p,
                 std::index_sequence<I...>) {
  f(bind<A>(c, p[I])...);
}
template <typename... A>
void invoke(void (*f)(A...), const ThreadContext& c, const Param* p) {
  invoke_impl(f, c, p, std::index_sequence_for<A...>{});
}

}  // namespace ggml_kernels::metal::emu

// A kernel-scope `threadgroup T x[N];`: a reference to the running threadgroup's shared array.
template <typename A>
A& gk_threadgroup_local(int id) {
  return *static_cast<A*>(ggml_kernels::metal::emu::threadgroup_local(id, sizeof(A)));
}

// A function constant: a per-thread global the executor sets before each dispatch.
#define GK_FUNCTION_CONSTANT(TYPE, NAME, INDEX)                        \
  static thread_local TYPE NAME;                                       \
  static ggml_kernels::metal::emu::ConstantRegistrar NAME##_registrar( \
      (INDEX), [](int32_t value) { NAME = static_cast<TYPE>(value); });

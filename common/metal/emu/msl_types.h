// MSL's scalar and vector types for the translated kernels (msl.h): half, bfloat, vec<T, N> and
// its named types, packed vectors, matrices, select.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

}  // namespace metal

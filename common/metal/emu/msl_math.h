// MSL's math for the translated kernels (msl.h): element-wise functions of scalars and vectors,
// precise:: and fast:: variants, constants, as_type, isfinite / isnan / isinf.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "msl_types.h"

namespace metal {

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

using std::is_same;
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }

}  // namespace metal

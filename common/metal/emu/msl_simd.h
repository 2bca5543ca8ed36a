// MSL's SIMD-group functions and barriers for the translated kernels (msl.h): each is a
// rendezvous point of emu_runtime.h (barriers, shuffles, reductions, prefix sums), plus atomics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emu_runtime.h"
#include "msl_types.h"

namespace metal {

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

}  // namespace metal

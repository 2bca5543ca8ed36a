// The Metal Shading Language as C++, for upstream's kernels translated by
// tools/build/metal_translate.py: scalar and vector types, half, address spaces, math, SIMD-group
// collectives and barriers (rendezvous points of emu_runtime.h), `as_type`, and the binding of a
// kernel's parameters to a dispatch's buffers, threadgroup memory and thread-position builtins.
// Grows with the kernel files translated (see metal_translate.KERNEL_FILES).
// By topic: msl_types.h, msl_math.h, msl_simd.h, msl_simdgroup_matrix.h; here the address
// spaces and the binding of a kernel's parameters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "emu_runtime.h"
#include "msl_math.h"
#include "msl_simd.h"
#include "msl_simdgroup_matrix.h"
#include "msl_types.h"

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

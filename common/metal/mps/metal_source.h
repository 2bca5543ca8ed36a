// Upstream's Metal shader source, embedded at build time (tools/build/metal_source.py generates
// the definitions into the cache from the pinned sources: nothing of it is in the repository).
// One "kind" per upstream kernel file: its text with its includes resolved, cut into segments that
// kinds share; the layer joins a kind's segments and compiles them at the first use of one of its
// kernels.
#pragma once

namespace ggml_kernels::metal_source {

struct Kind {
  const char* name;             // upstream's file name without ".metal" ("norm", "mul_mv")
  const char* const* segments;  // the source is their concatenation, in order
  int count;
};

struct Kernel {
  const char* name;  // a function name of the compiled library ([[host_name]] or plain kernel)
  int kind;          // index into kKinds
};

extern const Kind kKinds[];
extern const int kKindCount;
extern const Kernel kKernels[];  // sorted by name
extern const int kKernelCount;

}  // namespace ggml_kernels::metal_source

// The emulated Metal device's runtime: upstream's kernels (translated to C++ by
// tools/build/metal_translate.py, on msl.h) run on the CPU, each GPU thread of a threadgroup a
// fiber. Threadgroup barriers and SIMD-group collectives are rendezvous points: a fiber reaching
// one yields, and when every live thread of its threadgroup (barrier) or SIMD group (collective)
// has arrived at the same kind of point, the results are computed in lane order and all resume. The
// order in which runnable lanes are resumed is a parameter (forward or reverse within each SIMD
// group): a kernel whose results differ between the two relies on lock-step execution, which
// Metal does not promise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace ggml_kernels::metal::emu {

constexpr int kSimdWidth = 32;

// Where a kernel's parameter comes from (parsed from its [[attribute]] by the translator).
struct Param {
  enum class Kind { Buffer, Threadgroup, Builtin } kind;
  int index;  // buffer / threadgroup index, or a Builtin
};
enum Builtin : int {
  kThreadgroupPositionInGrid,
  kThreadPositionInThreadgroup,
  kThreadPositionInGrid,
  kThreadsPerThreadgroup,
  kThreadgroupsPerGrid,
  kSimdgroupIndexInThreadgroup,
  kThreadIndexInSimdgroup,
  kSimdgroupsPerThreadgroup,
  kThreadIndexInThreadgroup,
  kThreadsPerSimdgroup,
};

// One thread's view of a dispatch: where its arguments are and who it is.
struct ThreadContext {
  const std::vector<void*>* buffers;    // by buffer index (args bytes included)
  const std::vector<void*>* tg_memory;  // threadgroup memory, by threadgroup index
  uint32_t tgpig[3], tpitg[3], tpig[3], ntg[3], ntgp[3];
  uint32_t simdgroup, lane, simdgroups, index;
};

using KernelEntry = void (*)(const ThreadContext&);

// Kernels by [[host_name]], and function-constant setters by index, filled by the translated
// translation units' static registrars.
struct KernelInfo {
  KernelEntry entry;
  const char* file;
};
std::map<std::string, KernelInfo>& kernels();
using ConstantSetter = void (*)(int32_t value);
std::multimap<int32_t, ConstantSetter>& constant_setters();

struct KernelRegistrar {
  KernelRegistrar(const char* name, KernelEntry entry, const char* file) {
    kernels()[name] = KernelInfo{entry, file};
  }
};
struct ConstantRegistrar {
  ConstantRegistrar(int32_t index, ConstantSetter set) { constant_setters().emplace(index, set); }
};

// The thread context of the fiber running now.
const ThreadContext& current();

// Rendezvous: every live lane of the calling SIMD group passes `value` (size bytes); when all have
// arrived, reduce(values by lane, lanes alive, out by lane) fills each lane's result.
using Reduce = void (*)(const uint8_t* in, const bool* alive, uint8_t* out, size_t size, int arg);
void simd_collective(const void* value, void* result, size_t size, Reduce reduce, int arg,
                     const char* what);
void threadgroup_barrier();

// Storage of `bytes` shared by every thread of the running threadgroup, for a kernel-scope
// `threadgroup T x[N];` declaration (`id` unique per declaration in its translation unit); filled
// with 0xff when first asked for (threadgroup memory starts undefined on a GPU).
void* threadgroup_local(int id, size_t bytes);

// Lane order in which runnable fibers resume: forward or reverse within each SIMD group.
enum class Schedule { Forward, Reverse };
void set_schedule(Schedule s);
Schedule schedule();

// Whether the convergence points the translator puts around lane-0 branches are met (default) or
// skipped: without them, upstream's kernels that rely on lock-step give schedule-dependent results
// (tests show it).
void set_lane_zero_convergence(bool on);
bool lane_zero_convergence();

// Runs one threadgroup of `entry`: threads fibers of the given context template. Throws
// std::runtime_error naming `kernel` on a deadlock (lanes at different rendezvous points).
void run_threadgroup(KernelEntry entry, const char* kernel, ThreadContext base, uint32_t threads);

// A dispatch with its arguments resolved to host memory: what any device layer over this emulator
// (ours over virtual buffers, or a fake Metal framework over host buffers) hands it to run.
struct Launch {
  std::string kernel;                        // the [[host_name]]
  std::map<int32_t, int32_t> constants;      // function-constant index -> value (others read 0)
  std::vector<void*> buffers;                // argument index -> host memory (inline bytes too)
  std::map<int, size_t> threadgroup_memory;  // threadgroup argument index -> bytes
  uint32_t grid[3];                          // threadgroups
  uint32_t threads[3];                       // threads per threadgroup
};

// Whether a kernel of that [[host_name]] is translated (and so can run here).
bool has_kernel(const std::string& name);

// Runs a launch threadgroup by threadgroup. Throws std::runtime_error naming the kernel (unknown,
// not translated yet, deadlocked). Returns the most bytes a threadgroup wrote past the end of its
// threadgroup memory (into a guard zone; on a GPU, undefined behaviour), 0 when none did.
size_t run(const Launch& launch);

}  // namespace ggml_kernels::metal::emu

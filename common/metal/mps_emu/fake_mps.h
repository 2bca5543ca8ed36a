// The fake Metal framework's own C++ API (Linux only): what the twin's glue, tests and the fake
// MPS stream call besides Metal itself (which they reach through metal-cpp, as on a Mac).
//
// The framework registers Objective-C classes with the GNU runtime (libobjc4) whose methods record
// every call, check what a real Metal runtime refuses, and run each committed dispatch on the
// emulated device (emu_runtime.h). A refusal is a `fake_metal::Misuse` exception thrown out of the
// offending metal-cpp call: a caller turns it into a Python error; nothing aborts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace MTL {
class Buffer;
}

namespace fake_metal {

// What a real Metal runtime refuses (its validation layer asserts, or the process crashes or
// deadlocks): encoder used after endEncoding, argument index over 30, threadgroup memory over the
// device's limit, an object released twice or messaged after its release, a selector the fake does
// not implement, a re-entrant dispatch onto the stream's queue, ...
class Misuse : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The device's limits (an Apple7+-like GPU, as the emulated device's properties).
constexpr size_t kMaxThreadgroupMemory = 32768;
// A test hook of the fake framework only: set to a byte count in 1..kMaxThreadgroupMemory, it is
// the threadgroup memory setThreadgroupMemoryLength and dispatches may use, while the device goes
// on reporting kMaxThreadgroupMemory (maxThreadgroupMemoryLength), so that upstream's host code,
// which checks its own sizes against the reported limit, encodes and the fake refuses: what a GPU
// with less threadgroup memory than the host code assumed would do. Read at every check (a test can
// set and lift it within a process); any other value is refused at the check, naming the variable.
constexpr const char* kThreadgroupMemoryLimitEnv = "GGML_KERNELS_FAKE_METAL_THREADGROUP_MEMORY";
constexpr size_t kBufferSlots = 31;          // argument indices 0..30
constexpr size_t kMaxSetBytesLength = 4096;  // setBytes is for small constant data
constexpr size_t kMaxThreadsPerThreadgroup = 1024;

// An MTL::Buffer over `length` bytes of host memory the caller owns (on a Mac, an MPS tensor's
// storage data() *is* its id<MTLBuffer>). Returned retained (+1): the caller releases it; the
// memory must outlive every command buffer that uses it. `private_storage`: like an MPS tensor's
// buffer, contents() is nullptr (the host cannot read private GPU memory); dispatches still run on
// the memory.
MTL::Buffer* wrap_host_memory(void* data, size_t length, bool private_storage = true);

// The buffer of a twin "MPS tensor": a CPU tensor's storage, `length` bytes at `data`. Made
// (private storage) at the first call for that storage and kept by the fake for later calls, as on
// a Mac, where the storage owns its buffer: not retained for the caller, not counted by
// live_objects(). A call for the same address with another length replaces it.
MTL::Buffer* storage_buffer(void* data, size_t length);

// Every message the fake received since the last reset (the first kMaxCalls), one line each, with
// its arguments where they say something:
// "-[MTLBuffer contents]", "+[NSString stringWithCString:encoding:] \"name\"", ...
constexpr size_t kMaxCalls = 200000;
std::vector<std::string> calls();
void reset_calls();

// One committed dispatch as it ran.
struct DispatchRecord {
  std::string kernel;
  std::map<int32_t, int32_t> constants;
  uint32_t grid[3], threads[3];
  std::map<int, size_t> buffer_offsets;      // argument index -> offset in its buffer
  std::map<int, size_t> bytes_lengths;       // argument index -> setBytes length
  std::map<int, size_t> threadgroup_memory;  // threadgroup index -> bytes
  size_t threadgroup_overrun = 0;  // bytes the kernel wrote past its threadgroup memory (emulator)
};
// The dispatches since the last reset (the first kMaxDispatches) and, of all, the most bytes each
// kernel wrote past its threadgroup memory (kernels that wrote none are absent).
constexpr size_t kMaxDispatches = 20000;
std::vector<DispatchRecord> dispatches();
std::map<std::string, size_t> threadgroup_overruns();
void reset_dispatches();

// The emulator's lane schedule (emu_runtime.h): a SIMD group's lanes run forward or in reverse
// between rendezvous points; lane_zero_convergence: the rendezvous around `if (lane == 0)` blocks.
void set_lane_schedule(bool reverse, bool lane_zero_convergence);

// Objects alive now, by class ("MTLBuffer": 2, ...). Taken before and after a call, the difference
// is what the call leaked (autoreleased objects count until their pool drains).
std::map<std::string, int> live_objects();
// Throws Misuse naming the classes whose counts grew since `before` ("leaked across a call").
void check_no_leaks(const std::map<std::string, int>& before, const char* what);

// The hash (FNV-1a, 64 bits) of the source text of the last library made with
// newLibraryWithSource, and how many were made.
uint64_t last_library_source_hash();
int libraries_made();

}  // namespace fake_metal

// The diagnostics above as JSON, for callers without C++ (Python's ctypes): each writes its text
// into out (at most capacity bytes, NUL-terminated) and returns the length the whole text needs.
extern "C" {
// ["-[MTLBuffer contents]", ...]
size_t gk_fake_metal_calls_json(char* out, size_t capacity);
// [{"kernel": ..., "constants": {"600": 2}, "grid": [x, y, z], "threads": [...],
//   "buffer_offsets": {"1": 0}, "bytes": {"0": 112}, "threadgroup_memory": {"0": 256},
//   "threadgroup_overrun": 0}, ...]
size_t gk_fake_metal_dispatches_json(char* out, size_t capacity);
// {"MTLBuffer": 2, ...}
size_t gk_fake_metal_live_objects_json(char* out, size_t capacity);
// {"kernel_...": bytes written past its threadgroup memory, ...} since the last reset
size_t gk_fake_metal_overruns_json(char* out, size_t capacity);
// Forgets the calls and dispatches recorded so far.
void gk_fake_metal_reset(void);
// the emulator's lane schedule, as gk_metal_set_lane_schedule (metal_emu_api.h's GK_METAL_LANES_*)
void gk_fake_metal_set_lane_schedule(int flags);
}

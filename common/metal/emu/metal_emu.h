// The emulated device's implementation of upstream's Metal device layer (ggml-metal-device.h and
// ggml-metal-context.h), the part upstream writes in Objective-C: the functions listed in
// metal_device_api.h, in emu_device.cpp and emu_context.cpp. Upstream's C++ host code
// (ggml-metal.cpp, -ops.cpp, -device.cpp, -common.cpp, -fusion.cpp, -tuning.cpp) is compiled
// unmodified against it; it decides every kernel, grid, function constant and threadgroup memory
// size, and reaches the device only through the functions declared there.
//
// This core holds no Apple type. A device is described by properties (an Apple7+-like GPU), a
// pipeline by its kernel name and function-constant values, a buffer by a virtual address range
// that is not a host pointer (host code that dereferences a tensor's data fails, as it would on a
// private GPU buffer), and the work of a command buffer by the dispatches its encoders record. What
// runs a dispatch is an executor behind `Executor`: on Linux every dispatch is logged (kernel
// choices, grids and bindings, for tests and `metal_dispatches()`) and then run by the emulated
// device (emu_executor.cpp: upstream's shaders translated to C++, emu_runtime.h). A device layer on
// Metal itself implements the same metal_device_api.h with objects of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "device_core.h"  // what every device layer does the same way
#include "ggml-metal-device.h"
#include "metal_device_api.h"  // the C API of every device layer: the dispatch log
#include "metal_emu_api.h"     // the emulator's instrumentation

namespace ggml_kernels::metal {

// Function constants as the host set them (device_core.h: the same in every device layer).
using Constant = device_core::Constant;
using Constants = device_core::Constants;

// One buffer binding or inline-bytes argument of a dispatch, by argument index.
struct Binding {
  uint64_t buffer = 0;  // the buffer's id (0: inline bytes)
  size_t offset = 0;
  std::vector<uint8_t> bytes;  // set_bytes: the argument struct as the host filled it
};

// One dispatch as upstream's host code encoded it.
struct Dispatch {
  std::string kernel;    // the [[host_name]] (pipeline base name)
  std::string pipeline;  // base name + function-constant suffix
  Constants constants;
  int grid[3];                               // threadgroups
  int threads[3];                            // threads per threadgroup
  std::map<int, Binding> bindings;           // argument index -> buffer or bytes
  std::map<int, size_t> threadgroup_memory;  // threadgroup argument index -> bytes
  // Found by running it: the most bytes a threadgroup wrote past the end of its threadgroup
  // memory (into the emulator's guard zone; on a GPU, undefined behaviour).
  size_t threadgroup_overrun = 0;
};

// What runs the dispatches of a command buffer, in encoding order (a barrier separates dependent
// ones; a recorder ignores it, an executor must respect it).
class Executor {
 public:
  virtual ~Executor() = default;
  virtual void dispatch(const Dispatch& d) = 0;
  virtual void barrier() {}
};

// The dispatch log (device_core.h's), fed as an executor: every dispatch in full.
class DispatchLog : public Executor, public device_core::RecordLog<Dispatch> {
 public:
  static DispatchLog& instance();
  void dispatch(const Dispatch& d) override { add(d, d.kernel, d.grid); }
};

}  // namespace ggml_kernels::metal

// The device-layer objects upstream's host code holds by pointer (opaque to it).
struct ggml_metal_cv {
  ggml_kernels::metal::Constants constants;
};

struct ggml_metal_pipeline {
  std::string kernel, name;
  ggml_kernels::metal::Constants constants;
  int max_threads_per_threadgroup = 1024;
};

struct ggml_metal_library {
  ggml_metal_device* device = nullptr;
  std::mutex mutex;
  std::unordered_map<std::string, std::unique_ptr<ggml_metal_pipeline>> pipelines;
};

struct ggml_metal_device {
  ggml_metal_device_props props;  // first: the supports_op slice reads dev->props
  std::unique_ptr<ggml_metal_library> library;
  struct ggml_metal_fusion_info* fusion = nullptr;
};

// A device buffer: `size` bytes at virtual address `base`, held in host memory `host` (the
// emulator's view of it; nothing upstream sees that pointer).
struct ggml_metal_buffer {
  uint64_t id = 0;
  uintptr_t base = 0;
  size_t size = 0;
  std::unique_ptr<uint8_t[]> host;
};

namespace ggml_kernels::metal {
// The buffer holding virtual address `addr` (for `size` bytes), or nullptr.
ggml_metal_buffer* find_buffer(uintptr_t addr, size_t size);
ggml_metal_buffer* find_buffer_by_id(uint64_t id);
// Runs a dispatch on the emulated device (emu_executor.cpp); throws std::runtime_error. Returns
// the most bytes a threadgroup wrote past its threadgroup memory (0: none).
size_t run_dispatch(const Dispatch& d);
// Whether dispatches run on the emulated device after being logged (default) or are only logged.
void set_execute(bool execute);
bool execute();
// Host memory behind a virtual address range of a buffer; throws when out of its range.
uint8_t* host_address(ggml_metal_buffer* buf, uintptr_t addr, size_t size);
}  // namespace ggml_kernels::metal

// A command buffer: the encoders made on it send their dispatches to `executor`.
struct ggml_metal_command_buffer {
  ggml_kernels::metal::Executor* executor = nullptr;
};

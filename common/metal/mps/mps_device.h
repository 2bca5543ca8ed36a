// ggml-kernels' implementation of upstream's Metal device layer (ggml-metal-device.h and
// ggml-metal-context.h, the part upstream writes in Objective-C) over metal-cpp, on torch's MPS
// device and stream. Upstream's six C++ host files are compiled unmodified against it; they choose
// every kernel, grid, function constant and threadgroup memory size.
//
// What differs from upstream's Objective-C, and why:
//   - no command queue or command buffer of its own: a graph is encoded on the compute command
//     encoder of torch's current MPS stream, inside the stream's serial queue (mps_platform.h), and
//     torch commits it, so ggml's work is ordered with torch's on the same stream;
//   - buffers are the MPS tensors' own Metal buffers, wrapped without a copy at a virtual address
//     range of their own (ggml_metal_buffer_map with an MTL::Buffer*; see mps_device.cpp), or
//     buffers this layer allocates (ggml_metal_buffer_init, shared storage: what ggml's own buffer
//     type gives, which llama.cpp's test-backend-ops fills and reads back through the host);
//   - pipelines come from upstream's .metal source embedded at build time (metal_source.h),
//     compiled at the first use of a kernel one upstream file at a time, cached by name with their
//     function constants;
//   - no residency sets, events, capture or tensor API (has_tensor off, as on the emulated device,
//     so a Mac runs the kernels the emulator checked).
//
// This header holds the objects upstream's host code holds by pointer. The supports_op slice cut
// from ggml-metal-device.m at build time reads `dev->props` through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ggml-metal-device.h"

namespace MTL {
class Buffer;
class ComputeCommandEncoder;
class ComputePipelineState;
class Device;
class FunctionConstantValues;
class Library;
}  // namespace MTL

namespace ggml_kernels::mps {

// A function-constant value as the host set it: index -> (type, value). Kept beside the Metal
// object so that pipelines are cached by name *and* constants.
struct Constant {
  enum class Kind { Bool, Int16, Int32 } kind;
  int32_t value;
  bool operator==(const Constant& o) const { return kind == o.kind && value == o.value; }
};
using Constants = std::map<int32_t, Constant>;

// The message of the last failure of this layer on this thread ("" when none).
std::string& last_error();

// One dispatch as upstream's host code encoded it, for the dispatch log of metal_device_api.h's
// C API (what tests compare with the emulated device's choices).
struct DispatchRecord {
  const ggml_metal_pipeline* pipeline = nullptr;
  int grid[3] = {0, 0, 0};
  int threads[3] = {0, 0, 0};
  std::map<int, std::pair<const MTL::Buffer*, size_t>>
      buffers;                               // argument index -> (buffer, offset)
  std::map<int, size_t> bytes;               // argument index -> setBytes length
  std::map<int, size_t> threadgroup_memory;  // threadgroup index -> bytes
};

// The dispatches since the last reset: the first kMaxRecords in full, threadgroups per kernel of
// all (a model's run makes many more).
class DispatchLog {
 public:
  static constexpr size_t kMaxRecords = 20000;
  static DispatchLog& instance();
  void add(const DispatchRecord& d);
  std::string records_json() const;
  std::string threadgroups_json() const;
  void reset();

 private:
  mutable std::mutex mutex_;
  std::vector<DispatchRecord> records_;
  std::map<std::string, int64_t> threadgroups_;
};

}  // namespace ggml_kernels::mps

struct ggml_metal_cv {
  MTL::FunctionConstantValues* obj = nullptr;
  ggml_kernels::mps::Constants constants;
};

struct ggml_metal_pipeline {
  MTL::ComputePipelineState* obj = nullptr;
  std::string kernel;  // the [[host_name]] it was built from
  std::string name;    // upstream's: kernel and constant values
  ggml_kernels::mps::Constants constants;
};

struct ggml_metal_library {
  ggml_metal_device* device = nullptr;
  std::mutex mutex;
  std::vector<MTL::Library*> kinds;  // one per upstream kernel file, compiled at first use
  std::unordered_map<std::string, ggml_metal_pipeline*> pipelines;  // by name (upstream's)
};

struct ggml_metal_device {
  ggml_metal_device_props props;  // first: the supports_op slice reads dev->props
  MTL::Device* mtl = nullptr;     // torch's device (not owned)
  ggml_metal_library* library = nullptr;
  struct ggml_metal_fusion_info* fusion = nullptr;
};

// A device buffer: the first `size` bytes of `mtl`, seen by ggml at the virtual address range
// [base, base + size), which is never host memory (byte i of mtl is address base + i).
struct ggml_metal_buffer {
  MTL::Buffer* mtl = nullptr;
  bool owned = false;  // allocated here (released by ggml_metal_buffer_free) or an MPS tensor's
  uintptr_t base = 0;
  size_t size = 0;
};

// What upstream's host code takes as a command buffer (ggml_metal_cmd_buf_t): the stream's
// encoder for one graph.
struct ggml_metal_command_buffer {
  MTL::ComputeCommandEncoder* encoder = nullptr;
};

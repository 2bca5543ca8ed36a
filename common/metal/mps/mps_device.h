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

#include "device_core.h"  // what every device layer does the same way
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

// Function constants as the host set them, kept beside the Metal object so that pipelines are
// cached by name *and* constants (device_core.h: the same in every device layer).
using Constant = device_core::Constant;
using Constants = device_core::Constants;

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

// The dispatch log (device_core.h's) of this layer's records.
class DispatchLog : public device_core::RecordLog<DispatchRecord> {
 public:
  static DispatchLog& instance();
  void add(const DispatchRecord& d);
  // The emulated device's record format; a buffer is numbered by its first appearance in the log.
  std::string records_json() const;
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

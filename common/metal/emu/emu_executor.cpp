// The emulated device's executor for our device layer: resolves a dispatch's buffer bindings
// (buffer ids + offsets) to the buffers' host memory and runs it on the emulator (emu_runtime.h).
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "emu_runtime.h"
#include "metal_emu.h"

namespace ggml_kernels::metal {

size_t run_dispatch(const Dispatch& d) {
  emu::Launch launch;
  launch.kernel = d.kernel;
  for (const auto& [index, c] : d.constants) launch.constants[index] = c.value;
  // arguments by index: buffers at their offsets, inline bytes
  int max_index = -1;
  for (const auto& [index, b] : d.bindings) max_index = std::max(max_index, index);
  launch.buffers.assign(max_index + 1, nullptr);
  std::vector<std::vector<uint8_t>> bytes;  // copies the kernels read (8-byte aligned by vector)
  bytes.reserve(d.bindings.size());
  for (const auto& [index, b] : d.bindings) {
    if (!b.bytes.empty()) {
      bytes.push_back(b.bytes);
      launch.buffers[index] = bytes.back().data();
    } else if (b.buffer != 0) {
      ggml_metal_buffer* buf = find_buffer_by_id(b.buffer);
      if (buf == nullptr)
        throw std::runtime_error("Metal emulator: a dispatch binds a freed buffer");
      launch.buffers[index] = buf->host.get() + b.offset;
    }
  }
  launch.threadgroup_memory = d.threadgroup_memory;
  for (int i = 0; i < 3; ++i)
    launch.grid[i] = static_cast<uint32_t>(d.grid[i]),
    launch.threads[i] = static_cast<uint32_t>(d.threads[i]);
  return emu::run(launch);
}

}  // namespace ggml_kernels::metal

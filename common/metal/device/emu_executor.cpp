// The emulated device's executor: runs each dispatch's kernel (translated from upstream's .metal
// sources, registered by [[host_name]]) on the CPU, threadgroup by threadgroup.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "emu_runtime.h"
#include "metal_emu.h"

namespace ggml_kernels::metal {

namespace emu {
// Generated at build time (metal_runtime.py): the kernels of upstream's files not translated yet.
extern const char* const kUntranslatedKernels[];
}  // namespace emu

namespace {

bool untranslated(const std::string& kernel) {
  for (const char* const* name = emu::kUntranslatedKernels; *name != nullptr; ++name)
    if (kernel == *name) return true;
  return false;
}

// Every function constant back to zero, then the pipeline's values (what a pipeline compiled with
// those constants sees).
void set_constants(const Constants& constants) {
  for (auto& [index, set] : emu::constant_setters()) set(0);
  for (const auto& [index, c] : constants) {
    auto [first, last] = emu::constant_setters().equal_range(index);
    for (auto it = first; it != last; ++it) it->second(c.value);
  }
}

// The guard zone after each threadgroup-memory block: a kernel that writes past its threadgroup
// memory (upstream's fa_vec kernels do for some head sizes) writes here, not into the heap.
constexpr size_t kGuardBytes = 4096;
constexpr uint8_t kGuardByte = 0xa5;

// How far into the guard zone at `guard` a threadgroup wrote.
size_t bytes_past_end(const uint8_t* guard) {
  for (size_t i = kGuardBytes; i > 0; --i)
    if (guard[i - 1] != kGuardByte) return i;
  return 0;
}

}  // namespace

size_t run_dispatch(const Dispatch& d) {
  const auto found = emu::kernels().find(d.kernel);
  if (found == emu::kernels().end()) {
    if (untranslated(d.kernel))
      throw std::runtime_error(
          "Metal emulator: kernel " + d.kernel +
          " is not translated yet (tools/build/metal_translate.py KERNEL_FILES)");
    throw std::runtime_error("upstream's Metal library has no kernel " + d.kernel +
                             ": its host code asked for a pipeline no .metal file defines (on a "
                             "Mac, compiling it fails)");
  }
  set_constants(d.constants);
  // arguments by index: buffers at their offsets, inline bytes
  int max_index = -1;
  for (const auto& [index, b] : d.bindings) max_index = std::max(max_index, index);
  std::vector<void*> buffers(max_index + 1, nullptr);
  std::vector<std::vector<uint8_t>> bytes;  // copies the kernels read (8-byte aligned by vector)
  bytes.reserve(d.bindings.size());
  for (const auto& [index, b] : d.bindings) {
    if (!b.bytes.empty()) {
      bytes.push_back(b.bytes);
      buffers[index] = bytes.back().data();
    } else if (b.buffer != 0) {
      ggml_metal_buffer* buf = find_buffer_by_id(b.buffer);
      if (buf == nullptr)
        throw std::runtime_error("Metal emulator: a dispatch binds a freed buffer");
      buffers[index] = buf->host.get() + b.offset;
    }
  }
  // threadgroup memory: exactly the sizes the host set, filled with a NaN pattern (it starts
  // undefined on a GPU), each followed by a guard zone that shows writes past its end
  int max_tg = -1;
  for (const auto& [index, size] : d.threadgroup_memory) max_tg = std::max(max_tg, index);
  std::vector<std::unique_ptr<uint8_t[]>> tg_blocks;
  std::vector<void*> tg_memory(max_tg + 1, nullptr);
  const uint32_t threads = d.threads[0] * d.threads[1] * d.threads[2];
  emu::ThreadContext base{};
  base.buffers = &buffers, base.tg_memory = &tg_memory;
  for (int i = 0; i < 3; ++i) base.ntg[i] = d.threads[i], base.ntgp[i] = d.grid[i];
  size_t overrun = 0;
  for (int z = 0; z < d.grid[2]; ++z) {
    for (int y = 0; y < d.grid[1]; ++y) {
      for (int x = 0; x < d.grid[0]; ++x) {
        tg_blocks.clear();
        for (const auto& [index, size] : d.threadgroup_memory) {
          tg_blocks.emplace_back(new uint8_t[size + kGuardBytes]);
          std::memset(tg_blocks.back().get(), 0xff, size);
          std::memset(tg_blocks.back().get() + size, kGuardByte, kGuardBytes);
          tg_memory[index] = tg_blocks.back().get();
        }
        base.tgpig[0] = x, base.tgpig[1] = y, base.tgpig[2] = z;
        emu::run_threadgroup(found->second.entry, d.kernel.c_str(), base, threads);
        size_t block = 0;
        for (const auto& [index, size] : d.threadgroup_memory)
          overrun = std::max(overrun, bytes_past_end(tg_blocks[block++].get() + size));
      }
    }
  }
  return overrun;
}

}  // namespace ggml_kernels::metal

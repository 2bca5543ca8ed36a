// The device functions of upstream's ggml-metal-device.h that upstream implements in Objective-C,
// for an Apple7+-like device whose buffers are virtual address ranges and whose command buffers
// hand their dispatches to an Executor (metal_emu.h).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-metal-fusion.h"
#include "metal_emu.h"

using namespace ggml_kernels::metal;

namespace {

// Buffers live at non-canonical x86-64 addresses (bit 62 set, bit 63 clear: outside user space with
// 4- and 5-level paging alike), one 2^40-byte slot per buffer, so a host dereference of a tensor's
// data faults instead of reading memory.
constexpr uintptr_t kVirtualBase = uintptr_t{1} << 62;
constexpr size_t kSlot = size_t{1} << 40;

struct BufferRegistry {
  std::mutex mutex;
  std::map<uintptr_t, ggml_metal_buffer*> by_base;
  uint64_t next_id = 1;
};

BufferRegistry& registry() {
  static BufferRegistry r;
  return r;
}

ggml_metal_device_props emulated_props(int device) {
  ggml_metal_device_props p{};
  p.device = device;
  std::snprintf(p.name, sizeof(p.name), "MTL%d", device);
  std::snprintf(p.desc, sizeof(p.desc), "ggml-kernels emulated Metal device (Apple7+ features)");
  p.max_buffer_size = size_t{1} << 36;
  p.max_working_set_size = size_t{1} << 36;
  p.max_theadgroup_memory_size = 32768;
  p.has_simdgroup_reduction = true;
  p.has_simdgroup_mm = true;
  p.has_unified_memory = false;
  p.has_bfloat = true;
  p.has_tensor = false;  // so a Mac runs the kernels that were emulated
  p.use_residency_sets = false;
  p.use_shared_buffers = false;  // private storage: tensor data are device addresses
  p.supports_gpu_family_apple7 = true;
  p.device_id = GGML_METAL_DEVICE_GENERIC;
  p.gpu_family = 7;
  const char* batch = std::getenv("GGML_OP_OFFLOAD_MIN_BATCH");
  p.op_offload_min_batch_size = batch ? std::atoi(batch) : 32;
  return p;
}

void set_constant(ggml_metal_cv_t cv, int32_t idx, Constant::Kind kind, int32_t value) {
  cv->constants[idx] = Constant{kind, value};
}

}  // namespace

namespace ggml_kernels::metal {

DispatchLog& DispatchLog::instance() {
  static DispatchLog log;
  return log;
}

ggml_metal_buffer* find_buffer(uintptr_t addr, size_t size) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_base.upper_bound(addr);
  if (it == r.by_base.begin()) return nullptr;
  --it;
  ggml_metal_buffer* buf = it->second;
  return addr - buf->base + size <= buf->size ? buf : nullptr;
}

ggml_metal_buffer* find_buffer_by_id(uint64_t id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [base, buf] : r.by_base)
    if (buf->id == id) return buf;
  return nullptr;
}

uint8_t* host_address(ggml_metal_buffer* buf, uintptr_t addr, size_t size) {
  if (addr < buf->base || addr - buf->base + size > buf->size) {
    throw std::out_of_range("ggml-kernels Metal: an access outside its device buffer");
  }
  return buf->host.get() + (addr - buf->base);
}

}  // namespace ggml_kernels::metal

extern "C" {

// ---- function constants and pipelines ----

ggml_metal_cv_t ggml_metal_cv_init(void) { return new ggml_metal_cv(); }
void ggml_metal_cv_free(ggml_metal_cv_t cv) { delete cv; }
void ggml_metal_cv_set_int16(ggml_metal_cv_t cv, int16_t value, int32_t idx) {
  set_constant(cv, idx, Constant::Kind::Int16, value);
}
void ggml_metal_cv_set_int32(ggml_metal_cv_t cv, int32_t value, int32_t idx) {
  set_constant(cv, idx, Constant::Kind::Int32, value);
}
void ggml_metal_cv_set_bool(ggml_metal_cv_t cv, bool value, int32_t idx) {
  set_constant(cv, idx, Constant::Kind::Bool, value ? 1 : 0);
}

ggml_metal_pipeline_t ggml_metal_pipeline_init(void) { return new ggml_metal_pipeline(); }
void ggml_metal_pipeline_free(ggml_metal_pipeline_t pipeline) { delete pipeline; }

int ggml_metal_pipeline_max_theads_per_threadgroup(struct ggml_metal_pipeline_with_params p) {
  return p.pipeline->max_threads_per_threadgroup;
}

// ---- library: pipelines by name, "compiled" on first use ----

ggml_metal_library_t ggml_metal_library_init(ggml_metal_device_t dev) {
  auto* lib = new ggml_metal_library();
  lib->device = dev;
  return lib;
}

ggml_metal_library_t ggml_metal_library_init_from_source(ggml_metal_device_t dev, const char*,
                                                         bool) {
  return ggml_metal_library_init(dev);
}

void ggml_metal_library_free(ggml_metal_library_t lib) { delete lib; }

struct ggml_metal_pipeline_with_params ggml_metal_library_get_pipeline(ggml_metal_library_t lib,
                                                                       const char* name) {
  std::lock_guard<std::mutex> lock(lib->mutex);
  auto it = lib->pipelines.find(name);
  ggml_metal_pipeline_with_params res{};
  res.pipeline = it == lib->pipelines.end() ? nullptr : it->second.get();
  return res;
}

struct ggml_metal_pipeline_with_params ggml_metal_library_compile_pipeline(ggml_metal_library_t lib,
                                                                           const char* base,
                                                                           const char* name,
                                                                           ggml_metal_cv_t cv) {
  std::lock_guard<std::mutex> lock(lib->mutex);
  auto& slot = lib->pipelines[name];
  if (!slot) {
    slot = std::make_unique<ggml_metal_pipeline>();
    slot->kernel = base;
    slot->name = name;
    if (cv != nullptr) slot->constants = cv->constants;
  }
  ggml_metal_pipeline_with_params res{};
  res.pipeline = slot.get();
  return res;
}

// ---- encoders: bindings collected, each dispatch handed to the command buffer's executor ----

struct ggml_metal_encoder {
  Executor* executor = nullptr;
  ggml_metal_pipeline* pipeline = nullptr;
  std::map<int, Binding> bindings;
  std::map<int, size_t> threadgroup_memory;
};

ggml_metal_encoder_t ggml_metal_encoder_init(ggml_metal_cmd_buf_t cmd_buf_raw, bool) {
  auto* enc = new ggml_metal_encoder();
  enc->executor = static_cast<ggml_metal_command_buffer*>(cmd_buf_raw)->executor;
  return enc;
}

void ggml_metal_encoder_free(ggml_metal_encoder_t encoder) { delete encoder; }

void ggml_metal_encoder_set_pipeline(ggml_metal_encoder_t encoder,
                                     struct ggml_metal_pipeline_with_params pipeline) {
  encoder->pipeline = pipeline.pipeline;
}

void ggml_metal_encoder_set_bytes(ggml_metal_encoder_t encoder, void* data, size_t size, int idx) {
  Binding b;
  b.bytes.assign(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
  encoder->bindings[idx] = std::move(b);
}

void ggml_metal_encoder_set_buffer(ggml_metal_encoder_t encoder, struct ggml_metal_buffer_id buffer,
                                   int idx) {
  Binding b;
  b.buffer = buffer.metal ? static_cast<ggml_metal_buffer*>(buffer.metal)->id : 0;
  b.offset = buffer.offs;
  encoder->bindings[idx] = std::move(b);
}

void ggml_metal_encoder_set_threadgroup_memory_size(ggml_metal_encoder_t encoder, size_t size,
                                                    int idx) {
  encoder->threadgroup_memory[idx] = size;
}

void ggml_metal_encoder_dispatch_threadgroups(ggml_metal_encoder_t encoder, int tg0, int tg1,
                                              int tg2, int tptg0, int tptg1, int tptg2) {
  GGML_ASSERT(encoder->pipeline != nullptr && "a dispatch without a pipeline");
  Dispatch d;
  d.kernel = encoder->pipeline->kernel;
  d.pipeline = encoder->pipeline->name;
  d.constants = encoder->pipeline->constants;
  d.grid[0] = tg0, d.grid[1] = tg1, d.grid[2] = tg2;
  d.threads[0] = tptg0, d.threads[1] = tptg1, d.threads[2] = tptg2;
  d.bindings = encoder->bindings;
  d.threadgroup_memory = encoder->threadgroup_memory;
  encoder->executor->dispatch(d);
}

void ggml_metal_encoder_memory_barrier(ggml_metal_encoder_t encoder) {
  encoder->executor->barrier();
}

void ggml_metal_encoder_end_encoding(ggml_metal_encoder_t) {}

// ---- events (the rest: device_core_functions.h): work completes when committed ----

void ggml_metal_device_event_synchronize(ggml_metal_device_t, ggml_metal_event_t) {}

// ---- the device ----

ggml_metal_device_t ggml_metal_device_init(int device, int) {
  auto* dev = new ggml_metal_device();
  dev->props = emulated_props(device);
  dev->library.reset(ggml_metal_library_init(dev));
  dev->fusion = ggml_metal_fusion_info_init(std::getenv("GGML_METAL_FUSION_DISABLE") == nullptr, 0);
  return dev;
}

void ggml_metal_device_free(ggml_metal_device_t dev) {
  if (dev == nullptr) return;
  ggml_metal_fusion_info_free(dev->fusion);
  delete dev;
}

void* ggml_metal_device_get_obj(ggml_metal_device_t dev) { return dev; }
void* ggml_metal_device_get_queue(ggml_metal_device_t dev) { return dev; }

ggml_metal_library_t ggml_metal_device_get_library(ggml_metal_device_t dev) {
  return dev->library.get();
}

// ---- buffers: virtual address ranges over host memory ----

ggml_metal_buffer_t ggml_metal_buffer_init(ggml_metal_device_t, size_t size, bool) {
  if (size >= kSlot) return nullptr;
  auto* buf = new ggml_metal_buffer();
  buf->size = std::max<size_t>(size, 1);
  buf->host.reset(new (std::nothrow) uint8_t[buf->size]);
  if (!buf->host) {
    delete buf;
    return nullptr;
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  buf->id = r.next_id++;
  buf->base = kVirtualBase + static_cast<uintptr_t>(buf->id) * kSlot;
  r.by_base[buf->base] = buf;
  return buf;
}

ggml_metal_buffer_t ggml_metal_buffer_map(ggml_metal_device_t, void*, size_t, size_t) {
  return nullptr;  // no host memory is shared with this device
}

void ggml_metal_buffer_free(ggml_metal_buffer_t buf) {
  if (buf == nullptr) return;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.by_base.erase(buf->base);
  }
  delete buf;
}

bool ggml_metal_buffer_is_shared(ggml_metal_buffer_t) { return false; }

void ggml_metal_buffer_memset_tensor(ggml_metal_buffer_t buf, struct ggml_tensor* tensor,
                                     uint8_t value, size_t offset, size_t size) {
  std::memset(host_address(buf, reinterpret_cast<uintptr_t>(tensor->data) + offset, size), value,
              size);
}

void ggml_metal_buffer_set_tensor(ggml_metal_buffer_t buf, struct ggml_tensor* tensor,
                                  const void* data, size_t offset, size_t size) {
  std::memcpy(host_address(buf, reinterpret_cast<uintptr_t>(tensor->data) + offset, size), data,
              size);
}

void ggml_metal_buffer_get_tensor(ggml_metal_buffer_t buf, const struct ggml_tensor* tensor,
                                  void* data, size_t offset, size_t size) {
  std::memcpy(data, host_address(buf, reinterpret_cast<uintptr_t>(tensor->data) + offset, size),
              size);
}

bool ggml_metal_buffer_cpy_tensor(ggml_metal_buffer_t buf_dst, const struct ggml_tensor* src,
                                  struct ggml_tensor* dst) {
  ggml_metal_buffer* buf_src =
      find_buffer(reinterpret_cast<uintptr_t>(src->data), ggml_nbytes(src));
  if (buf_src == nullptr) return false;
  const size_t n = ggml_nbytes(src);
  std::memcpy(host_address(buf_dst, reinterpret_cast<uintptr_t>(dst->data), n),
              host_address(buf_src, reinterpret_cast<uintptr_t>(src->data), n), n);
  return true;
}

void ggml_metal_buffer_clear(ggml_metal_buffer_t buf, uint8_t value) {
  std::memset(buf->host.get(), value, buf->size);
}

struct ggml_metal_buffer_id ggml_metal_buffer_get_id(ggml_metal_buffer_t buf,
                                                     const struct ggml_tensor* t) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(t->data);
  GGML_ASSERT(addr >= buf->base && addr - buf->base <= buf->size &&
              "a tensor outside its Metal buffer");
  return {buf, addr - buf->base};
}

}  // extern "C"

#include "device_core_functions.h"  // what every device layer defines the same way

// The device functions of upstream's ggml-metal-device.h that upstream implements in Objective-C,
// over metal-cpp on torch's MPS device (mps_device.h says what differs from upstream and why).
// The same source in every build: only mps_platform.h differs between darwin and the Linux twin.
#include "mps_device.h"

#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "ggml-metal-fusion.h"
#include "metal_source.h"
#include "mps_platform.h"

using ggml_kernels::mps::Constant;

namespace {

// ---- virtual addresses ----

// Each buffer gets a slot of 2^40 bytes in [2^62, 2^63): addresses that no host allocation has on
// the 64-bit platforms torch runs on, so a tensor's `data` can never be mistaken for host memory.
// Nothing dereferences them: upstream's host code only subtracts a buffer's base (props say the
// buffers are not shared), and this layer maps them back to (MTL::Buffer, offset). Slots are
// reused.
constexpr uintptr_t kVirtualBase = uintptr_t{1} << 62;
constexpr size_t kSlotBytes = size_t{1} << 40;
constexpr size_t kSlots = size_t{1} << 22;

struct AddressSpace {
  std::mutex mutex;
  std::map<uintptr_t, ggml_metal_buffer*> by_base;
  std::vector<size_t> free_slots;
  size_t next_slot = 0;

  void add(ggml_metal_buffer* buf) {
    std::lock_guard<std::mutex> lock(mutex);
    size_t slot;
    if (!free_slots.empty()) {
      slot = free_slots.back();
      free_slots.pop_back();
    } else if (next_slot < kSlots) {
      slot = next_slot++;
    } else {
      throw std::runtime_error("ggml-kernels MPS: more than 2^22 Metal buffers wrapped at once");
    }
    buf->base = kVirtualBase + slot * kSlotBytes;
    by_base[buf->base] = buf;
  }

  void remove(ggml_metal_buffer* buf) {
    std::lock_guard<std::mutex> lock(mutex);
    by_base.erase(buf->base);
    free_slots.push_back((buf->base - kVirtualBase) / kSlotBytes);
  }

  // The buffer holding [addr, addr + size), or nullptr.
  ggml_metal_buffer* find(uintptr_t addr, size_t size) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = by_base.upper_bound(addr);
    if (it == by_base.begin()) return nullptr;
    ggml_metal_buffer* buf = std::prev(it)->second;
    return addr - buf->base + size <= buf->size ? buf : nullptr;
  }
};

AddressSpace& address_space() {
  static AddressSpace* space = new AddressSpace();  // outlives buffers freed at exit
  return *space;
}

// ---- Foundation helpers ----

// Objective-C objects that metal-cpp's factories return autoreleased are released with it.
struct AutoreleasePool {
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  ~AutoreleasePool() { pool->release(); }
};

NS::String* ns_string(const char* text) { return NS::String::string(text, NS::UTF8StringEncoding); }

std::string describe(NS::Error* error) {
  if (error == nullptr || error->localizedDescription() == nullptr) return "(no description)";
  return error->localizedDescription()->utf8String();
}

[[noreturn]] void fail(const std::string& message) {
  ggml_kernels::mps::last_error() = message;
  throw std::runtime_error(message);
}

// ---- device properties ----

int apple_family(MTL::Device* mtl) {
  int family = 0;
  for (int f = MTL::GPUFamilyApple1; f <= MTL::GPUFamilyApple10; ++f)
    if (mtl->supportsFamily(static_cast<MTL::GPUFamily>(f))) family = f - MTL::GPUFamilyApple1 + 1;
  return family;
}

ggml_metal_device_props device_props(MTL::Device* mtl, int device) {
  AutoreleasePool pool;  // for the device's name
  ggml_metal_device_props p{};
  p.device = device;
  p.device_virt = device;
  const NS::String* name = mtl->name();
  std::snprintf(p.name, sizeof(p.name), "MTL%d", device);
  std::snprintf(p.desc, sizeof(p.desc), "%s",
                name != nullptr ? name->utf8String() : "Metal device");
  p.max_buffer_size = mtl->maxBufferLength();
  p.max_working_set_size = mtl->recommendedMaxWorkingSetSize();
  if (p.max_working_set_size == 0) p.max_working_set_size = p.max_buffer_size;
  p.max_theadgroup_memory_size = mtl->maxThreadgroupMemoryLength();
  p.gpu_family = apple_family(mtl);
  p.supports_gpu_family_apple7 = p.gpu_family >= 7;
  p.has_simdgroup_reduction = p.supports_gpu_family_apple7;
  p.has_simdgroup_mm = p.supports_gpu_family_apple7;
  p.has_bfloat = p.gpu_family >= 6 || mtl->supportsFamily(MTL::GPUFamilyMetal3);
  p.has_unified_memory = mtl->hasUnifiedMemory();
  p.has_tensor = false;          // the kernels the emulated device runs, none of the tensor API's
  p.use_residency_sets = false;  // MPS tensors' buffers are torch's to keep resident
  p.use_shared_buffers = false;  // tensor data are device addresses, never host memory
  p.device_id = GGML_METAL_DEVICE_GENERIC;
  const char* batch = std::getenv("GGML_OP_OFFLOAD_MIN_BATCH");
  p.op_offload_min_batch_size = batch ? std::atoi(batch) : 32;
  return p;
}

// ---- shader source and pipelines ----

namespace source = ggml_kernels::metal_source;

// The upstream kernel file (kind) whose library defines `kernel`, or -1.
int kind_of(const char* kernel) {
  const source::Kernel* end = source::kKernels + source::kKernelCount;
  const source::Kernel* it = std::lower_bound(
      source::kKernels, end, kernel,
      [](const source::Kernel& k, const char* name) { return std::strcmp(k.name, name) < 0; });
  return it != end && std::strcmp(it->name, kernel) == 0 ? it->kind : -1;
}

// The kind's source as the Metal compiler gets it: the device's feature macros (upstream passes
// them as preprocessor macros of the compile options), then upstream's text.
std::string kind_source(const ggml_metal_device_props& props, int kind) {
  std::string text;
  if (props.has_bfloat) text += "#define GGML_METAL_HAS_BF16 1\n";
  const source::Kind& k = source::kKinds[kind];
  for (int i = 0; i < k.count; ++i) text += k.segments[i];
  return text;
}

// The library of `kind`, compiled on first use (caller holds lib->mutex).
MTL::Library* kind_library(ggml_metal_library* lib, int kind) {
  MTL::Library*& slot = lib->kinds[kind];
  if (slot != nullptr) return slot;
  AutoreleasePool pool;
  const std::string text = kind_source(lib->device->props, kind);
  MTL::CompileOptions* options = MTL::CompileOptions::alloc()->init();
  NS::Error* error = nullptr;
  slot = lib->device->mtl->newLibrary(ns_string(text.c_str()), options, &error);
  options->release();
  if (slot == nullptr)
    fail(std::string("ggml-kernels MPS: compiling upstream's ") + source::kKinds[kind].name +
         ".metal failed: " + describe(error));
  return slot;
}

MTL::ComputePipelineState* new_pipeline_state(ggml_metal_library* lib, const char* base,
                                              const char* name, ggml_metal_cv_t cv) {
  const int kind = kind_of(base);
  if (kind < 0) fail(std::string("ggml-kernels MPS: no upstream kernel is named ") + base);
  MTL::Library* library = kind_library(lib, kind);
  AutoreleasePool pool;
  NS::Error* error = nullptr;
  MTL::Function* function = cv == nullptr ? library->newFunction(ns_string(base))
                                          : library->newFunction(ns_string(base), cv->obj, &error);
  if (function == nullptr)
    fail(std::string("ggml-kernels MPS: no function for pipeline ") + name + ": " +
         describe(error));
  MTL::ComputePipelineState* state = lib->device->mtl->newComputePipelineState(function, &error);
  function->release();
  if (state == nullptr)
    fail(std::string("ggml-kernels MPS: pipeline ") + name + " failed: " + describe(error));
  if (state->maxTotalThreadsPerThreadgroup() == 0 || state->threadExecutionWidth() == 0) {
    state->release();
    fail(std::string("ggml-kernels MPS: pipeline ") + name + " cannot run on this device");
  }
  return state;
}

void set_constant(ggml_metal_cv_t cv, int32_t idx, Constant::Kind kind, int32_t value) {
  const int16_t v16 = static_cast<int16_t>(value);
  const bool vbool = value != 0;
  switch (kind) {
    case Constant::Kind::Bool: cv->obj->setConstantValue(&vbool, MTL::DataTypeBool, idx); break;
    case Constant::Kind::Int16: cv->obj->setConstantValue(&v16, MTL::DataTypeShort, idx); break;
    case Constant::Kind::Int32: cv->obj->setConstantValue(&value, MTL::DataTypeInt, idx); break;
  }
  cv->constants[idx] = Constant{kind, value};
}

// Host memory of a buffer's bytes [addr, addr + size) when its storage is shared, after the work
// queued on the stream is done; private storage (an MPS tensor's, wrapped) has none: torch copies
// its own tensors.
uint8_t* host_bytes(ggml_metal_buffer* buf, uintptr_t addr, size_t size) {
  if (addr < buf->base || addr - buf->base + size > buf->size)
    fail("ggml-kernels MPS: an access outside its Metal buffer");
  auto* contents = static_cast<uint8_t*>(buf->mtl->contents());
  if (contents == nullptr)
    fail("ggml-kernels MPS: a Metal buffer in private storage has no host memory to copy through");
  ggml_kernels::mps::synchronize();
  return contents + (addr - buf->base);
}

uintptr_t address(const ggml_tensor* t, size_t offset = 0) {
  return reinterpret_cast<uintptr_t>(t->data) + offset;
}

}  // namespace

std::string& ggml_kernels::mps::last_error() {
  thread_local std::string message;
  return message;
}

extern "C" {

// ---- function constants and pipelines ----

ggml_metal_cv_t ggml_metal_cv_init(void) {
  auto* cv = new ggml_metal_cv();
  cv->obj = MTL::FunctionConstantValues::alloc()->init();
  return cv;
}

void ggml_metal_cv_free(ggml_metal_cv_t cv) {
  if (cv == nullptr) return;
  cv->obj->release();
  delete cv;
}

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

void ggml_metal_pipeline_free(ggml_metal_pipeline_t pipeline) {
  if (pipeline == nullptr) return;
  if (pipeline->obj != nullptr) pipeline->obj->release();
  delete pipeline;
}

int ggml_metal_pipeline_max_theads_per_threadgroup(struct ggml_metal_pipeline_with_params p) {
  return static_cast<int>(p.pipeline->obj->maxTotalThreadsPerThreadgroup());
}

// ---- library: upstream's embedded source, one library per kernel file, compiled at first use ----

ggml_metal_library_t ggml_metal_library_init(ggml_metal_device_t dev) {
  auto* lib = new ggml_metal_library();
  lib->device = dev;
  lib->kinds.assign(static_cast<size_t>(source::kKindCount), nullptr);
  return lib;
}

ggml_metal_library_t ggml_metal_library_init_from_source(ggml_metal_device_t dev, const char*,
                                                         bool) {
  return ggml_metal_library_init(dev);  // upstream's own source is what this layer compiles
}

void ggml_metal_library_free(ggml_metal_library_t lib) {
  if (lib == nullptr) return;
  for (auto& [name, pipeline] : lib->pipelines) ggml_metal_pipeline_free(pipeline);
  for (MTL::Library* library : lib->kinds)
    if (library != nullptr) library->release();
  delete lib;
}

struct ggml_metal_pipeline_with_params ggml_metal_library_get_pipeline(ggml_metal_library_t lib,
                                                                       const char* name) {
  std::lock_guard<std::mutex> lock(lib->mutex);
  auto it = lib->pipelines.find(name);
  ggml_metal_pipeline_with_params res{};
  res.pipeline = it == lib->pipelines.end() ? nullptr : it->second;
  return res;
}

// Upstream names a pipeline by its kernel and constant values; the cache also keeps the constants,
// so a name reused for other constants is an error, never the wrong pipeline.
struct ggml_metal_pipeline_with_params ggml_metal_library_compile_pipeline(ggml_metal_library_t lib,
                                                                           const char* base,
                                                                           const char* name,
                                                                           ggml_metal_cv_t cv) {
  std::lock_guard<std::mutex> lock(lib->mutex);
  const ggml_kernels::mps::Constants constants =
      cv != nullptr ? cv->constants : ggml_kernels::mps::Constants{};
  ggml_metal_pipeline*& slot = lib->pipelines[name];
  if (slot == nullptr) {
    auto pipeline = std::make_unique<ggml_metal_pipeline>();
    pipeline->kernel = base;
    pipeline->name = name;
    pipeline->constants = constants;
    pipeline->obj = new_pipeline_state(lib, base, name, cv);
    slot = pipeline.release();
  } else if (slot->kernel != base || slot->constants != constants) {
    fail(std::string("ggml-kernels MPS: pipeline ") + name + " asked for with another kernel or " +
         "other function constants than it was built with");
  }
  ggml_metal_pipeline_with_params res{};
  res.pipeline = slot;
  return res;
}

// ---- encoders: the stream's encoder, which torch owns ----

struct ggml_metal_encoder {
  MTL::ComputeCommandEncoder* obj = nullptr;
  ggml_kernels::mps::DispatchRecord next;  // the arguments set for the next dispatch
};

ggml_metal_encoder_t ggml_metal_encoder_init(ggml_metal_cmd_buf_t cmd_buf, bool) {
  // torch's encoder dispatches serially: upstream's barriers are kept, and cost nothing more
  auto* enc = new ggml_metal_encoder();
  enc->obj = static_cast<ggml_metal_command_buffer*>(cmd_buf)->encoder;
  return enc;
}

void ggml_metal_encoder_free(ggml_metal_encoder_t encoder) { delete encoder; }

void ggml_metal_encoder_set_pipeline(ggml_metal_encoder_t encoder,
                                     struct ggml_metal_pipeline_with_params pipeline) {
  if (pipeline.pipeline == nullptr) fail("ggml-kernels MPS: a dispatch without a pipeline");
  encoder->obj->setComputePipelineState(pipeline.pipeline->obj);
  encoder->next.pipeline = pipeline.pipeline;
}

void ggml_metal_encoder_set_bytes(ggml_metal_encoder_t encoder, void* data, size_t size, int idx) {
  encoder->obj->setBytes(data, size, idx);
  encoder->next.buffers.erase(idx);
  encoder->next.bytes[idx] = size;
}

void ggml_metal_encoder_set_buffer(ggml_metal_encoder_t encoder, struct ggml_metal_buffer_id buffer,
                                   int idx) {
  auto* mtl = static_cast<MTL::Buffer*>(buffer.metal);
  encoder->obj->setBuffer(mtl, buffer.offs, idx);
  encoder->next.bytes.erase(idx);
  encoder->next.buffers[idx] = {mtl, buffer.offs};
}

void ggml_metal_encoder_set_threadgroup_memory_size(ggml_metal_encoder_t encoder, size_t size,
                                                    int idx) {
  if (size % 16 != 0) fail("ggml-kernels MPS: threadgroup memory not a multiple of 16 bytes");
  encoder->obj->setThreadgroupMemoryLength(size, idx);
  encoder->next.threadgroup_memory[idx] = size;
}

void ggml_metal_encoder_dispatch_threadgroups(ggml_metal_encoder_t encoder, int tg0, int tg1,
                                              int tg2, int tptg0, int tptg1, int tptg2) {
  encoder->obj->dispatchThreadgroups(MTL::Size(tg0, tg1, tg2), MTL::Size(tptg0, tptg1, tptg2));
  ggml_kernels::mps::DispatchRecord& d = encoder->next;
  d.grid[0] = tg0, d.grid[1] = tg1, d.grid[2] = tg2;
  d.threads[0] = tptg0, d.threads[1] = tptg1, d.threads[2] = tptg2;
  ggml_kernels::mps::DispatchLog::instance().add(d);
}

void ggml_metal_encoder_memory_barrier(ggml_metal_encoder_t encoder) {
  encoder->obj->memoryBarrier(MTL::BarrierScopeBuffers);
}

// The encoder is the stream's: torch ends it when it next needs its command buffer.
void ggml_metal_encoder_end_encoding(ggml_metal_encoder_t) {}

// ---- events (the rest: device_core_functions.h): waiting is synchronizing torch's stream ----

void ggml_metal_device_event_synchronize(ggml_metal_device_t, ggml_metal_event_t) {
  ggml_kernels::mps::synchronize();
}

// ---- the device: torch's ----

ggml_metal_device_t ggml_metal_device_init(int device, int) {
  MTL::Device* mtl = ggml_kernels::mps::device();
  if (mtl == nullptr) fail("ggml-kernels MPS: torch has no MPS device");
  auto* dev = new ggml_metal_device();
  dev->mtl = mtl;
  dev->props = device_props(mtl, device);
  dev->library = ggml_metal_library_init(dev);
  dev->fusion = ggml_metal_fusion_info_init(std::getenv("GGML_METAL_FUSION_DISABLE") == nullptr, 0);
  return dev;
}

void ggml_metal_device_free(ggml_metal_device_t dev) {
  if (dev == nullptr) return;
  ggml_metal_fusion_info_free(dev->fusion);
  ggml_metal_library_free(dev->library);
  delete dev;
}

void* ggml_metal_device_get_obj(ggml_metal_device_t dev) { return dev->mtl; }
void* ggml_metal_device_get_queue(ggml_metal_device_t) { return nullptr; }  // torch's stream's

ggml_metal_library_t ggml_metal_device_get_library(ggml_metal_device_t dev) { return dev->library; }

// ---- buffers ----

// A buffer of this layer's own (ggml's buffer type; the packages' MPS backend takes its memory from
// torch's allocator instead, through ggml_metal_buffer_map), in shared storage, as upstream makes
// them on a unified-memory Mac: uploads and read-backs (ggml_backend_tensor_set / get, which
// test-backend-ops relies on) are copies through its host memory after the stream's work is done.
ggml_metal_buffer_t ggml_metal_buffer_init(ggml_metal_device_t dev, size_t size, bool) {
  if (size >= kSlotBytes) return nullptr;
  MTL::Buffer* mtl = dev->mtl->newBuffer(std::max<size_t>(size, 1), MTL::ResourceStorageModeShared);
  if (mtl == nullptr) return nullptr;
  auto* buf = new ggml_metal_buffer();
  buf->mtl = mtl;
  buf->owned = true;
  buf->size = std::max<size_t>(size, 1);
  address_space().add(buf);
  return buf;
}

// Upstream maps host memory here. This device shares no host memory with ggml: `ptr` is an
// MTL::Buffer* (an MPS tensor's storage, mps_platform.h's tensor_buffer) wrapped without a copy or
// a retain, its first `size` bytes at a virtual range of their own. The caller keeps the tensor
// alive until the buffer is freed.
ggml_metal_buffer_t ggml_metal_buffer_map(ggml_metal_device_t, void* ptr, size_t size, size_t) {
  auto* mtl = static_cast<MTL::Buffer*>(ptr);
  if (mtl == nullptr || size > mtl->length() || size >= kSlotBytes) return nullptr;
  auto* buf = new ggml_metal_buffer();
  buf->mtl = mtl;
  buf->size = std::max<size_t>(size, 1);
  address_space().add(buf);
  return buf;
}

void ggml_metal_buffer_free(ggml_metal_buffer_t buf) {
  if (buf == nullptr) return;
  address_space().remove(buf);
  if (buf->owned) buf->mtl->release();
  delete buf;
}

// Mapped (torch's) buffers use upstream's "shared" interface, allocated ones its "private" one.
bool ggml_metal_buffer_is_shared(ggml_metal_buffer_t buf) { return !buf->owned; }

void ggml_metal_buffer_memset_tensor(ggml_metal_buffer_t buf, struct ggml_tensor* tensor,
                                     uint8_t value, size_t offset, size_t size) {
  std::memset(host_bytes(buf, address(tensor, offset), size), value, size);
}

void ggml_metal_buffer_set_tensor(ggml_metal_buffer_t buf, struct ggml_tensor* tensor,
                                  const void* data, size_t offset, size_t size) {
  std::memcpy(host_bytes(buf, address(tensor, offset), size), data, size);
}

void ggml_metal_buffer_get_tensor(ggml_metal_buffer_t buf, const struct ggml_tensor* tensor,
                                  void* data, size_t offset, size_t size) {
  std::memcpy(data, host_bytes(buf, address(tensor, offset), size), size);
}

bool ggml_metal_buffer_cpy_tensor(ggml_metal_buffer_t buf_dst, const struct ggml_tensor* src,
                                  struct ggml_tensor* dst) {
  const size_t n = ggml_nbytes(src);
  ggml_metal_buffer* buf_src = address_space().find(address(src), n);
  if (buf_src == nullptr || buf_src->mtl->contents() == nullptr ||
      buf_dst->mtl->contents() == nullptr)
    return false;  // ggml copies through the host instead
  std::memcpy(host_bytes(buf_dst, address(dst), n), host_bytes(buf_src, address(src), n), n);
  return true;
}

void ggml_metal_buffer_clear(ggml_metal_buffer_t buf, uint8_t value) {
  std::memset(host_bytes(buf, buf->base, buf->size), value, buf->size);
}

struct ggml_metal_buffer_id ggml_metal_buffer_get_id(ggml_metal_buffer_t buf,
                                                     const struct ggml_tensor* t) {
  const uintptr_t addr = address(t);
  if (addr < buf->base || addr - buf->base > buf->size)
    fail("ggml-kernels MPS: a tensor outside its Metal buffer");
  return {buf->mtl, addr - buf->base};
}

}  // extern "C"

#include "device_core_functions.h"  // what every device layer defines the same way

// The backend context of upstream's ggml-metal-context.h (upstream: Objective-C over command
// queues of its own) on torch's MPS stream: a graph is encoded by upstream's ggml_metal_op_* on the
// stream's compute command encoder, inside the stream's serial queue, and left for torch to commit,
// so it runs in order with torch's own work on that stream. Plus the dispatch log and the C API of
// metal_device_api.h.
#include <Metal/Metal.hpp>
#include <stdexcept>
#include <string>

#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-metal-fusion.h"
#include "metal_device_api.h"
#include "mps_device.h"
#include "mps_platform.h"

namespace ggml_kernels::mps {

DispatchLog& DispatchLog::instance() {
  static DispatchLog* log = new DispatchLog();  // outlives every encoder
  return *log;
}

void DispatchLog::add(const DispatchRecord& d) {
  device_core::RecordLog<DispatchRecord>::add(d, d.pipeline->kernel, d.grid);
}

std::string DispatchLog::records_json() const {
  std::map<const MTL::Buffer*, int> ids;
  return device_core::RecordLog<DispatchRecord>::records_json([&ids](const DispatchRecord& d) {
    std::map<int, std::string> args;
    for (const auto& [idx, b] : d.buffers) {
      const int id = ids.emplace(b.first, static_cast<int>(ids.size()) + 1).first->second;
      args[idx] = device_core::buffer_arg_json(id, b.second);
    }
    for (const auto& [idx, n] : d.bytes) args[idx] = device_core::bytes_arg_json(n);
    // a GPU cannot tell threadgroup-memory overruns: no "threadgroup_overrun"
    return device_core::dispatch_json({d.pipeline->kernel, d.pipeline->name, d.grid, d.threads,
                                       d.pipeline->constants, d.threadgroup_memory, nullptr, args});
  });
}

}  // namespace ggml_kernels::mps

namespace {

// One graph's encoding, run on the stream's queue by mps::encode. Nothing may unwind out of it (it
// runs inside the queue's frames): a failure is kept in `error` and raised on the caller's side.
struct GraphEncoding {
  ggml_metal_t ctx;
  ggml_cgraph* graph;
  std::string error;

  static void run(MTL::ComputeCommandEncoder* encoder, void* self) {
    static_cast<GraphEncoding*>(self)->encode(encoder);
  }

  void encode(MTL::ComputeCommandEncoder* encoder) {
    ggml_metal_command_buffer cmd_buf{encoder};
    error = ggml_kernels::device_core::encode_graph(ctx, &cmd_buf, graph, "ggml-kernels MPS");
  }
};

// The bytes of a tensor in a buffer of this layer: the one holding its virtual address.
ggml_metal_buffer_t buffer_of(const ggml_tensor* t) {
  const ggml_tensor* base = t->view_src != nullptr ? t->view_src : t;
  if (base->buffer == nullptr)
    throw std::runtime_error("ggml-kernels MPS: a tensor with no buffer");
  return static_cast<ggml_metal_buffer_t>(base->buffer->context);
}

}  // namespace

extern "C" {

void ggml_metal_synchronize(ggml_metal_t) { ggml_kernels::mps::synchronize(); }

// Through the host only where the buffer's storage is shared (ggml_metal_buffer_set_tensor says
// why not otherwise); the packages move MPS tensors with torch, never through here.
void ggml_metal_set_tensor_async(ggml_metal_t, struct ggml_tensor* tensor, const void* data,
                                 size_t offset, size_t size) {
  ggml_metal_buffer_set_tensor(buffer_of(tensor), tensor, data, offset, size);
}

void ggml_metal_get_tensor_async(ggml_metal_t, const struct ggml_tensor* tensor, void* data,
                                 size_t offset, size_t size) {
  ggml_metal_buffer_get_tensor(buffer_of(tensor), tensor, data, offset, size);
}

bool ggml_metal_cpy_tensor_async(ggml_metal_t, ggml_metal_t, const struct ggml_tensor*,
                                 struct ggml_tensor*) {
  return false;  // ggml copies another way
}

enum ggml_status ggml_metal_graph_compute(ggml_metal_t ctx, struct ggml_cgraph* gf) {
  std::string& last_error = ggml_kernels::mps::last_error();
  last_error.clear();
  GraphEncoding encoding{ctx, gf, {}};
  ggml_kernels::mps::encode(&GraphEncoding::run, &encoding);
  last_error = encoding.error;
  return last_error.empty() ? GGML_STATUS_SUCCESS : GGML_STATUS_FAILED;
}

// ---- the C API of metal_device_api.h ----

size_t gk_metal_dispatches_json(char* out, size_t capacity) {
  return ggml_kernels::device_core::copy_out(
      ggml_kernels::mps::DispatchLog::instance().records_json(), out, capacity);
}

size_t gk_metal_threadgroups_json(char* out, size_t capacity) {
  return ggml_kernels::device_core::copy_out(
      ggml_kernels::mps::DispatchLog::instance().threadgroups_json(), out, capacity);
}

void gk_metal_dispatches_reset(void) { ggml_kernels::mps::DispatchLog::instance().reset(); }

const char* gk_metal_last_error(void) { return ggml_kernels::mps::last_error().c_str(); }

}  // extern "C"

// The backend context of upstream's ggml-metal-context.h (upstream: Objective-C over command
// queues of its own) on torch's MPS stream: a graph is encoded by upstream's ggml_metal_op_* on the
// stream's compute command encoder, inside the stream's serial queue, and left for torch to commit,
// so it runs in order with torch's own work on that stream. Plus the layer's C API.
#include <Metal/Metal.hpp>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-metal-common.h"
#include "ggml-metal-context.h"
#include "ggml-metal-fusion.h"
#include "ggml-metal-ops.h"
#include "mps_device.h"
#include "mps_platform.h"

struct ggml_metal {
  ggml_metal_device_t dev = nullptr;
  std::string name;
  bool use_concurrency = true;
  bool use_graph_optimize = true;
  int debug_graph = 0;
  ggml_metal_event_t ev_cpy = nullptr;
};

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
    ggml_metal_op_t op = nullptr;
    try {
      op = ggml_metal_op_init(ctx->dev, &cmd_buf, graph,
                              ggml_metal_device_get_fusion_info(ctx->dev), 0,
                              ggml_graph_n_nodes(graph), ctx->use_concurrency, false,
                              ctx->debug_graph);
      for (int idx = 0; idx < ggml_metal_op_n_nodes(op);) {
        const int consumed = ggml_metal_op_encode(op, idx);
        if (consumed == 0) break;
        idx += consumed;
      }
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "ggml-kernels MPS: an unknown error while encoding a graph";
    }
    if (op != nullptr) ggml_metal_op_free(op);
  }
};

// The bytes of a tensor in a buffer of this layer: the one holding its virtual address.
ggml_metal_buffer_t buffer_of(const ggml_tensor* t) {
  const ggml_tensor* base = t->view_src != nullptr ? t->view_src : t;
  if (base->buffer == nullptr) throw std::runtime_error("ggml-kernels MPS: a tensor with no buffer");
  return static_cast<ggml_metal_buffer_t>(base->buffer->context);
}

}  // namespace

extern "C" {

ggml_metal_t ggml_metal_init(ggml_metal_device_t dev) {
  auto* ctx = new ggml_metal();
  ctx->dev = dev;
  ctx->name = ggml_metal_device_get_props(dev)->name;
  ctx->use_concurrency = std::getenv("GGML_METAL_CONCURRENCY_DISABLE") == nullptr;
  ctx->use_graph_optimize = std::getenv("GGML_METAL_GRAPH_OPTIMIZE_DISABLE") == nullptr;
  const char* debug = std::getenv("GGML_METAL_GRAPH_DEBUG");
  ctx->debug_graph = debug ? std::atoi(debug) : 0;
  ctx->ev_cpy = ggml_metal_device_event_init(dev);
  return ctx;
}

void ggml_metal_free(ggml_metal_t ctx) {
  if (ctx == nullptr) return;
  ggml_metal_device_event_free(ctx->dev, ctx->ev_cpy);
  delete ctx;
}

const char* ggml_metal_get_name(ggml_metal_t ctx) { return ctx->name.c_str(); }

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

void ggml_metal_graph_optimize(ggml_metal_t ctx, struct ggml_cgraph* gf) {
  if (ctx->use_graph_optimize) ggml_graph_optimize(gf);
}

void ggml_metal_event_record(ggml_metal_t, ggml_metal_event_t) {}
void ggml_metal_event_wait(ggml_metal_t, ggml_metal_event_t) {}
ggml_metal_event_t ggml_metal_get_ev_cpy(ggml_metal_t ctx) { return ctx->ev_cpy; }
void ggml_metal_set_n_cb(ggml_metal_t, int) {}
void ggml_metal_set_abort_callback(ggml_metal_t, ggml_abort_callback, void*) {}
bool ggml_metal_supports_family(ggml_metal_t ctx, int family) {
  return family <= ggml_metal_device_get_props(ctx->dev)->gpu_family;
}
void ggml_metal_capture_next_compute(ggml_metal_t) {}

// The message of the last failed graph compute on this thread ("" when none): the same C API as
// the emulated device's (metal_emu_api.h), so the backends' glue reads it alike.
__attribute__((visibility("default"))) const char* gk_metal_last_error(void) {
  return ggml_kernels::mps::last_error().c_str();
}

}  // extern "C"

// Functions of upstream's ggml-metal-device.h and ggml-metal-context.h (metal_device_api.h's list)
// that do the same in every device layer, whatever its device: the device's own accessors, the
// backend context's settings, debug groups and capture (no capture tool to show them), and
// residency sets, events, extra command buffers and abort callbacks, which no layer needs (the
// emulated device runs each dispatch as it is encoded; the MPS layer's buffers are torch's to keep
// resident, torch's stream orders its work and commits it). Waiting on an event differs (the MPS
// layer synchronizes the stream): each layer defines ggml_metal_device_event_synchronize itself,
// and the context's synchronize, transfers and graph compute.
//
// This header defines functions: a layer includes it from exactly one of its sources, after its
// own definitions of ggml_metal_device (props, fusion), ggml_metal_library (device) and
// ggml_metal_buffer (base).
#pragma once

#include <cstddef>
#include <cstdlib>

#include "device_core.h"
#include "ggml-metal-common.h"
#include "ggml-metal-context.h"
#include "ggml-metal-device.h"

extern "C" {

ggml_metal_device_t ggml_metal_library_get_device(ggml_metal_library_t lib) { return lib->device; }

void ggml_metal_encoder_debug_group_push(ggml_metal_encoder_t, const char*) {}
void ggml_metal_encoder_debug_group_pop(ggml_metal_encoder_t) {}

ggml_metal_rsets_t ggml_metal_rsets_init(ggml_metal_device_t) { return nullptr; }
void ggml_metal_rsets_free(ggml_metal_rsets_t) {}
void ggml_metal_device_rsets_add(ggml_metal_device_t, ggml_metal_rset_t) {}
void ggml_metal_device_rsets_rm(ggml_metal_device_t, ggml_metal_rset_t) {}
void ggml_metal_device_rsets_keep_alive(ggml_metal_device_t) {}

struct ggml_metal_event {
  int unused = 0;
};
void ggml_metal_event_encode_signal(ggml_metal_event_t, ggml_metal_cmd_buf_t) {}
void ggml_metal_event_encode_wait(ggml_metal_event_t, ggml_metal_cmd_buf_t) {}
ggml_metal_event_t ggml_metal_device_event_init(ggml_metal_device_t) {
  return new ggml_metal_event();
}
void ggml_metal_device_event_free(ggml_metal_device_t, ggml_metal_event_t ev) { delete ev; }

const char* ggml_metal_device_id_token(enum ggml_metal_device_id) { return "generic"; }

void ggml_metal_device_get_memory(ggml_metal_device_t dev, size_t* free, size_t* total) {
  *total = dev->props.max_working_set_size;
  *free = *total;
}

const struct ggml_metal_device_props* ggml_metal_device_get_props(ggml_metal_device_t dev) {
  return &dev->props;
}

struct ggml_metal_fusion_info* ggml_metal_device_get_fusion_info(ggml_metal_device_t dev) {
  return dev->fusion;
}

void* ggml_metal_buffer_get_base(ggml_metal_buffer_t buf) {
  return reinterpret_cast<void*>(buf->base);
}

// ---- the backend context ----

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

void ggml_metal_graph_optimize(ggml_metal_t ctx, struct ggml_cgraph* gf) {
  if (ctx->use_graph_optimize) ggml_graph_optimize(gf);
}

void ggml_metal_event_record(ggml_metal_t, ggml_metal_event_t) {}
void ggml_metal_event_wait(ggml_metal_t, ggml_metal_event_t) {}
ggml_metal_event_t ggml_metal_get_ev_cpy(ggml_metal_t ctx) { return ctx->ev_cpy; }
// one command buffer per graph in every layer (device_core::encode_graph)
void ggml_metal_set_n_cb(ggml_metal_t, int) {}
void ggml_metal_set_abort_callback(ggml_metal_t, ggml_abort_callback, void*) {}
bool ggml_metal_supports_family(ggml_metal_t ctx, int family) {
  return family <= ggml_metal_device_get_props(ctx->dev)->gpu_family;
}
void ggml_metal_capture_next_compute(ggml_metal_t) {}

}  // extern "C"

// Functions of upstream's ggml-metal-device.h (metal_device_api.h's list) that do the same in every
// device layer, whatever its device: the device's own accessors, debug groups (no capture tool to
// show them), and residency sets and event signals, which no layer needs (the emulated device runs
// each dispatch as it is encoded; the MPS layer's buffers are torch's to keep resident, and torch's
// stream orders its work). Waiting on an event differs (the MPS layer synchronizes the stream):
// each layer defines ggml_metal_device_event_synchronize itself.
//
// This header defines functions: a layer includes it from exactly one of its sources, after its
// own definitions of ggml_metal_device (props, fusion), ggml_metal_library (device) and
// ggml_metal_buffer (base).
#pragma once

#include <cstddef>

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

}  // extern "C"

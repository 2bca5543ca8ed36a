// The interface a Metal device layer implements: what a Metal runtime library of ours
// (tools/build/metal_runtime.py) links with upstream's C++ host code (ggml-metal.cpp, -ops,
// -device, -common, -fusion, -tuning, compiled unmodified) to make `ggml_backend_metal_init()`
// work.
//
// 1. Upstream's functions of ggml-metal-device.h and ggml-metal-context.h that upstream writes in
//    Objective-C (ggml-metal-device.m, ggml-metal-context.m), listed below by name. Every other
//    function of those headers is upstream's C++ (the pipeline getters of ggml-metal-device.cpp)
//    or `ggml_metal_device_supports_op`, cut from ggml-metal-device.m at build time. The device
//    layer defines the structs behind upstream's opaque handles as it likes. metal_device_api.cpp
//    takes the address of every listed function, so a device layer that misses one fails to link,
//    naming it; tests/test_metal_host.py checks that the list and upstream's headers agree.
// 2. The C API below (`gk_metal_*`), which the packages' Metal backend and the tests call: the log
//    of what upstream's host code dispatched, and the error of the last failed graph.
//
// Implementations: common/metal/emu/ (the emulated device on Linux), common/metal/mps/ (Metal
// itself, over metal-cpp). A device's own instrumentation is its own header (the emulator's:
// emu/metal_emu_api.h).
#pragma once

#include <stddef.h>

// clang-format off
// ggml-metal-device.h: constant values, pipelines, encoders, the library, residency sets, events,
// the device and its buffers.
#define GK_METAL_DEVICE_FUNCTIONS(X)                                                                \
  X(ggml_metal_cv_init) X(ggml_metal_cv_free) X(ggml_metal_cv_set_int16) X(ggml_metal_cv_set_int32) \
  X(ggml_metal_cv_set_bool) X(ggml_metal_pipeline_init) X(ggml_metal_pipeline_free)                  \
  X(ggml_metal_pipeline_max_theads_per_threadgroup) X(ggml_metal_encoder_init)                      \
  X(ggml_metal_encoder_free) X(ggml_metal_encoder_debug_group_push)                                 \
  X(ggml_metal_encoder_debug_group_pop) X(ggml_metal_encoder_set_pipeline)                          \
  X(ggml_metal_encoder_set_bytes) X(ggml_metal_encoder_set_buffer)                                  \
  X(ggml_metal_encoder_set_threadgroup_memory_size) X(ggml_metal_encoder_dispatch_threadgroups)     \
  X(ggml_metal_encoder_memory_barrier) X(ggml_metal_encoder_end_encoding)                           \
  X(ggml_metal_library_init) X(ggml_metal_library_init_from_source) X(ggml_metal_library_free)      \
  X(ggml_metal_library_get_device) X(ggml_metal_library_get_pipeline)                               \
  X(ggml_metal_library_compile_pipeline) X(ggml_metal_rsets_init) X(ggml_metal_rsets_free)          \
  X(ggml_metal_device_id_token) X(ggml_metal_event_encode_signal) X(ggml_metal_event_encode_wait)   \
  X(ggml_metal_device_init) X(ggml_metal_device_free) X(ggml_metal_device_get_obj)                  \
  X(ggml_metal_device_get_queue) X(ggml_metal_device_get_library) X(ggml_metal_device_rsets_add)    \
  X(ggml_metal_device_rsets_rm) X(ggml_metal_device_rsets_keep_alive)                               \
  X(ggml_metal_device_event_init) X(ggml_metal_device_event_free)                                   \
  X(ggml_metal_device_event_synchronize) X(ggml_metal_device_get_memory)                            \
  X(ggml_metal_device_get_props) X(ggml_metal_device_get_fusion_info) X(ggml_metal_buffer_init)     \
  X(ggml_metal_buffer_map) X(ggml_metal_buffer_free) X(ggml_metal_buffer_get_base)                  \
  X(ggml_metal_buffer_is_shared) X(ggml_metal_buffer_memset_tensor)                                 \
  X(ggml_metal_buffer_set_tensor) X(ggml_metal_buffer_get_tensor) X(ggml_metal_buffer_cpy_tensor)   \
  X(ggml_metal_buffer_clear) X(ggml_metal_buffer_get_id)
// ggml-metal-context.h: the backend context (graph compute, transfers, events).
#define GK_METAL_CONTEXT_FUNCTIONS(X)                                                               \
  X(ggml_metal_init) X(ggml_metal_free) X(ggml_metal_get_name) X(ggml_metal_synchronize)            \
  X(ggml_metal_set_tensor_async) X(ggml_metal_get_tensor_async) X(ggml_metal_cpy_tensor_async)      \
  X(ggml_metal_graph_compute) X(ggml_metal_graph_optimize) X(ggml_metal_event_record)               \
  X(ggml_metal_event_wait) X(ggml_metal_get_ev_cpy) X(ggml_metal_set_n_cb)                          \
  X(ggml_metal_set_abort_callback) X(ggml_metal_supports_family) X(ggml_metal_capture_next_compute)
// clang-format on

// Plain C types only from here: the packages include this without any upstream-internal header.
#define GK_METAL_API extern "C" __attribute__((visibility("default")))

// Writes the dispatch records since the last reset as a JSON list into `out` (at most `capacity`
// bytes, NUL-terminated); returns the length the full text needs (excluding the NUL).
GK_METAL_API size_t gk_metal_dispatches_json(char* out, size_t capacity);
// The same for {"kernel name": threadgroups dispatched, ...} since the last reset.
GK_METAL_API size_t gk_metal_threadgroups_json(char* out, size_t capacity);
GK_METAL_API void gk_metal_dispatches_reset(void);
// The message of the last failed graph compute on this thread ("" when none).
GK_METAL_API const char* gk_metal_last_error(void);

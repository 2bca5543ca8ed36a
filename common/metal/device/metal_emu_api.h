// The C API of the Metal runtime's device layer (libggml-kernels-metal-emu.so), besides ggml's own:
// what tests and the packages' Metal backend (common/metal/metal_backend.cpp) call. Plain C types
// only: the packages include this without any Metal or upstream-internal header.
#pragma once

#include <stddef.h>

#define GK_METAL_API extern "C" __attribute__((visibility("default")))

// Writes the dispatch records since the last reset as a JSON list into `out` (at most `capacity`
// bytes, NUL-terminated); returns the length the full text needs (excluding the NUL).
GK_METAL_API size_t gk_metal_dispatches_json(char* out, size_t capacity);
// The same for {"kernel name": threadgroups dispatched, ...} since the last reset.
GK_METAL_API size_t gk_metal_threadgroups_json(char* out, size_t capacity);
GK_METAL_API void gk_metal_dispatches_reset(void);
// 1: dispatches run on the emulated device (default); 0: they are only logged (to see upstream's
// choices for kernels not translated yet).
GK_METAL_API void gk_metal_set_execute(int execute);
// The message of the last failed graph compute on this thread ("" when none).
GK_METAL_API const char* gk_metal_last_error(void);
// 0: resume lanes in forward order within SIMD groups, 1: in reverse (emu_runtime.h).
GK_METAL_API void gk_metal_set_lane_schedule(int reverse);

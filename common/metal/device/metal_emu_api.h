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
// How the emulator runs the lanes of a SIMD group between rendezvous points (emu_runtime.h): in
// forward order (0) or with GK_METAL_LANES_REVERSE in reverse; with GK_METAL_LANES_NO_CONVERGENCE
// the group does not meet around lane-0 branches (to show kernels that rely on lock-step).
#define GK_METAL_LANES_REVERSE 1
#define GK_METAL_LANES_NO_CONVERGENCE 2
GK_METAL_API void gk_metal_set_lane_schedule(int flags);

// The emulated device's instrumentation, besides every Metal device layer's C API
// (metal_device_api.h): whether dispatches run, and how the emulator schedules a SIMD group's
// lanes. Exported by libggml-kernels-metal-emu.so only; plain C types.
#pragma once

// 1: dispatches run on the emulated device (default); 0: they are only logged (to see upstream's
// choices for kernels not translated yet).
extern "C" __attribute__((visibility("default"))) void gk_metal_set_execute(int execute);
// How the emulator runs the lanes of a SIMD group between rendezvous points (emu_runtime.h): in
// forward order (0) or with GK_METAL_LANES_REVERSE in reverse; with GK_METAL_LANES_NO_CONVERGENCE
// the group does not meet around lane-0 branches (to show kernels that rely on lock-step).
#define GK_METAL_LANES_REVERSE 1
#define GK_METAL_LANES_NO_CONVERGENCE 2
extern "C" __attribute__((visibility("default"))) void gk_metal_set_lane_schedule(int flags);

// The instrumentation ops both emulated builds define alike (metal_emu_ops.cpp in build-metal-emu/,
// mps_emu/mps_emu_ops.cpp in build-mps-emu/; _metal_emu.py wraps them): the device layer's log of
// what upstream's host code dispatched, its reset, and the lane schedule of the emulator that ran
// the dispatches. Each build says how its emulator resets and sets its lanes.
#pragma once

#include <cstddef>
#include <string>

#include "registration.h"

namespace ggml_kernels::emulator_ops {

// The JSON text a C writer gives (`write(nullptr, 0)`: its length; then it fills a buffer).
inline std::string json(size_t (*write)(char*, size_t)) {
  std::string text(write(nullptr, 0) + 1, '\0');
  text.resize(write(text.data(), text.size()));
  return text;
}

struct Emulator {
  void (*reset)();  // what the emulator itself logs, reset with the layer's log (nullptr: nothing)
  void (*set_lane_schedule)(int flags);  // GK_METAL_LANES_* (emu/metal_emu_api.h)
};

inline void define(torch::Library& m, Emulator emulator) {
  // {kernel: threadgroups dispatched} since load or the last reset, as JSON (the layer's log)
  m.def("metal_threadgroups_json() -> str", [] { return json(ggml().gk_metal_threadgroups_json); });
  // every dispatch record since load or the last reset, as JSON (the layer's log)
  m.def("metal_dispatches_json() -> str", [] { return json(ggml().gk_metal_dispatches_json); });
  m.def("metal_reset_dispatches() -> ()", [reset = emulator.reset] {
    ggml().gk_metal_dispatches_reset();
    if (reset != nullptr) reset();
  });
  // lane schedule flags (GK_METAL_LANES_REVERSE, GK_METAL_LANES_NO_CONVERGENCE)
  m.def("metal_set_lane_schedule(int flags) -> ()",
        [set = emulator.set_lane_schedule](int64_t flags) { set(static_cast<int>(flags)); });
}

}  // namespace ggml_kernels::emulator_ops

// The twin build's own ops (build-mps-emu/ only; _metal_emu.py wraps them, as metal_emu_ops.cpp's
// in build-metal-emu/): the MPS device layer's log of what upstream's host code dispatched (the
// runtime's metal_device_api.h functions), and of the fake Metal framework that ran the dispatches
// on its emulator: the emulator's lane schedule, threadgroup memory overruns and live objects.
#include "fake_mps.h"
#include "registration.h"

namespace {

using namespace ggml_kernels;

std::string json(size_t (*write)(char*, size_t)) {
  std::string text(write(nullptr, 0) + 1, '\0');
  text.resize(write(text.data(), text.size()));
  return text;
}

}  // namespace

GGML_KERNELS_LIBRARY_FRAGMENT(m) {
  // {kernel: threadgroups dispatched} since load or the last reset, as JSON (the layer's log)
  m.def("metal_threadgroups_json() -> str", [] { return json(ggml().gk_metal_threadgroups_json); });
  // every dispatch record since load or the last reset, as JSON (the layer's log)
  m.def("metal_dispatches_json() -> str", [] { return json(ggml().gk_metal_dispatches_json); });
  m.def("metal_reset_dispatches() -> ()", [] {
    ggml().gk_metal_dispatches_reset();
    gk_fake_metal_reset();
  });
  // lane schedule flags (metal_emu_api.h's GK_METAL_LANES_*), of the framework's emulator
  m.def("metal_set_lane_schedule(int flags) -> ()",
        [](int64_t flags) { gk_fake_metal_set_lane_schedule(static_cast<int>(flags)); });
  // {kernel: most bytes written past its threadgroup memory} since the last reset
  m.def("metal_threadgroup_overruns_json() -> str",
        [] { return json(gk_fake_metal_overruns_json); });
  // {class: objects alive}: taken around a call, what it leaked
  m.def("fake_metal_live_objects_json() -> str",
        [] { return json(gk_fake_metal_live_objects_json); });
}

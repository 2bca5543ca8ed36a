// The twin build's own ops (build-mps-emu/ only): emulator_ops.h's, over the MPS device layer's log
// of what upstream's host code dispatched (the runtime's metal_device_api.h functions) and the fake
// Metal framework that ran the dispatches on its emulator; and that framework's threadgroup memory
// overruns and live objects.
#include "fake_mps.h"
#include "metal/emulator_ops.h"
#include "registration.h"

using ggml_kernels::emulator_ops::json;

GGML_KERNELS_LIBRARY_FRAGMENT(m) {
  ggml_kernels::emulator_ops::define(m, {gk_fake_metal_reset, gk_fake_metal_set_lane_schedule});
  // {kernel: most bytes written past its threadgroup memory} since the last reset
  m.def("metal_threadgroup_overruns_json() -> str",
        [] { return json(gk_fake_metal_overruns_json); });
  // {class: objects alive}: taken around a call, what it leaked
  m.def("fake_metal_live_objects_json() -> str",
        [] { return json(gk_fake_metal_live_objects_json); });
}

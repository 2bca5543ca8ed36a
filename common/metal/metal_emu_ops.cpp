// The emulated-Metal build's own ops (build-metal-emu/ only; _metal_emu.py wraps them): the log of
// what upstream's host code dispatched, and how the emulator schedules a SIMD group's lanes.
#include <dlfcn.h>

#include <string>

#include "emu/metal_emu_api.h"
#include "registration.h"

namespace {

using namespace ggml_kernels;

std::string json(size_t (*write)(char*, size_t)) {
  std::string text(write(nullptr, 0) + 1, '\0');
  text.resize(write(text.data(), text.size()));
  return text;
}

// The emulator's own function of the loaded runtime (not in GgmlApi: no other runtime has it).
decltype(&gk_metal_set_lane_schedule) lane_schedule_function() {
  void* runtime = dlopen(runtime_path().c_str(), RTLD_NOW | RTLD_NOLOAD);
  void* fn = runtime ? dlsym(runtime, "gk_metal_set_lane_schedule") : nullptr;
  TORCH_CHECK(fn != nullptr, "ggml-kernels: ", runtime_path(),
              " does not export gk_metal_set_lane_schedule");
  return reinterpret_cast<decltype(&gk_metal_set_lane_schedule)>(fn);
}

}  // namespace

GGML_KERNELS_LIBRARY_FRAGMENT(m) {
  // {kernel: threadgroups dispatched} since load or the last reset, as JSON
  m.def("metal_threadgroups_json() -> str", [] { return json(ggml().gk_metal_threadgroups_json); });
  // every dispatch record since load or the last reset, as JSON
  m.def("metal_dispatches_json() -> str", [] { return json(ggml().gk_metal_dispatches_json); });
  m.def("metal_reset_dispatches() -> ()", [] { ggml().gk_metal_dispatches_reset(); });
  // lane schedule flags (GK_METAL_LANES_REVERSE, GK_METAL_LANES_NO_CONVERGENCE)
  m.def("metal_set_lane_schedule(int flags) -> ()", [](int64_t flags) {
    static const auto set = lane_schedule_function();
    set(static_cast<int>(flags));
  });
}

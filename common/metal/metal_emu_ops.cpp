// The emulated-Metal build's own ops (build-metal-emu/ only): emulator_ops.h's, over the runtime's
// emulated device, which logs the dispatches and schedules a SIMD group's lanes itself.
#include <dlfcn.h>

#include "emu/metal_emu_api.h"
#include "metal/emulator_ops.h"
#include "registration.h"

namespace {

using namespace ggml_kernels;

// The emulator's own function of the loaded runtime (not in GgmlApi: no other runtime has it).
decltype(&gk_metal_set_lane_schedule) lane_schedule_function() {
  void* runtime = dlopen(runtime_path().c_str(), RTLD_NOW | RTLD_NOLOAD);
  void* fn = runtime ? dlsym(runtime, "gk_metal_set_lane_schedule") : nullptr;
  TORCH_CHECK(fn != nullptr, "ggml-kernels: ", runtime_path(),
              " does not export gk_metal_set_lane_schedule");
  return reinterpret_cast<decltype(&gk_metal_set_lane_schedule)>(fn);
}

void set_lane_schedule(int flags) {
  static const auto set = lane_schedule_function();
  set(flags);
}

}  // namespace

GGML_KERNELS_LIBRARY_FRAGMENT(m) {
  emulator_ops::define(m, {nullptr, set_lane_schedule});  // the dispatch log is the runtime's
}

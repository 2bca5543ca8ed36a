// The build-time check of metal_device_api.h, compiled into every Metal runtime library: it takes
// the address of each upstream function a device layer must define, so that the library (linked
// with --no-undefined) fails to link, naming the function, when its device layer lacks one.
#include "metal_device_api.h"

#include "ggml-metal-context.h"
#include "ggml-metal-device.h"

// clang-format off
#define GK_METAL_ADDRESS(name) reinterpret_cast<const void*>(&::name),
GK_METAL_API const void* const gk_metal_device_functions[] = {
    GK_METAL_DEVICE_FUNCTIONS(GK_METAL_ADDRESS) GK_METAL_CONTEXT_FUNCTIONS(GK_METAL_ADDRESS) nullptr};
// clang-format on

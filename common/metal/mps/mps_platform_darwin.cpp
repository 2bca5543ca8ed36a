// mps_platform.h on macOS: torch's MPS device and current stream (ATen/mps, plain C++: torch's
// headers hand Metal objects out as void* outside Objective-C), and the Metal buffer that is an MPS
// tensor's storage pointer.
#include <ATen/ATen.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>
#include <dispatch/dispatch.h>

#include <Metal/Metal.hpp>

#include "mps_platform.h"

namespace ggml_kernels::mps {

namespace {

struct Encoding {
  at::mps::MPSStream* stream;
  void (*body)(MTL::ComputeCommandEncoder*, void*);
  void* context;

  static void run(void* self) {
    auto* e = static_cast<Encoding*>(self);
    e->body(static_cast<MTL::ComputeCommandEncoder*>(e->stream->commandEncoder()), e->context);
  }
};

}  // namespace

MTL::Device* device() {
  return static_cast<MTL::Device*>(at::mps::MPSDevice::getInstance()->device());
}

void encode(void (*body)(MTL::ComputeCommandEncoder*, void*), void* context) {
  Encoding e{at::mps::getCurrentMPSStream(), body, context};
  dispatch_sync_f(e.stream->queue(), &e, &Encoding::run);
}

void synchronize() {
  at::mps::getCurrentMPSStream()->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
}

// An MPS tensor's storage pointer is its id<MTLBuffer> (torch's MPS allocator hands those out).
MTL::Buffer* tensor_buffer(const at::Tensor& t) {
  return static_cast<MTL::Buffer*>(const_cast<void*>(t.storage().data()));
}

size_t tensor_offset(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset()) * t.element_size();
}

}  // namespace ggml_kernels::mps

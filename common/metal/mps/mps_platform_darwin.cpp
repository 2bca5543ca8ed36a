// mps_platform.h on macOS: torch's MPS device and current stream (ATen/mps, plain C++: torch's
// headers hand Metal objects out as void* outside Objective-C), and the Metal buffer that is an MPS
// tensor's storage pointer.
#include <ATen/ATen.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>
#include <dispatch/dispatch.h>

#include <Metal/Metal.hpp>
#include <exception>

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

struct Synchronizing {
  at::mps::MPSStream* stream;
  std::exception_ptr error;

  static void run(void* self) {
    auto* s = static_cast<Synchronizing*>(self);
    try {
      s->stream->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
    } catch (...) {
      s->error = std::current_exception();
    }
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

// On the stream's queue, as torch's own copies commit: a commit from one host thread while another
// encodes on the queue would end the encoder under it (ggml backends on several threads share the
// one stream). An exception is carried out of the queue's frames and rethrown here.
void synchronize() {
  Synchronizing s{at::mps::getCurrentMPSStream(), nullptr};
  dispatch_sync_f(s.stream->queue(), &s, &Synchronizing::run);
  if (s.error) std::rethrow_exception(s.error);
}

// An MPS tensor's storage pointer is its id<MTLBuffer> (torch's MPS allocator hands those out).
MTL::Buffer* tensor_buffer(const at::Tensor& t) {
  return static_cast<MTL::Buffer*>(const_cast<void*>(t.storage().data()));
}

size_t tensor_offset(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset()) * t.element_size();
}

}  // namespace ggml_kernels::mps

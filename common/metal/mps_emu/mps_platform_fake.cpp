// mps_platform.h on Linux (the twin): the fake MPS stream's device and queue (fake_mps_stream.h,
// torch's MPSStream names), and a CPU tensor's storage as the Metal buffer an MPS tensor's storage
// is on a Mac (fake_metal::storage_buffer). Mirrors mps_platform_darwin.cpp call for call.
#include <ATen/ATen.h>
#include <dispatch/dispatch.h>

#include <Metal/Metal.hpp>

#include "fake_mps.h"
#include "fake_mps_stream.h"
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
  return static_cast<MTL::Device*>(at::mps::getCurrentMPSStream()->device());
}

void encode(void (*body)(MTL::ComputeCommandEncoder*, void*), void* context) {
  Encoding e{at::mps::getCurrentMPSStream(), body, context};
  dispatch_sync_f(e.stream->queue(), &e, &Encoding::run);
}

void synchronize() {
  at::mps::getCurrentMPSStream()->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
}

// The twin's "MPS tensors" are CPU tensors: their storage, wrapped once as a private buffer.
MTL::Buffer* tensor_buffer(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  return fake_metal::storage_buffer(const_cast<void*>(s.data()), s.nbytes());
}

size_t tensor_offset(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset()) * t.element_size();
}

}  // namespace ggml_kernels::mps

// mps_platform.h on Linux (the twin): the fake MPS stream's device and queue (fake_mps_stream.h,
// torch's MPSStream names), and a CPU tensor's storage as the Metal buffer an MPS tensor's storage
// is on a Mac (fake_metal::storage_buffer). Mirrors mps_platform_darwin.cpp call for call.
#include <ATen/ATen.h>
#include <dispatch/dispatch.h>

#include <Metal/Metal.hpp>
#include <exception>

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
  return static_cast<MTL::Device*>(at::mps::getCurrentMPSStream()->device());
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

// The twin's "MPS tensors" are CPU tensors: their storage, wrapped once as a private buffer.
MTL::Buffer* tensor_buffer(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  return fake_metal::storage_buffer(const_cast<void*>(s.data()), s.nbytes());
}

size_t tensor_offset(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset()) * t.element_size();
}

}  // namespace ggml_kernels::mps

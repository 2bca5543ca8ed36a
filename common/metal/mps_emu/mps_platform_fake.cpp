// mps_platform.h on Linux (the twin): the fake MPS stream's device and queue (fake_mps_stream.h,
// torch's MPSStream names), and a CPU tensor's storage as the Metal buffer an MPS tensor's storage
// is on a Mac (fake_metal::storage_buffer). Mirrors mps_platform_darwin.cpp call for call.
#include <ATen/ATen.h>

#include <Metal/Metal.hpp>

#include "fake_mps.h"
#include "fake_mps_stream.h"
#include "mps_platform.h"
#include "mps_stream_queue.h"  // the part every platform shares

namespace ggml_kernels::mps {

MTL::Device* device() {
  return static_cast<MTL::Device*>(at::mps::getCurrentMPSStream()->device());
}

void encode(void (*body)(MTL::ComputeCommandEncoder*, void*), void* context) {
  stream_queue::encode(at::mps::getCurrentMPSStream(), body, context);
}

void synchronize() {
  stream_queue::synchronize(at::mps::getCurrentMPSStream(), at::mps::SyncType::COMMIT_AND_WAIT);
}

// The twin's "MPS tensors" are CPU tensors: their storage, wrapped once as a private buffer.
MTL::Buffer* tensor_buffer(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  return fake_metal::storage_buffer(const_cast<void*>(s.data()), s.nbytes());
}

size_t tensor_offset(const at::Tensor& t) { return stream_queue::storage_offset_bytes(t); }

}  // namespace ggml_kernels::mps

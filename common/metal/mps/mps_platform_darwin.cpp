// mps_platform.h on macOS: torch's MPS device and current stream (ATen/mps, plain C++: torch's
// headers hand Metal objects out as void* outside Objective-C), and the Metal buffer that is an MPS
// tensor's storage pointer.
#include <ATen/ATen.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#include <Metal/Metal.hpp>

#include "mps_platform.h"
#include "mps_stream_queue.h"  // the part every platform shares

namespace ggml_kernels::mps {

MTL::Device* device() {
  return static_cast<MTL::Device*>(at::mps::MPSDevice::getInstance()->device());
}

void encode(void (*body)(MTL::ComputeCommandEncoder*, void*), void* context) {
  stream_queue::encode(at::mps::getCurrentMPSStream(), body, context);
}

void synchronize() {
  stream_queue::synchronize(at::mps::getCurrentMPSStream(), at::mps::SyncType::COMMIT_AND_WAIT);
}

// An MPS tensor's storage pointer is its id<MTLBuffer> (torch's MPS allocator hands those out).
MTL::Buffer* tensor_buffer(const at::Tensor& t) {
  return static_cast<MTL::Buffer*>(const_cast<void*>(t.storage().data()));
}

size_t tensor_offset(const at::Tensor& t) { return stream_queue::storage_offset_bytes(t); }

}  // namespace ggml_kernels::mps

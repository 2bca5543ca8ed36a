// What the MPS device layer (mps_device.cpp, mps_context.cpp) and the packages' MPS backend
// (mps_backend.cpp) need from their platform: torch's MPS device and current stream, and the Metal
// buffer behind an MPS tensor. Implemented once per platform and nowhere else, so that the layer is
// one source in every build:
//   - darwin: mps_platform_darwin.cpp, over ATen/mps (MPSDevice, MPSStream);
//   - Linux: the fake Metal framework's MPS stand-ins (common/metal/mps_emu/), whose "MPS tensors"
//     are CPU tensors wrapped as Metal buffers.
// Plain C++ over metal-cpp: no Objective-C, no platform #ifdef.
#pragma once

#include <cstddef>

namespace MTL {
class Buffer;
class ComputeCommandEncoder;
class Device;
}  // namespace MTL

namespace at {
class Tensor;
}

namespace ggml_kernels::mps {

// torch's Metal device (MPSDevice's), not retained: it lives as long as the process.
MTL::Device* device();

// Runs body(encoder, context) on the current MPS stream: on the stream's serial dispatch queue,
// with the compute command encoder the stream hands out (torch's: the body neither ends it nor
// commits its command buffer; the stream commits when torch does). Returns when body has run.
// body must not throw (it runs inside the dispatch queue's frames) and must not call encode again
// (a synchronous dispatch onto the queue it runs on never returns).
void encode(void (*body)(MTL::ComputeCommandEncoder* encoder, void* context), void* context);

// Commits the stream's work and waits for it to complete (before the host reads device memory).
void synchronize();

// The Metal buffer holding an MPS tensor's storage (not retained: the storage owns it) and the byte
// offset of the tensor's first element in it.
MTL::Buffer* tensor_buffer(const at::Tensor& t);
size_t tensor_offset(const at::Tensor& t);

}  // namespace ggml_kernels::mps

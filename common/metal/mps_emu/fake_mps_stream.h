// The fake MPS stream (Linux): the part of torch's at::mps::MPSStream (ATen/mps/MPSStream.h) a
// device layer calls, with the same C++ names and types as torch's header gives plain C++ (Metal
// objects as void*), over the fake Metal framework. Included on Linux instead of
// ATen/mps/MPSStream.h.
//
// As on torch: one serial dispatch queue per stream, a command buffer made on first use, a
// compute encoder kept open across kernels (coalescing) until endKernelCoalescing() or
// synchronize(), and committing left to synchronize(). The fake refuses (fake_metal::Misuse) a
// dispatch_sync_f onto the stream's queue from work already running on it (a deadlock on a Mac),
// an exception escaping work run on the queue (libdispatch does not pass it on), and
// commandEncoder() from anywhere but work on the queue (it races with torch's own kernels).
#pragma once

#include <dispatch/dispatch.h>

#include <cstddef>
#include <cstdint>

typedef void* MPSCommandBuffer_t;
typedef void* MTLCommandQueue_t;
typedef void* MTLComputeCommandEncoder_t;
typedef void* MTLDevice_t;
typedef void* MTLBuffer_t;

namespace at::mps {

enum class SyncType {
  NONE,                 // no commit to command buffer
  COMMIT,               // commit and flush the command buffer
  COMMIT_AND_WAIT,      // flush and wait for command buffer execution to finish
  COMMIT_AND_CONTINUE,  // commit and continue with a new underlying command buffer
  COMMIT_ADAPTIVE,      // commit adaptively based on available memory
};

class MPSStream {
 public:
  MPSStream();
  ~MPSStream();
  MPSStream(const MPSStream&) = delete;
  MPSStream& operator=(const MPSStream&) = delete;

  MTLCommandQueue_t commandQueue() const { return command_queue_; }
  dispatch_queue_t queue() const { return serial_queue_; }
  MPSCommandBuffer_t commandBuffer();
  MTLComputeCommandEncoder_t commandEncoder();
  void endKernelCoalescing();
  void synchronize(SyncType syncType);
  MTLDevice_t device() const { return device_; }

 private:
  void commit_and_wait();

  MTLDevice_t device_ = nullptr;
  MTLCommandQueue_t command_queue_ = nullptr;
  MPSCommandBuffer_t command_buffer_ = nullptr;
  MTLComputeCommandEncoder_t command_encoder_ = nullptr;
  dispatch_queue_t serial_queue_ = nullptr;
};

// The process's one stream (torch has one MPS stream per process too).
MPSStream* getCurrentMPSStream();
MPSStream* getDefaultMPSStream();

}  // namespace at::mps

// The fake MPS stream over the fake Metal framework, written against metal-cpp as a client would,
// and the fake's dispatch_sync_f (dispatch/dispatch.h shim).
#include "fake_mps_stream.h"

#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "fake_mps.h"

struct dispatch_queue_s {
  std::mutex mutex;  // serial: one piece of work at a time
  const char* label;
};

namespace {

thread_local std::vector<dispatch_queue_t> t_running;  // queues this thread runs work for

}  // namespace

extern "C" void dispatch_sync_f(dispatch_queue_t queue, void* context, dispatch_function_t work) {
  if (queue == nullptr || work == nullptr)
    throw fake_metal::Misuse("dispatch_sync_f: a null queue or function");
  if (std::find(t_running.begin(), t_running.end(), queue) != t_running.end())
    throw fake_metal::Misuse(std::string("dispatch_sync_f onto ") + queue->label +
                             " from work already running on it: on a Mac this deadlocks");
  std::lock_guard<std::mutex> lock(queue->mutex);
  t_running.push_back(queue);
  try {
    work(context);
  } catch (const fake_metal::Misuse&) {  // a refusal inside: that is the error to report
    t_running.pop_back();
    throw;
  } catch (const std::exception& e) {
    t_running.pop_back();
    throw fake_metal::Misuse(std::string("an exception escaped work run by dispatch_sync_f on ") +
                             queue->label +
                             " (libdispatch does not pass exceptions on: catch them inside and "
                             "rethrow after the call): " +
                             e.what());
  }
  t_running.pop_back();
}

namespace at::mps {

MPSStream::MPSStream() {
  auto* device = MTL::CreateSystemDefaultDevice();
  device_ = device;
  command_queue_ = device->newCommandQueue();
  serial_queue_ = new dispatch_queue_s{{}, "the MPS stream's queue"};
}

MPSStream::~MPSStream() {
  endKernelCoalescing();
  if (command_buffer_ != nullptr) static_cast<MTL::CommandBuffer*>(command_buffer_)->release();
  static_cast<MTL::CommandQueue*>(command_queue_)->release();
  static_cast<MTL::Device*>(device_)->release();
  delete serial_queue_;
}

MPSCommandBuffer_t MPSStream::commandBuffer() {
  if (command_buffer_ == nullptr) {
    NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
    command_buffer_ = static_cast<MTL::CommandQueue*>(command_queue_)->commandBuffer()->retain();
    pool->release();
  }
  return command_buffer_;
}

// torch's encoder is shared with torch's own kernels, which encode on it from work running on the
// stream's queue; encoding from anywhere else races with them.
MTLComputeCommandEncoder_t MPSStream::commandEncoder() {
  if (std::find(t_running.begin(), t_running.end(), serial_queue_) == t_running.end())
    throw fake_metal::Misuse(
        "MPSStream::commandEncoder() outside dispatch_sync_f on the stream's queue: torch's own "
        "kernels encode on that encoder from the queue, so this races with them");
  if (command_encoder_ == nullptr) {
    auto* cb = static_cast<MTL::CommandBuffer*>(commandBuffer());
    NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
    command_encoder_ = cb->computeCommandEncoder()->retain();
    pool->release();
  }
  return command_encoder_;
}

void MPSStream::endKernelCoalescing() {
  if (command_encoder_ == nullptr) return;
  auto* encoder = static_cast<MTL::ComputeCommandEncoder*>(command_encoder_);
  command_encoder_ = nullptr;
  encoder->endEncoding();
  encoder->release();
}

void MPSStream::commit_and_wait() {
  if (command_buffer_ == nullptr) return;
  auto* cb = static_cast<MTL::CommandBuffer*>(command_buffer_);
  command_buffer_ = nullptr;
  cb->commit();
  cb->waitUntilCompleted();
  const bool failed = cb->status() == MTL::CommandBufferStatusError;
  std::string message = failed ? cb->error()->localizedDescription()->utf8String() : "";
  cb->release();
  if (failed) throw std::runtime_error("MPS stream: a command buffer failed: " + message);
}

// Work runs when committed (in order, on the emulated device), so every kind of commit completes
// the work before it returns: COMMIT, COMMIT_AND_CONTINUE and COMMIT_ADAPTIVE as COMMIT_AND_WAIT.
void MPSStream::synchronize(SyncType syncType) {
  endKernelCoalescing();
  if (syncType != SyncType::NONE) commit_and_wait();
}

MPSStream* getDefaultMPSStream() {
  static MPSStream* stream = new MPSStream();  // never destroyed, like torch's
  return stream;
}

MPSStream* getCurrentMPSStream() { return getDefaultMPSStream(); }

}  // namespace at::mps

// The part of mps_platform.h that is the same on every platform: work on an MPS stream's serial
// dispatch queue. It is written against torch's MPSStream interface (queue(), commandEncoder(),
// synchronize(SyncType)), which darwin takes from ATen/mps and the Linux twin from the fake stream
// (fake_mps_stream.h, the same names), so each platform part passes its own stream. What differs
// per platform (the device, and the Metal buffer behind a tensor's storage) stays in
// mps_platform_darwin.cpp and mps_platform_fake.cpp.
#pragma once

#include <dispatch/dispatch.h>

#include <cstddef>
#include <exception>

namespace MTL {
class ComputeCommandEncoder;
}

namespace ggml_kernels::mps::stream_queue {

// Runs body(encoder, context) on the stream's queue, with the encoder the stream hands out.
template <typename Stream>
void encode(Stream* stream, void (*body)(MTL::ComputeCommandEncoder*, void*), void* context) {
  struct Encoding {
    Stream* stream;
    void (*body)(MTL::ComputeCommandEncoder*, void*);
    void* context;

    static void run(void* self) {
      auto* e = static_cast<Encoding*>(self);
      e->body(static_cast<MTL::ComputeCommandEncoder*>(e->stream->commandEncoder()), e->context);
    }
  };
  Encoding e{stream, body, context};
  dispatch_sync_f(stream->queue(), &e, &Encoding::run);
}

// Commits and waits on the stream's queue, as torch's own copies commit: a commit from one host
// thread while another encodes on the queue would end the encoder under it (ggml backends on
// several threads share the one stream). An exception is carried out of the queue's frames and
// rethrown here.
template <typename Stream, typename SyncType>
void synchronize(Stream* stream, SyncType commit_and_wait) {
  struct Synchronizing {
    Stream* stream;
    SyncType sync;
    std::exception_ptr error;

    static void run(void* self) {
      auto* s = static_cast<Synchronizing*>(self);
      try {
        s->stream->synchronize(s->sync);
      } catch (...) {
        s->error = std::current_exception();
      }
    }
  };
  Synchronizing s{stream, commit_and_wait, nullptr};
  dispatch_sync_f(stream->queue(), &s, &Synchronizing::run);
  if (s.error) std::rethrow_exception(s.error);
}

// The byte offset of a tensor's first element in its storage.
template <typename Tensor>
size_t storage_offset_bytes(const Tensor& t) {
  return static_cast<size_t>(t.storage_offset()) * t.element_size();
}

}  // namespace ggml_kernels::mps::stream_queue

// The backend context of upstream's ggml-metal-context.h (upstream: Objective-C over command
// queues): a graph is encoded by upstream's ggml_metal_op_* into one command buffer whose
// dispatches go to the executor, in order. Transfers are synchronous copies into the buffers' host
// memory. Plus the dispatch log's C API.
#include <atomic>
#include <cstring>
#include <map>
#include <string>

#include "emu_runtime.h"
#include "ggml-impl.h"
#include "ggml-metal-fusion.h"
#include "metal_emu.h"

using namespace ggml_kernels::metal;
namespace device_core = ggml_kernels::device_core;

namespace {

thread_local std::string t_last_error;
std::atomic<bool> g_execute{true};

// Logs every dispatch, then runs it on the emulated device unless only logging was asked for.
class LoggingExecutor : public Executor {
 public:
  void dispatch(const Dispatch& d) override {
    if (!g_execute.load()) return DispatchLog::instance().dispatch(d);
    Dispatch ran = d;
    try {
      ran.threadgroup_overrun = run_dispatch(d);
    } catch (...) {
      DispatchLog::instance().dispatch(ran);  // a failed dispatch is in the log too
      throw;
    }
    DispatchLog::instance().dispatch(ran);
  }
};

}  // namespace

namespace ggml_kernels::metal {
void set_execute(bool execute) { g_execute.store(execute); }
bool execute() { return g_execute.load(); }
}  // namespace ggml_kernels::metal

namespace {

// Host memory of a tensor's bytes [offset, offset + size), found by its device address.
uint8_t* tensor_bytes(const ggml_tensor* t, size_t offset, size_t size) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(t->data) + offset;
  ggml_metal_buffer* buf = find_buffer(addr, size);
  GGML_ASSERT(buf != nullptr && "a tensor that is not in a Metal buffer");
  return host_address(buf, addr, size);
}

// The log's record of a dispatch: buffers by the emulator's ids, and what running it found.
std::string dispatch_json(const Dispatch& d) {
  std::map<int, std::string> args;
  for (const auto& [idx, b] : d.bindings)
    args[idx] = b.bytes.empty() ? device_core::buffer_arg_json(b.buffer, b.offset)
                                : device_core::bytes_arg_json(b.bytes.size());
  return device_core::dispatch_json({d.kernel, d.pipeline, d.grid, d.threads, d.constants,
                                     d.threadgroup_memory, &d.threadgroup_overrun, args});
}

}  // namespace

extern "C" {

void ggml_metal_synchronize(ggml_metal_t) {}

void ggml_metal_set_tensor_async(ggml_metal_t, struct ggml_tensor* tensor, const void* data,
                                 size_t offset, size_t size) {
  std::memcpy(tensor_bytes(tensor, offset, size), data, size);
}

void ggml_metal_get_tensor_async(ggml_metal_t, const struct ggml_tensor* tensor, void* data,
                                 size_t offset, size_t size) {
  std::memcpy(data, tensor_bytes(tensor, offset, size), size);
}

bool ggml_metal_cpy_tensor_async(ggml_metal_t, ggml_metal_t, const struct ggml_tensor* src,
                                 struct ggml_tensor* dst) {
  const size_t n = ggml_nbytes(src);
  std::memcpy(tensor_bytes(dst, 0, n), tensor_bytes(src, 0, n), n);
  return true;
}

enum ggml_status ggml_metal_graph_compute(ggml_metal_t ctx, struct ggml_cgraph* gf) {
  LoggingExecutor executor;
  ggml_metal_command_buffer cmd_buf{&executor};
  t_last_error = device_core::encode_graph(ctx, &cmd_buf, gf, "ggml-kernels Metal");
  return t_last_error.empty() ? GGML_STATUS_SUCCESS : GGML_STATUS_FAILED;
}

size_t gk_metal_dispatches_json(char* out, size_t capacity) {
  return device_core::copy_out(DispatchLog::instance().records_json(dispatch_json), out, capacity);
}

size_t gk_metal_threadgroups_json(char* out, size_t capacity) {
  return device_core::copy_out(DispatchLog::instance().threadgroups_json(), out, capacity);
}

void gk_metal_dispatches_reset(void) { DispatchLog::instance().reset(); }

void gk_metal_set_execute(int execute) { set_execute(execute != 0); }

const char* gk_metal_last_error(void) { return t_last_error.c_str(); }

void gk_metal_set_lane_schedule(int flags) {
  emu::set_schedule((flags & GK_METAL_LANES_REVERSE) ? emu::Schedule::Reverse
                                                     : emu::Schedule::Forward);
  emu::set_lane_zero_convergence(!(flags & GK_METAL_LANES_NO_CONVERGENCE));
}

}  // extern "C"

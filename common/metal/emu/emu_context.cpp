// The backend context of upstream's ggml-metal-context.h (upstream: Objective-C over command
// queues): a graph is encoded by upstream's ggml_metal_op_* into one command buffer whose
// dispatches go to the executor, in order. Transfers are synchronous copies into the buffers' host
// memory. Plus the dispatch log's C API.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "emu_runtime.h"
#include "ggml-impl.h"
#include "ggml-metal-common.h"
#include "ggml-metal-context.h"
#include "ggml-metal-fusion.h"
#include "ggml-metal-ops.h"
#include "metal_emu.h"

using namespace ggml_kernels::metal;

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

struct ggml_metal {
  ggml_metal_device_t dev = nullptr;
  std::string name;
  bool use_concurrency = true;
  bool use_graph_optimize = true;
  int debug_graph = 0;
  ggml_metal_event_t ev_cpy = nullptr;
};

namespace {

// Host memory of a tensor's bytes [offset, offset + size), found by its device address.
uint8_t* tensor_bytes(const ggml_tensor* t, size_t offset, size_t size) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(t->data) + offset;
  ggml_metal_buffer* buf = find_buffer(addr, size);
  GGML_ASSERT(buf != nullptr && "a tensor that is not in a Metal buffer");
  return host_address(buf, addr, size);
}

void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  out += '"';
}

std::string dispatch_json(const Dispatch& d) {
  std::string j = "{\"kernel\":";
  append_json_string(j, d.kernel);
  j += ",\"pipeline\":";
  append_json_string(j, d.pipeline);
  j += ",\"grid\":[" + std::to_string(d.grid[0]) + "," + std::to_string(d.grid[1]) + "," +
       std::to_string(d.grid[2]) + "],\"threads\":[" + std::to_string(d.threads[0]) + "," +
       std::to_string(d.threads[1]) + "," + std::to_string(d.threads[2]) + "],\"constants\":{";
  bool first = true;
  for (const auto& [idx, c] : d.constants) {
    j += (first ? "\"" : ",\"") + std::to_string(idx) + "\":" + std::to_string(c.value);
    first = false;
  }
  j += "},\"threadgroup_memory\":{";
  first = true;
  for (const auto& [idx, size] : d.threadgroup_memory) {
    j += (first ? "\"" : ",\"") + std::to_string(idx) + "\":" + std::to_string(size);
    first = false;
  }
  j += "},\"threadgroup_overrun\":" + std::to_string(d.threadgroup_overrun);
  j += ",\"buffers\":{";
  first = true;
  for (const auto& [idx, b] : d.bindings) {
    j += (first ? "\"" : ",\"") + std::to_string(idx) + "\":";
    j += b.bytes.empty() ? "[" + std::to_string(b.buffer) + "," + std::to_string(b.offset) + "]"
                         : "{\"bytes\":" + std::to_string(b.bytes.size()) + "}";
    first = false;
  }
  return j + "}}";
}

}  // namespace

extern "C" {

ggml_metal_t ggml_metal_init(ggml_metal_device_t dev) {
  auto* ctx = new ggml_metal();
  ctx->dev = dev;
  ctx->name = ggml_metal_device_get_props(dev)->name;
  ctx->use_concurrency = std::getenv("GGML_METAL_CONCURRENCY_DISABLE") == nullptr;
  ctx->use_graph_optimize = std::getenv("GGML_METAL_GRAPH_OPTIMIZE_DISABLE") == nullptr;
  const char* debug = std::getenv("GGML_METAL_GRAPH_DEBUG");
  ctx->debug_graph = debug ? std::atoi(debug) : 0;
  ctx->ev_cpy = ggml_metal_device_event_init(dev);
  return ctx;
}

void ggml_metal_free(ggml_metal_t ctx) {
  if (ctx == nullptr) return;
  ggml_metal_device_event_free(ctx->dev, ctx->ev_cpy);
  delete ctx;
}

const char* ggml_metal_get_name(ggml_metal_t ctx) { return ctx->name.c_str(); }

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
  t_last_error.clear();
  LoggingExecutor executor;
  ggml_metal_command_buffer cmd_buf{&executor};
  ggml_metal_op_t op =
      ggml_metal_op_init(ctx->dev, &cmd_buf, gf, ggml_metal_device_get_fusion_info(ctx->dev), 0,
                         ggml_graph_n_nodes(gf), ctx->use_concurrency, false, ctx->debug_graph);
  try {
    for (int idx = 0; idx < ggml_metal_op_n_nodes(op);) {
      const int consumed = ggml_metal_op_encode(op, idx);
      if (consumed == 0) break;
      idx += consumed;
    }
  } catch (const std::exception& e) {
    t_last_error = e.what();
  }
  ggml_metal_op_free(op);
  return t_last_error.empty() ? GGML_STATUS_SUCCESS : GGML_STATUS_FAILED;
}

void ggml_metal_graph_optimize(ggml_metal_t ctx, struct ggml_cgraph* gf) {
  if (ctx->use_graph_optimize) ggml_graph_optimize(gf);
}

void ggml_metal_event_record(ggml_metal_t, ggml_metal_event_t) {}
void ggml_metal_event_wait(ggml_metal_t, ggml_metal_event_t) {}
ggml_metal_event_t ggml_metal_get_ev_cpy(ggml_metal_t ctx) { return ctx->ev_cpy; }
void ggml_metal_set_n_cb(ggml_metal_t, int) {}
void ggml_metal_set_abort_callback(ggml_metal_t, ggml_abort_callback, void*) {}
bool ggml_metal_supports_family(ggml_metal_t ctx, int family) {
  return family <= ggml_metal_device_get_props(ctx->dev)->gpu_family;
}
void ggml_metal_capture_next_compute(ggml_metal_t) {}

namespace {
size_t copy_out(const std::string& text, char* out, size_t capacity) {
  if (out != nullptr && capacity > 0) {
    const size_t n = std::min(capacity - 1, text.size());
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return text.size();
}
}  // namespace

size_t gk_metal_dispatches_json(char* out, size_t capacity) {
  std::string text = "[";
  for (const Dispatch& d : DispatchLog::instance().records()) {
    if (text.size() > 1) text += ",";
    text += dispatch_json(d);
  }
  return copy_out(text + "]", out, capacity);
}

size_t gk_metal_threadgroups_json(char* out, size_t capacity) {
  std::string text = "{";
  for (const auto& [kernel, count] : DispatchLog::instance().threadgroups()) {
    if (text.size() > 1) text += ",";
    text += "\"" + kernel + "\":" + std::to_string(count);
  }
  return copy_out(text + "}", out, capacity);
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

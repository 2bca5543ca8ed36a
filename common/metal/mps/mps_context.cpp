// The backend context of upstream's ggml-metal-context.h (upstream: Objective-C over command
// queues of its own) on torch's MPS stream: a graph is encoded by upstream's ggml_metal_op_* on the
// stream's compute command encoder, inside the stream's serial queue, and left for torch to commit,
// so it runs in order with torch's own work on that stream. Plus the dispatch log and the C API of
// metal_device_api.h.
#include <Metal/Metal.hpp>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ggml-backend-impl.h"
#include "ggml-impl.h"
#include "ggml-metal-common.h"
#include "ggml-metal-context.h"
#include "ggml-metal-fusion.h"
#include "ggml-metal-ops.h"
#include "metal_device_api.h"
#include "mps_device.h"
#include "mps_platform.h"

namespace ggml_kernels::mps {

DispatchLog& DispatchLog::instance() {
  static DispatchLog* log = new DispatchLog();  // outlives every encoder
  return *log;
}

void DispatchLog::add(const DispatchRecord& d) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (records_.size() < kMaxRecords) records_.push_back(d);
  threadgroups_[d.pipeline->kernel] += int64_t{d.grid[0]} * d.grid[1] * d.grid[2];
}

void DispatchLog::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
  threadgroups_.clear();
}

namespace {

void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  out += '"';
}

template <typename Map, typename Value>
void append_json_map(std::string& out, const char* key, const Map& map, const Value& value) {
  out += std::string(",\"") + key + "\":{";
  bool first = true;
  for (const auto& [idx, v] : map) {
    out += (first ? "\"" : ",\"") + std::to_string(idx) + "\":" + value(v);
    first = false;
  }
  out += "}";
}

// The emulated device's record format; a buffer is numbered by its first appearance in the log.
std::string record_json(const DispatchRecord& d, std::map<const MTL::Buffer*, int>& ids) {
  std::string j = "{\"kernel\":";
  append_json_string(j, d.pipeline->kernel);
  j += ",\"pipeline\":";
  append_json_string(j, d.pipeline->name);
  j += ",\"grid\":[" + std::to_string(d.grid[0]) + "," + std::to_string(d.grid[1]) + "," +
       std::to_string(d.grid[2]) + "],\"threads\":[" + std::to_string(d.threads[0]) + "," +
       std::to_string(d.threads[1]) + "," + std::to_string(d.threads[2]) + "]";
  append_json_map(j, "constants", d.pipeline->constants,
                  [](const Constant& c) { return std::to_string(c.value); });
  append_json_map(j, "threadgroup_memory", d.threadgroup_memory,
                  [](size_t n) { return std::to_string(n); });
  std::map<int, std::string> args;
  for (const auto& [idx, b] : d.buffers) {
    const int id = ids.emplace(b.first, static_cast<int>(ids.size()) + 1).first->second;
    args[idx] = "[" + std::to_string(id) + "," + std::to_string(b.second) + "]";
  }
  for (const auto& [idx, n] : d.bytes) args[idx] = "{\"bytes\":" + std::to_string(n) + "}";
  append_json_map(j, "buffers", args, [](const std::string& v) { return v; });
  return j + "}";
}

}  // namespace

std::string DispatchLog::records_json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<const MTL::Buffer*, int> ids;
  std::string text = "[";
  for (const DispatchRecord& d : records_) {
    if (text.size() > 1) text += ",";
    text += record_json(d, ids);
  }
  return text + "]";
}

std::string DispatchLog::threadgroups_json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string text = "{";
  for (const auto& [kernel, count] : threadgroups_) {
    if (text.size() > 1) text += ",";
    append_json_string(text, kernel);
    text += ":" + std::to_string(count);
  }
  return text + "}";
}

}  // namespace ggml_kernels::mps

struct ggml_metal {
  ggml_metal_device_t dev = nullptr;
  std::string name;
  bool use_concurrency = true;
  bool use_graph_optimize = true;
  int debug_graph = 0;
  ggml_metal_event_t ev_cpy = nullptr;
};

namespace {

// One graph's encoding, run on the stream's queue by mps::encode. Nothing may unwind out of it (it
// runs inside the queue's frames): a failure is kept in `error` and raised on the caller's side.
struct GraphEncoding {
  ggml_metal_t ctx;
  ggml_cgraph* graph;
  std::string error;

  static void run(MTL::ComputeCommandEncoder* encoder, void* self) {
    static_cast<GraphEncoding*>(self)->encode(encoder);
  }

  void encode(MTL::ComputeCommandEncoder* encoder) {
    ggml_metal_command_buffer cmd_buf{encoder};
    ggml_metal_op_t op = nullptr;
    try {
      op = ggml_metal_op_init(
          ctx->dev, &cmd_buf, graph, ggml_metal_device_get_fusion_info(ctx->dev), 0,
          ggml_graph_n_nodes(graph), ctx->use_concurrency, false, ctx->debug_graph);
      for (int idx = 0; idx < ggml_metal_op_n_nodes(op);) {
        const int consumed = ggml_metal_op_encode(op, idx);
        if (consumed == 0) break;
        idx += consumed;
      }
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "ggml-kernels MPS: an unknown error while encoding a graph";
    }
    if (op != nullptr) ggml_metal_op_free(op);
  }
};

// The bytes of a tensor in a buffer of this layer: the one holding its virtual address.
ggml_metal_buffer_t buffer_of(const ggml_tensor* t) {
  const ggml_tensor* base = t->view_src != nullptr ? t->view_src : t;
  if (base->buffer == nullptr)
    throw std::runtime_error("ggml-kernels MPS: a tensor with no buffer");
  return static_cast<ggml_metal_buffer_t>(base->buffer->context);
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

void ggml_metal_synchronize(ggml_metal_t) { ggml_kernels::mps::synchronize(); }

// Through the host only where the buffer's storage is shared (ggml_metal_buffer_set_tensor says
// why not otherwise); the packages move MPS tensors with torch, never through here.
void ggml_metal_set_tensor_async(ggml_metal_t, struct ggml_tensor* tensor, const void* data,
                                 size_t offset, size_t size) {
  ggml_metal_buffer_set_tensor(buffer_of(tensor), tensor, data, offset, size);
}

void ggml_metal_get_tensor_async(ggml_metal_t, const struct ggml_tensor* tensor, void* data,
                                 size_t offset, size_t size) {
  ggml_metal_buffer_get_tensor(buffer_of(tensor), tensor, data, offset, size);
}

bool ggml_metal_cpy_tensor_async(ggml_metal_t, ggml_metal_t, const struct ggml_tensor*,
                                 struct ggml_tensor*) {
  return false;  // ggml copies another way
}

enum ggml_status ggml_metal_graph_compute(ggml_metal_t ctx, struct ggml_cgraph* gf) {
  std::string& last_error = ggml_kernels::mps::last_error();
  last_error.clear();
  GraphEncoding encoding{ctx, gf, {}};
  ggml_kernels::mps::encode(&GraphEncoding::run, &encoding);
  last_error = encoding.error;
  return last_error.empty() ? GGML_STATUS_SUCCESS : GGML_STATUS_FAILED;
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

// ---- the C API of metal_device_api.h ----

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
  return copy_out(ggml_kernels::mps::DispatchLog::instance().records_json(), out, capacity);
}

size_t gk_metal_threadgroups_json(char* out, size_t capacity) {
  return copy_out(ggml_kernels::mps::DispatchLog::instance().threadgroups_json(), out, capacity);
}

void gk_metal_dispatches_reset(void) { ggml_kernels::mps::DispatchLog::instance().reset(); }

const char* gk_metal_last_error(void) { return ggml_kernels::mps::last_error().c_str(); }

}  // extern "C"

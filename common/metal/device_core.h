// What every device layer of metal_device_api.h does the same way, whatever its device: the
// emulated device (common/metal/emu/) and the MPS device layer (common/metal/mps/) both build on
// it. Header-only and free of Apple types, so the emulated layer stays without any and the MPS
// layer stays one source for darwin and its Linux twin. What a layer does its own way stays in it,
// with the reason there:
//   - function constants as the host set them (the pipeline cache's key with the name);
//   - the dispatch log (records and threadgroups per kernel) and its JSON, the C API's format;
//   - the backend context of ggml-metal-context.h and the loop that encodes a graph with upstream's
//     ggml_metal_op_* (the functions that are the same in every layer: device_core_functions.h).
// It includes upstream's ggml-metal-device.h, -context.h and -ops.h: whoever includes it compiles
// with ggml's src/ggml-metal on the include path, as every device layer does.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ggml-impl.h"
#include "ggml-metal-common.h"
#include "ggml-metal-context.h"
#include "ggml-metal-device.h"
#include "ggml-metal-ops.h"

namespace ggml_kernels::device_core {

// A function-constant value as the host set it: index -> (type, value), bools and ints kept apart.
struct Constant {
  enum class Kind { Bool, Int16, Int32 } kind;
  int32_t value;
  bool operator==(const Constant& o) const { return kind == o.kind && value == o.value; }
  bool operator!=(const Constant& o) const { return !(*this == o); }
};
using Constants = std::map<int32_t, Constant>;

// ---- JSON of the C API (metal_device_api.h) ----

inline void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  out += '"';
}

// ,"key":{"idx":value(v),...}
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

// One dispatch record in the log's format, from what a layer knows of it. `overrun` is the
// emulator's finding (bytes a threadgroup wrote past its threadgroup memory); a GPU cannot tell,
// so a layer on Metal passes nullptr and the key is left out. `args` are the buffer arguments as
// the layer numbers its buffers ("[id,offset]") and inline bytes ("{"bytes":n}").
struct DispatchFields {
  const std::string& kernel;
  const std::string& pipeline;
  const int* grid;
  const int* threads;
  const Constants& constants;
  const std::map<int, size_t>& threadgroup_memory;
  const size_t* overrun;
  const std::map<int, std::string>& args;
};

// size_t ids: std::to_string of unsigned long long is not among the libc++ symbols a darwin build
// may import (tools/build/darwin.py's stubs).
inline std::string buffer_arg_json(size_t id, size_t offset) {
  return "[" + std::to_string(id) + "," + std::to_string(offset) + "]";
}

inline std::string bytes_arg_json(size_t size) {
  return "{\"bytes\":" + std::to_string(size) + "}";
}

inline std::string dispatch_json(const DispatchFields& d) {
  std::string j = "{\"kernel\":";
  append_json_string(j, d.kernel);
  j += ",\"pipeline\":";
  append_json_string(j, d.pipeline);
  j += ",\"grid\":[" + std::to_string(d.grid[0]) + "," + std::to_string(d.grid[1]) + "," +
       std::to_string(d.grid[2]) + "],\"threads\":[" + std::to_string(d.threads[0]) + "," +
       std::to_string(d.threads[1]) + "," + std::to_string(d.threads[2]) + "]";
  append_json_map(j, "constants", d.constants,
                  [](const Constant& c) { return std::to_string(c.value); });
  append_json_map(j, "threadgroup_memory", d.threadgroup_memory,
                  [](size_t n) { return std::to_string(n); });
  if (d.overrun != nullptr) j += ",\"threadgroup_overrun\":" + std::to_string(*d.overrun);
  append_json_map(j, "buffers", d.args, [](const std::string& v) { return v; });
  return j + "}";
}

// Copies `text` into out[0, capacity) NUL-terminated; returns the length the full text needs.
inline size_t copy_out(const std::string& text, char* out, size_t capacity) {
  if (out != nullptr && capacity > 0) {
    const size_t n = std::min(capacity - 1, text.size());
    std::memcpy(out, text.data(), n);
    out[n] = '\0';
  }
  return text.size();
}

// ---- the dispatch log ----

// The dispatches since the last reset, per process: threadgroups dispatched per kernel name, and
// the full records (what tests inspect) of the first kMaxRecords (a model's run makes many more;
// the counts go on). A layer keeps its own Record (what its device knows of a dispatch).
template <typename Record>
class RecordLog {
 public:
  static constexpr size_t kMaxRecords = 20000;

  void add(const Record& r, const std::string& kernel, const int grid[3]) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (records_.size() < kMaxRecords) records_.push_back(r);
    threadgroups_[kernel] += int64_t{grid[0]} * grid[1] * grid[2];
  }

  std::vector<Record> records() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return records_;
  }

  std::map<std::string, int64_t> threadgroups() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return threadgroups_;
  }

  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    records_.clear();
    threadgroups_.clear();
  }

  // [to_json(record), ...] in dispatch order; to_json may keep state across the records (a layer
  // that numbers its buffers by first appearance).
  template <typename ToJson>
  std::string records_json(ToJson&& to_json) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string text = "[";
    for (const Record& r : records_) {
      if (text.size() > 1) text += ",";
      text += to_json(r);
    }
    return text + "]";
  }

  std::string threadgroups_json() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string text = "{";
    for (const auto& [kernel, count] : threadgroups_) {
      if (text.size() > 1) text += ",";
      append_json_string(text, kernel);
      text += ":" + std::to_string(count);
    }
    return text + "}";
  }

 private:
  mutable std::mutex mutex_;
  std::vector<Record> records_;
  std::map<std::string, int64_t> threadgroups_;
};

}  // namespace ggml_kernels::device_core

// ---- the backend context of ggml-metal-context.h ----

// Upstream's settings from the environment; no command queue of its own in any layer (the emulated
// device runs each dispatch as it is encoded, the MPS layer encodes on torch's stream).
struct ggml_metal {
  ggml_metal_device_t dev = nullptr;
  std::string name;
  bool use_concurrency = true;
  bool use_graph_optimize = true;
  int debug_graph = 0;
  ggml_metal_event_t ev_cpy = nullptr;
};

namespace ggml_kernels::device_core {

// Encodes the whole graph with upstream's ggml_metal_op_* into `cmd_buf`, in one command buffer
// (upstream's n_cb split is for overlapping its own command buffers, which no layer has). Throws
// nothing: returns the failure's message ("" when none), `layer` naming who failed on an exception
// that carries none.
inline std::string encode_graph(ggml_metal_t ctx, ggml_metal_cmd_buf_t cmd_buf, ggml_cgraph* graph,
                                const char* layer) {
  std::string error;
  ggml_metal_op_t op = nullptr;
  try {
    op = ggml_metal_op_init(ctx->dev, cmd_buf, graph, ggml_metal_device_get_fusion_info(ctx->dev),
                            0, ggml_graph_n_nodes(graph), ctx->use_concurrency, false,
                            ctx->debug_graph);
    for (int idx = 0; idx < ggml_metal_op_n_nodes(op);) {
      const int consumed = ggml_metal_op_encode(op, idx);
      if (consumed == 0) break;
      idx += consumed;
    }
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = std::string(layer) + ": an unknown error while encoding a graph";
  }
  if (op != nullptr) ggml_metal_op_free(op);
  return error;
}

}  // namespace ggml_kernels::device_core

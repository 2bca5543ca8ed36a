// What the packages' two Metal backends do alike around upstream's ggml-metal backend
// (metal_backend.cpp over the emulated device; mps/mps_backend.cpp over the MPS device layer on
// torch's MPS stream, built for the Linux twin and for macOS): open the device once per process,
// load the runtime library, hold the device for one graph at a time, place the graph's tensors and
// views in Metal buffers and compute it. Each backend keeps what differs: how a graph's memory is
// bound (uploaded into one buffer, or torch's storages wrapped where they lie) and what follows the
// compute (read back into host memory, or copies on the stream and a synchronize).
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ggml_runtime.h"
#include "metal_graph.h"

namespace ggml_kernels::backend_core {

struct Device {
  std::mutex mu;  // one graph at a time: the device runs one command buffer, the stream one encoder
  ggml_backend_t backend = nullptr;
  ggml_backend_buffer_type_t buft = nullptr;
  size_t alignment = 0;
  size_t max_size = 0;  // the largest buffer the device allocates
};

// Upstream's Metal backend on the runtime's device, opened at first use; it lives for the process.
inline Device& device() {
  static Device* dev = [] {
    const auto& G = ggml();
    auto* created = new Device();
    created->backend = G.ggml_backend_metal_init();
    TORCH_CHECK(created->backend != nullptr,
                "ggml-kernels: ggml_backend_metal_init() failed: ", G.gk_metal_last_error());
    created->buft = G.ggml_backend_get_default_buffer_type(created->backend);
    created->alignment = G.ggml_backend_buft_get_alignment(created->buft);
    created->max_size = G.ggml_backend_buft_get_max_size(created->buft);
    return created;
  }();
  return *dev;
}

// The Metal runtime `library` (beside this extension) loaded into `api`: its path, and its handle
// for the functions a backend resolves itself. `if_missing` says what a build without it lacks.
inline std::pair<std::string, void*> load_runtime(GgmlApi& api, const std::string& library,
                                                  const char* if_missing) {
  const std::string path = this_library_dir() + "/" + library;
  TORCH_CHECK(file_exists(path), "ggml-kernels: the Metal runtime ", path, " is missing (",
              if_missing, ")");
  std::string error;
  void* handle = open_runtime(path, Functions::Metal, api, error);
  TORCH_CHECK(handle != nullptr, "ggml-kernels: cannot load the Metal runtime ", path, ": ", error);
  return {path, handle};
}

// One graph's hold on the device, for as long as the backend binds, runs and finishes it: refuses
// an op upstream has no kernel for, lists every tensor the results depend on (`order`: a view
// after its source, a node after its operands) and puts each back as the graph built it when the
// run ends, however it ends.
struct GraphRun {
  GraphRun(Device& dev, ggml_cgraph* graph, ggml_tensor* const* wanted, size_t count)
      : lock(dev.mu), results(wanted, wanted + count) {
    metal_graph::check_supported(dev.backend, graph);
    std::unordered_set<ggml_tensor*> seen;
    for (size_t i = 0; i < count; ++i) metal_graph::collect(wanted[i], order, seen);
    for (ggml_tensor* t : order) restore.saved.emplace_back(t, *t);
  }
  bool is_result(ggml_tensor* t) const { return results.count(t) > 0; }

  std::lock_guard<std::mutex> lock;
  const std::unordered_set<ggml_tensor*> results;
  std::vector<ggml_tensor*> order;
  metal_graph::Restore restore;
};

// ValueError, before anything is made, unless `bytes` of `what` fit in one of the device's buffers.
inline void check_fits(const Device& dev, size_t bytes, const char* what) {
  TORCH_CHECK_VALUE(bytes <= dev.max_size, "ggml-metal: this call needs ", bytes,
                    " bytes of device memory for ", what, "; the device's buffers hold at most ",
                    dev.max_size);
}

// The offset of non-view tensor t in a buffer whose first `total` bytes are taken; takes its room.
inline size_t take_room(const Device& dev, ggml_tensor* t, size_t& total) {
  const size_t offset = total;
  total += metal_graph::aligned(metal_graph::room(dev.buft, t), dev.alignment);
  return offset;
}

// A result the device computes apart from its host or torch memory is laid out densely there.
inline void make_dense(ggml_tensor* t) {
  const auto& G = ggml();
  t->nb[0] = G.ggml_type_size(t->type);
  t->nb[1] = G.ggml_row_size(t->type, t->ne[0]);
  for (int i = 2; i < 4; ++i) t->nb[i] = t->nb[i - 1] * static_cast<size_t>(t->ne[i - 1]);
}

// Places every tensor of `order` in Metal buffers: a view over its source (placed before it), any
// other tensor at where(t), a {buffer, address in it}.
template <class Where>
void place_all(const std::vector<ggml_tensor*>& order, Where&& where) {
  const auto& G = ggml();
  for (ggml_tensor* t : order) {
    const bool view = t->view_src != nullptr;
    const std::pair<ggml_backend_buffer_t, char*> spot =
        view ? std::pair<ggml_backend_buffer_t, char*>{} : where(t);
    t->data = nullptr;
    t->buffer = nullptr;
    const ggml_status placed = view ? G.ggml_backend_view_init(t)
                                    : G.ggml_backend_tensor_alloc(spot.first, t, spot.second);
    TORCH_CHECK(placed == GGML_STATUS_SUCCESS, "ggml-kernels: could not place a ",
                view ? "view" : "tensor", " in its Metal buffer");
  }
}

// Runs the graph on the device; a failure is a RuntimeError with the device layer's last error.
inline void compute(const Device& dev, ggml_cgraph* graph) {
  const auto& G = ggml();
  const ggml_status status = G.ggml_backend_graph_compute(dev.backend, graph);
  TORCH_CHECK(status == GGML_STATUS_SUCCESS, "ggml-metal: the graph failed (status ",
              static_cast<int>(status), "): ", G.gk_metal_last_error());
}

}  // namespace ggml_kernels::backend_core

// The Metal backend of the packages' ggml graphs: upstream's ggml-metal backend, whose host code
// chooses every kernel, grid, function constant and threadgroup memory size, over the device layer
// of the runtime library.
//
// The emulated build loads libggml-kernels-metal-emu.so (tools/build/metal_runtime.py), whose
// device runs the dispatches on the CPU and whose buffers are not host memory: a graph's host
// leaves are uploaded into one Metal buffer, its other nodes get room there, and its results are
// read back into the host memory they were bound to. (A build on torch's MPS stream will bind the
// tensors' own Metal buffers instead of copying; the rest stays.) That buffer is kept for the next
// graph up to GraphMemory::kKeptBytes; a bigger one is freed when its call returns, so a large call
// leaves no device memory behind. A graph needing more than the device's largest buffer is a
// ValueError before anything is copied.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "ggml_torch.h"
#include "metal_graph.h"

namespace ggml_kernels {

using namespace metal_graph;

namespace {

constexpr const char* kLibrary = "libggml-kernels-metal-emu.so";

struct Device {
  std::mutex mu;  // one graph at a time: the device runs one command buffer
  ggml_backend_t backend = nullptr;
  ggml_backend_buffer_type_t buft = nullptr;
  ggml_backend_buffer_t buffer = nullptr;  // reused by every graph, grown when one needs more
  size_t alignment = 0;
  size_t max_size = 0;  // the largest buffer the device allocates
};

Device& device() {
  static Device* dev = [] {
    const auto& G = ggml();
    auto* created = new Device();  // lives for the whole process
    created->backend = G.ggml_backend_metal_init();
    TORCH_CHECK(created->backend != nullptr, "ggml-kernels: ggml_backend_metal_init() failed");
    created->buft = G.ggml_backend_get_default_buffer_type(created->backend);
    created->alignment = G.ggml_backend_buft_get_alignment(created->buft);
    created->max_size = G.ggml_backend_buft_get_max_size(created->buft);
    return created;
  }();
  return *dev;
}

// A tensor of the graph that holds host memory (a leaf over a torch tensor, or a result bound to
// its output), with that memory's layout.
struct HostTensor {
  ggml_tensor* t;
  char* host;
  size_t nb[4];
  bool result;
};

// A result's bytes on the device are laid out densely; its host rows may be strided.
void make_dense(ggml_tensor* t) {
  const auto& G = ggml();
  t->nb[0] = G.ggml_type_size(t->type);
  t->nb[1] = G.ggml_row_size(t->type, t->ne[0]);
  for (int i = 2; i < 4; ++i) t->nb[i] = t->nb[i - 1] * static_cast<size_t>(t->ne[i - 1]);
}

void read_back(const HostTensor& h) {
  const auto& G = ggml();
  ggml_tensor* t = h.t;
  if (std::equal(std::begin(h.nb), std::end(h.nb), std::begin(t->nb))) {  // dense on the host too
    G.ggml_backend_tensor_get(t, h.host, 0, G.ggml_nbytes(t));
    return;
  }
  std::vector<char> dense(G.ggml_nbytes(t));
  G.ggml_backend_tensor_get(t, dense.data(), 0, dense.size());
  const size_t row = t->nb[1];
  const char* src = dense.data();
  for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
      for (int64_t i1 = 0; i1 < t->ne[1]; ++i1, src += row)
        std::memcpy(h.host + i1 * h.nb[1] + i2 * h.nb[2] + i3 * h.nb[3], src, row);
}

// Room for every tensor that is not a view, in `order`; returns the offsets and the total.
std::vector<size_t> place(Device& dev, const std::vector<ggml_tensor*>& order, size_t& total) {
  std::vector<size_t> offsets(order.size(), 0);
  total = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i]->view_src != nullptr) continue;
    offsets[i] = total;
    total += aligned(room(dev.buft, order[i]), dev.alignment);
  }
  return offsets;
}

void release(Device& dev) {
  if (dev.buffer != nullptr) ggml().ggml_backend_buffer_free(dev.buffer);
  dev.buffer = nullptr;
}

void reserve(Device& dev, size_t bytes) {
  const auto& G = ggml();
  TORCH_CHECK_VALUE(bytes <= dev.max_size, "ggml-metal: this call needs ", bytes,
                    " bytes of device memory for its tensors; the device's buffers hold at most ",
                    dev.max_size);
  if (dev.buffer != nullptr && G.ggml_backend_buffer_get_size(dev.buffer) >= bytes) return;
  release(dev);
  dev.buffer = G.ggml_backend_buft_alloc_buffer(dev.buft, std::max(bytes, size_t{1} << 20));
  TORCH_CHECK(dev.buffer != nullptr, "ggml-kernels: could not allocate a ", bytes,
              "-byte Metal buffer");
}

// Frees the device buffer when the call returns (or throws) if it is bigger than what is kept.
struct ReleaseIfBig {
  Device& dev;
  ~ReleaseIfBig() {
    if (dev.buffer != nullptr &&
        ggml().ggml_backend_buffer_get_size(dev.buffer) > GraphMemory::kKeptBytes)
      release(dev);
  }
};

}  // namespace

const char* backend_name() { return "metal-emu"; }
const c10::DeviceType backend::kDevice = c10::DeviceType::CPU;  // uploaded, run, read back
const bool backend::kSlicesOverThreads = false;
const bool backend::kNotesTensors = false;

backend::Loaded backend::load(GgmlApi& api) {
  const std::string path = this_library_dir() + "/" + kLibrary;
  TORCH_CHECK(file_exists(path), "ggml-kernels: the Metal runtime ", path,
              " is missing (this build is incomplete: rebuild it with `nox -s build`)");
  std::string error;
  TORCH_CHECK(open_runtime(path, Functions::Metal, api, error) != nullptr,
              "ggml-kernels: cannot load the Metal runtime ", path, ": ", error);
  return {path, ""};
}

void backend::run_graph(ggml_cgraph* graph, ggml_tensor* const* results, size_t count, int,
                        GraphMemory&) {
  const auto& G = ggml();
  Device& dev = device();
  std::lock_guard<std::mutex> lock(dev.mu);
  check_supported(dev.backend, graph);

  std::vector<ggml_tensor*> order;
  std::unordered_set<ggml_tensor*> seen;
  for (size_t i = 0; i < count; ++i) collect(results[i], order, seen);
  const std::unordered_set<ggml_tensor*> wanted(results, results + count);
  Restore restore;
  std::vector<HostTensor> host;
  for (ggml_tensor* t : order) {
    restore.saved.emplace_back(t, *t);
    const bool result = wanted.count(t) > 0;
    if (!result && (t->view_src != nullptr || t->data == nullptr)) continue;
    // a result that is a view must be dense (a reshape, or an in-place op's result over its whole
    // source such as SET_ROWS into a cache): it is read back through its source's memory
    TORCH_CHECK(t->view_src == nullptr || G.ggml_is_contiguous(t),
                "ggml-kernels: a graph result is a strided view; make it ggml_cont first");
    HostTensor h{t, static_cast<char*>(t->data), {t->nb[0], t->nb[1], t->nb[2], t->nb[3]}, result};
    if (h.result) make_dense(t);
    host.push_back(h);
  }
  size_t total = 0;
  const std::vector<size_t> offsets = place(dev, order, total);
  ReleaseIfBig release_if_big{dev};
  reserve(dev, total);
  char* base = static_cast<char*>(G.ggml_backend_buffer_get_base(dev.buffer));
  for (size_t i = 0; i < order.size(); ++i) {
    ggml_tensor* t = order[i];
    t->data = nullptr;
    t->buffer = nullptr;
    if (t->view_src != nullptr) {
      TORCH_CHECK(G.ggml_backend_view_init(t) == GGML_STATUS_SUCCESS,
                  "ggml-kernels: could not place a view in the Metal buffer");
    } else {
      TORCH_CHECK(
          G.ggml_backend_tensor_alloc(dev.buffer, t, base + offsets[i]) == GGML_STATUS_SUCCESS,
          "ggml-kernels: could not place a tensor in the Metal buffer");
    }
  }
  for (const HostTensor& h : host)
    if (!h.result) G.ggml_backend_tensor_set(h.t, h.host, 0, G.ggml_nbytes(h.t));

  const ggml_status status = G.ggml_backend_graph_compute(dev.backend, graph);
  TORCH_CHECK(status == GGML_STATUS_SUCCESS, "ggml-metal: the graph failed (status ",
              static_cast<int>(status), "): ", G.gk_metal_last_error());
  for (const HostTensor& h : host)
    if (h.result) read_back(h);
}

}  // namespace ggml_kernels

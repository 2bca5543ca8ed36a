// The Metal backend of the packages' ggml graphs: upstream's ggml-metal backend, whose host code
// chooses every kernel, grid, function constant and threadgroup memory size, over the device layer
// of the runtime library.
//
// The emulated build loads libggml-kernels-metal-emu.so (tools/build/metal_runtime.py), whose
// device runs the dispatches on the CPU and whose buffers are not host memory: a graph's host
// leaves are uploaded into one Metal buffer, its other nodes get room there, and its results are
// read back into the host memory they were bound to. (The build on torch's MPS stream,
// mps/mps_backend.cpp, binds the tensors' own Metal buffers instead; what both do alike is
// backend_core.h.) That buffer is kept for the next graph up to GraphMemory::kKeptBytes; a bigger
// one is freed when its call returns, so a large call leaves no device memory behind. A graph
// needing more than the device's largest buffer is a ValueError before anything is copied.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "ggml_torch.h"
#include "metal/backend_core.h"

namespace ggml_kernels {

using namespace backend_core;

namespace {

constexpr const char* kLibrary = "libggml-kernels-metal-emu.so";

// The buffer every graph is placed in, grown when one needs more (under the device's lock).
ggml_backend_buffer_t g_buffer = nullptr;

// A tensor of the graph that holds host memory (a leaf over a torch tensor, or a result bound to
// its output), with that memory's layout.
struct HostTensor {
  ggml_tensor* t;
  char* host;
  size_t nb[4];
  bool result;
};

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

// The tensors of the run that hold host memory, in order; a result is made dense on the device.
std::vector<HostTensor> host_tensors(const GraphRun& run) {
  std::vector<HostTensor> host;
  for (ggml_tensor* t : run.order) {
    const bool result = run.is_result(t);
    if (!result && (t->view_src != nullptr || t->data == nullptr)) continue;
    // a result that is a view must be dense (a reshape, or an in-place op's result over its whole
    // source such as SET_ROWS into a cache): it is read back through its source's memory
    TORCH_CHECK(t->view_src == nullptr || ggml().ggml_is_contiguous(t),
                "ggml-kernels: a graph result is a strided view; make it ggml_cont first");
    HostTensor h{t, static_cast<char*>(t->data), {t->nb[0], t->nb[1], t->nb[2], t->nb[3]}, result};
    if (h.result) make_dense(t);
    host.push_back(h);
  }
  return host;
}

void release() {
  if (g_buffer != nullptr) ggml().ggml_backend_buffer_free(g_buffer);
  g_buffer = nullptr;
}

void reserve(Device& dev, size_t bytes) {
  const auto& G = ggml();
  check_fits(dev, bytes, "its tensors");
  if (g_buffer != nullptr && G.ggml_backend_buffer_get_size(g_buffer) >= bytes) return;
  release();
  g_buffer = G.ggml_backend_buft_alloc_buffer(dev.buft, std::max(bytes, size_t{1} << 20));
  TORCH_CHECK(g_buffer != nullptr, "ggml-kernels: could not allocate a ", bytes,
              "-byte Metal buffer");
}

// Frees the device buffer when the call returns (or throws) if it is bigger than what is kept.
struct ReleaseIfBig {
  ~ReleaseIfBig() {
    if (g_buffer != nullptr &&
        ggml().ggml_backend_buffer_get_size(g_buffer) > GraphMemory::kKeptBytes)
      release();
  }
};

}  // namespace

const char* backend_name() { return "metal-emu"; }
const c10::DeviceType backend::kDevice = c10::DeviceType::CPU;  // uploaded, run, read back
const bool backend::kSlicesOverThreads = false;
const bool backend::kIntelCpu = false;
const bool backend::kNotesTensors = false;

backend::Loaded backend::load(GgmlApi& api) {
  const std::string path =
      load_runtime(api, kLibrary, "this build is incomplete: rebuild it with `nox -s build`").first;
  return {path, ""};
}

void backend::run_graph(ggml_cgraph* graph, ggml_tensor* const* results, size_t count, int,
                        GraphMemory&) {
  const auto& G = ggml();
  Device& dev = device();
  GraphRun run(dev, graph, results, count);
  const std::vector<HostTensor> host = host_tensors(run);
  std::unordered_map<ggml_tensor*, size_t> offset;  // of every tensor that is not a view
  size_t total = 0;
  for (ggml_tensor* t : run.order)
    if (t->view_src == nullptr) offset[t] = take_room(dev, t, total);
  ReleaseIfBig release_if_big;
  reserve(dev, total);
  char* base = static_cast<char*>(G.ggml_backend_buffer_get_base(g_buffer));
  place_all(run.order, [&](ggml_tensor* t) { return std::pair{g_buffer, base + offset.at(t)}; });
  for (const HostTensor& h : host)
    if (!h.result) G.ggml_backend_tensor_set(h.t, h.host, 0, G.ggml_nbytes(h.t));

  compute(dev, graph);
  for (const HostTensor& h : host)
    if (h.result) read_back(h);
}

}  // namespace ggml_kernels

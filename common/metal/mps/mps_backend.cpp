// The MPS backend of the packages' ggml graphs: upstream's ggml-metal backend, whose host code
// chooses every kernel, grid, function constant and threadgroup memory size, over the MPS device
// layer of the runtime library (mps_device.cpp, mps_context.cpp), on torch's current MPS stream.
//
// Nothing is uploaded or read back. Each torch storage a graph's leaves and results lie in
// (Graph::note) is wrapped once, without a copy, as a ggml backend buffer over its own Metal buffer
// (ggml_backend_dev_buffer_from_host_ptr with the MTL::Buffer*: mps_device.cpp's
// ggml_metal_buffer_map), and the tensors are placed at their byte offsets in it, so two views of
// one storage share addresses as upstream's concurrency checks expect. The other nodes get room in
// one byte tensor from torch's allocator, wrapped the same way; so does a result whose memory
// cannot take it in place (strided, or an op that keeps scratch data after its result), which
// torch then copies to its place on the same stream. The graph is encoded on the stream after
// torch's pending work and before what follows; nothing waits, unless the tensors are host memory
// (the Linux twin's stand-ins for MPS tensors), which must hold their values when the op returns.
// What this backend does alike with the emulated device's (metal_backend.cpp) is backend_core.h.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ggml_torch.h"
#include "metal/backend_core.h"
#include "mps_platform.h"

#ifndef GGML_KERNELS_MPS_RUNTIME  // the build names the runtime library of its platform
#define GGML_KERNELS_MPS_RUNTIME "libggml-kernels-metal.dylib"
#endif
#ifndef GGML_KERNELS_MPS_DEVICE  // the Linux twin's stand-ins for MPS tensors are CPU tensors
#define GGML_KERNELS_MPS_DEVICE MPS
#endif
#ifndef GGML_KERNELS_MPS_BACKEND_NAME  // the Linux twin's build is "mps-emu" (info()["backend"])
#define GGML_KERNELS_MPS_BACKEND_NAME "metal"
#endif

namespace ggml_kernels {

using namespace backend_core;

namespace {

// ggml-backend functions the other backends do not call, resolved from the runtime at load.
struct MpsApi {
  decltype(&::ggml_backend_get_device) get_device = nullptr;
  decltype(&::ggml_backend_dev_buffer_from_host_ptr) buffer_from_host_ptr = nullptr;
};
MpsApi g_mps_api;

// The ggml device of upstream's backend, which wraps the storages' Metal buffers.
ggml_backend_dev_t backend_device(const Device& dev) {
  static ggml_backend_dev_t of_backend = g_mps_api.get_device(dev.backend);
  return of_backend;
}

// The ggml backend buffers wrapping one graph's torch storages, freed when the graph is encoded
// (the stream keeps the Metal buffers it was given; torch keeps the storages, `keep` here the
// scratch and copies, until then).
struct Wrapped {
  std::map<MTL::Buffer*, ggml_backend_buffer_t> buffers;
  std::vector<at::Tensor> keep;
  ~Wrapped() {
    for (auto& [mtl, buffer] : buffers) ggml().ggml_backend_buffer_free(buffer);
  }

  // The buffer of t's storage (wrapped on first use) and the device address of its byte `offset`.
  std::pair<ggml_backend_buffer_t, char*> locate(const Device& dev, const at::Tensor& t,
                                                 size_t offset) {
    MTL::Buffer* mtl = mps::tensor_buffer(t);
    ggml_backend_buffer_t& buffer = buffers[mtl];
    if (buffer == nullptr) {
      const size_t size = t.storage().nbytes();
      // upstream's mapped buffer takes what it is given: beyond the device's limit is refused here
      TORCH_CHECK_VALUE(size <= dev.max_size, "ggml-metal: a tensor's storage of ", size,
                        " bytes is more than the device's buffers hold (", dev.max_size, ")");
      buffer = g_mps_api.buffer_from_host_ptr(backend_device(dev), mtl, size, size);
      TORCH_CHECK(buffer != nullptr, "ggml-kernels MPS: could not wrap a ", size,
                  "-byte MPS storage as a Metal buffer");
    }
    return {buffer, static_cast<char*>(ggml().ggml_backend_buffer_get_base(buffer)) + offset};
  }
};

c10::ScalarType torch_dtype(ggml_type type) {
  switch (type) {
    case GGML_TYPE_F32: return at::kFloat;
    case GGML_TYPE_F16: return at::kHalf;
    case GGML_TYPE_BF16: return at::kBFloat16;
    case GGML_TYPE_I32: return at::kInt;
    default:
      TORCH_CHECK(false, "ggml-kernels MPS: a graph result of type ", type_name(type),
                  " cannot be copied to its output");
  }
}

// ggml's ne/nb (fastest first, bytes) as torch sizes/strides (slowest first, elements).
void torch_layout(const ggml_tensor* g, std::vector<int64_t>& sizes,
                  std::vector<int64_t>& strides) {
  const int64_t es = static_cast<int64_t>(ggml().ggml_type_size(g->type));
  sizes.clear(), strides.clear();
  for (int i = 3; i >= 0; --i) {
    sizes.push_back(g->ne[i]);
    strides.push_back(static_cast<int64_t>(g->nb[i]) / es);
  }
}

bool dense(const ggml_tensor* g) {
  const auto& G = ggml();
  size_t expected = G.ggml_type_size(g->type);
  if (g->nb[0] != expected) return false;
  expected = G.ggml_row_size(g->type, g->ne[0]);
  for (int i = 1; i < 4; ++i) {
    if (g->ne[i] > 1 && g->nb[i] != expected) return false;
    expected *= static_cast<size_t>(g->ne[i]);
  }
  return true;
}

// Where each tensor of the graph goes: its own torch storage, or the scratch tensor.
struct Placement {
  std::unordered_map<ggml_tensor*, at::Tensor> owner;       // tensor -> the torch tensor it lies in
  std::unordered_map<ggml_tensor*, size_t> owner_byte;      // tensor -> its byte in owner's storage
  std::unordered_map<ggml_tensor*, size_t> scratch;         // tensor -> offset in the scratch
  std::vector<std::pair<ggml_tensor*, at::Tensor>> copies;  // results computed in the scratch
  // results that are views (a reshape of the last node): their bytes are their source's, wherever
  // it is placed; copied to their tensor unless the source lies in that tensor's storage
  std::vector<std::pair<ggml_tensor*, at::Tensor>> view_copies;
  size_t scratch_bytes = 0;
  at::TensorOptions options;  // of the graph's tensors: where the scratch is made
};

size_t byte_offset(const ggml_tensor* g, const at::Tensor& t) {
  return static_cast<size_t>(static_cast<const char*>(g->data) -
                             static_cast<const char*>(t.data_ptr()));
}

// Whether `g` can be computed or read right where it lies in t's storage.
bool fits_in_place(Device& dev, ggml_tensor* g, const at::Tensor& t, bool result) {
  const size_t at_byte = mps::tensor_offset(t) + byte_offset(g, t);
  const size_t bytes = result ? metal_graph::room(dev.buft, g) : ggml().ggml_nbytes(g);
  return (!result || dense(g)) && at_byte + bytes <= t.storage().nbytes();
}

// The elements of t that ggml tensor `g` (noted in t) covers, as a torch view.
at::Tensor as_placed(const ggml_tensor* g, const at::Tensor& t) {
  std::vector<int64_t> sizes, strides;
  torch_layout(g, sizes, strides);
  const int64_t es = t.element_size();
  return t.as_strided(sizes, strides, t.storage_offset() + byte_offset(g, t) / es);
}

// A view's elements where its source was placed: at byte `offset` of `base`'s storage.
at::Tensor view_at(const at::Tensor& base, size_t offset, const ggml_tensor* view) {
  std::vector<int64_t> sizes, strides;
  torch_layout(view, sizes, strides);
  const auto es = static_cast<size_t>(ggml().ggml_type_size(view->type));
  return at::empty({0}, base.options().dtype(torch_dtype(view->type)))
      .set_(base.storage(), static_cast<int64_t>(offset / es), sizes, strides);
}

Placement place(Device& dev, const GraphRun& run, GraphMemory& memory) {
  Placement p;
  std::unordered_map<ggml_tensor*, at::Tensor> noted(memory.tensors.begin(), memory.tensors.end());
  TORCH_CHECK(!noted.empty(), "ggml-kernels MPS: a graph with no torch tensor in it");
  p.options = noted.begin()->second.options().dtype(at::kByte);
  for (ggml_tensor* g : run.order) {
    if (g->view_src != nullptr) {  // placed with its source
      auto it = noted.find(g);
      if (run.is_result(g) && it != noted.end())
        p.view_copies.emplace_back(g, as_placed(g, it->second));
      continue;
    }
    const bool result = run.is_result(g);
    auto it = noted.find(g);
    if (it == noted.end()) {
      TORCH_CHECK(g->data == nullptr,
                  "ggml-kernels MPS: a graph leaf over memory of no noted torch tensor "
                  "(Graph::raw without Graph::note)");
    } else if (fits_in_place(dev, g, it->second, result)) {
      p.owner.emplace(g, it->second);
      p.owner_byte.emplace(g, mps::tensor_offset(it->second) + byte_offset(g, it->second));
      continue;
    } else {
      TORCH_CHECK(result, "ggml-kernels MPS: a graph leaf reaches past its tensor's storage");
      p.copies.emplace_back(g, as_placed(g, it->second));
      make_dense(g);  // in the scratch (Restore puts its strides back)
    }
    p.scratch.emplace(g, take_room(dev, g, p.scratch_bytes));
  }
  return p;
}

// A dense torch view of a result computed at byte `offset` of the scratch tensor.
at::Tensor scratch_view(const at::Tensor& scratch, size_t offset, const ggml_tensor* g) {
  std::vector<int64_t> sizes, strides;
  torch_layout(g, sizes, strides);
  const auto bytes = static_cast<int64_t>(ggml().ggml_nbytes(g));
  return scratch.narrow(0, static_cast<int64_t>(offset), bytes)
      .view(torch_dtype(g->type))
      .view(sizes);
}

}  // namespace

const char* backend_name() { return GGML_KERNELS_MPS_BACKEND_NAME; }
const c10::DeviceType backend::kDevice = c10::DeviceType::GGML_KERNELS_MPS_DEVICE;
const bool backend::kSlicesOverThreads = false;
const bool backend::kIntelCpu = false;
const bool backend::kNotesTensors = true;

backend::Loaded backend::load(GgmlApi& api) {
  const auto [path, handle] =
      load_runtime(api, GGML_KERNELS_MPS_RUNTIME, "this build is incomplete");
  g_mps_api.get_device =
      reinterpret_cast<decltype(g_mps_api.get_device)>(dlsym(handle, "ggml_backend_get_device"));
  g_mps_api.buffer_from_host_ptr = reinterpret_cast<decltype(g_mps_api.buffer_from_host_ptr)>(
      dlsym(handle, "ggml_backend_dev_buffer_from_host_ptr"));
  TORCH_CHECK(g_mps_api.get_device != nullptr && g_mps_api.buffer_from_host_ptr != nullptr,
              "ggml-kernels: ", path, " lacks ggml-backend's device buffer functions");
  return {path, ""};
}

void backend::run_graph(ggml_cgraph* graph, ggml_tensor* const* results, size_t count, int,
                        GraphMemory& memory) {
  Device& dev = device();
  GraphRun run(dev, graph, results, count);
  const Placement p = place(dev, run, memory);
  check_fits(dev, p.scratch_bytes, "its intermediate results");

  Wrapped wrapped;
  at::Tensor scratch;
  if (p.scratch_bytes > 0) {
    scratch = at::empty({static_cast<int64_t>(p.scratch_bytes)}, p.options);
    wrapped.keep.push_back(scratch);
  }
  place_all(run.order, [&](ggml_tensor* g) {
    if (auto own = p.owner.find(g); own != p.owner.end())
      return wrapped.locate(dev, own->second, p.owner_byte.at(g));
    return wrapped.locate(dev, scratch, mps::tensor_offset(scratch) + p.scratch.at(g));
  });

  compute(dev, graph);
  const bool host_memory = !p.options.device().is_mps();
  if (host_memory && !(p.copies.empty() && p.view_copies.empty())) mps::synchronize();
  for (const auto& [g, out] : p.copies) out.copy_(scratch_view(scratch, p.scratch.at(g), g));
  for (const auto& [g, out] : p.view_copies) {
    ggml_tensor* src = g->view_src;
    if (auto own = p.owner.find(src); own != p.owner.end()) {
      const at::Tensor& t = own->second;
      if (t.storage().is_alias_of(out.storage())) continue;  // computed where it belongs
      out.copy_(view_at(t, p.owner_byte.at(src) + g->view_offs, g));
    } else {
      out.copy_(view_at(scratch, p.scratch.at(src) + g->view_offs, g));
    }
  }
  if (host_memory) mps::synchronize();
}

}  // namespace ggml_kernels

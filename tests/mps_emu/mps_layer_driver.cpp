// Runs small ggml graphs through upstream's ggml-metal backend and prints the results' bytes, for
// tests/test_mps_layer_twin.py to compare the MPS device layer (common/metal/mps/, on the Linux
// twin's fake Metal framework) with the emulated device (libggml-kernels-metal-emu.so) bit for bit:
// the same upstream host code and kernels on the same inputs, only the device layer differs.
//
//   mps-layer-driver CASE        CASE: rms_norm | rms_norm_mul | private_upload (twin only)
//
// Built twice from this source: against the twin's objects (GK_DRIVER_MPS: the tensors' memory is
// wrapped as Metal buffers, no copy, as the MPS backend does with MPS tensors) and against the
// emulated runtime (the tensors are uploaded to and read back from a Metal buffer, as the
// emulated backend does). Prints the result's bytes in hex, then the device layer's dispatch log
// (metal_device_api.h) as JSON.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml-metal.h"
#include "ggml.h"
#include "metal_device_api.h"

#ifdef GK_DRIVER_MPS
#include <Metal/Metal.hpp>

#include "fake_mps.h"
#include "fake_mps_stream.h"
#endif

namespace {

// Values in [-1, 1) from a fixed linear congruential sequence: the same inputs in both builds.
std::vector<float> inputs(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  for (float& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<float>(seed >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return v;
}

// A graph's tensors, each with host memory: inputs for the leaves, zeros for the others.
struct Case {
  std::vector<ggml_tensor*> tensors;
  std::vector<std::vector<float>> data;
  size_t inputs = 0;  // the first `inputs` tensors are leaves
  ggml_tensor* result = nullptr;
};

Case build(ggml_context* ctx, const std::string& name) {
  Case c;
  const int64_t n = name == "rms_norm" ? 1000 : 4096, rows = name == "rms_norm" ? 3 : 2;
  ggml_tensor* x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, rows);
  ggml_tensor* w = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n);
  c.tensors = {x, w};
  c.data = {inputs(n * rows, 1), inputs(n, 2)};
  c.inputs = 2;
  if (name == "rms_norm") {
    c.result = ggml_rms_norm(ctx, x, 1e-6f);
  } else if (name == "rms_norm_mul") {
    ggml_tensor* norm = ggml_rms_norm(ctx, x, 1e-6f);
    c.tensors.push_back(norm);
    c.result = ggml_mul(ctx, norm, w);
  } else {
    throw std::invalid_argument("unknown case " + name);
  }
  c.tensors.push_back(c.result);
  for (size_t i = c.inputs; i < c.tensors.size(); ++i)
    c.data.emplace_back(ggml_nelements(c.tensors[i]), 0.0f);
  return c;
}

#ifdef GK_DRIVER_MPS
// Each tensor's own memory wrapped as a private Metal buffer (the twin's MPS tensors).
void run(ggml_backend_t backend, ggml_cgraph* graph, Case& c) {
  std::vector<MTL::Buffer*> wrapped;
  std::vector<ggml_backend_buffer_t> buffers;
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const size_t bytes = c.data[i].size() * sizeof(float);
    MTL::Buffer* mtl = fake_metal::wrap_host_memory(c.data[i].data(), bytes);
    ggml_backend_buffer_t buffer =
        ggml_backend_dev_buffer_from_host_ptr(ggml_backend_get_device(backend), mtl, bytes, bytes);
    if (buffer == nullptr) throw std::runtime_error("buffer_from_host_ptr failed");
    c.tensors[i]->data = nullptr;  // a second run places the tensors again
    c.tensors[i]->buffer = nullptr;
    if (ggml_backend_tensor_alloc(buffer, c.tensors[i], ggml_backend_buffer_get_base(buffer)) !=
        GGML_STATUS_SUCCESS)
      throw std::runtime_error("tensor_alloc failed");
    wrapped.push_back(mtl);
    buffers.push_back(buffer);
  }
  if (ggml_backend_graph_compute(backend, graph) != GGML_STATUS_SUCCESS)
    throw std::runtime_error(std::string("graph compute failed: ") + gk_metal_last_error());
  ggml_backend_synchronize(backend);  // the stream commits and the fake runs the dispatches
  for (ggml_backend_buffer_t b : buffers) ggml_backend_buffer_free(b);
  for (MTL::Buffer* mtl : wrapped) mtl->release();
}

// A wrapped buffer in private storage (an MPS tensor's) has no host memory: an upload is refused
// with an exception, not a crash. A buffer of the layer's own (ggml's default buffer type, shared
// storage) takes it and gives it back.
int private_upload(ggml_backend_t backend, ggml_context* ctx) {
  std::vector<float> memory(16, 0.0f);
  MTL::Buffer* mtl = fake_metal::wrap_host_memory(memory.data(), sizeof(float) * memory.size());
  ggml_backend_buffer_t wrapped = ggml_backend_dev_buffer_from_host_ptr(
      ggml_backend_get_device(backend), mtl, sizeof(float) * memory.size(),
      sizeof(float) * memory.size());
  ggml_backend_buffer_t own =
      ggml_backend_buft_alloc_buffer(ggml_backend_get_default_buffer_type(backend), 4096);
  ggml_tensor* t = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 16);
  ggml_tensor* u = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 16);
  ggml_backend_tensor_alloc(wrapped, t, ggml_backend_buffer_get_base(wrapped));
  ggml_backend_tensor_alloc(own, u, ggml_backend_buffer_get_base(own));
  const std::vector<float> values(16, 1.5f);
  std::vector<float> back(16, 0.0f);
  ggml_backend_tensor_set(u, values.data(), 0, ggml_nbytes(u));
  ggml_backend_tensor_get(u, back.data(), 0, ggml_nbytes(u));
  std::printf("%s\n", back == values ? "OWN ROUND TRIP" : "OWN ROUND TRIP DIFFERS");
  try {
    ggml_backend_tensor_set(t, values.data(), 0, ggml_nbytes(t));
    std::printf("NOT REFUSED\n");
  } catch (const std::exception& e) {
    std::printf("REFUSED: %s\n", e.what());
  }
  ggml_backend_buffer_free(own);
  ggml_backend_buffer_free(wrapped);
  mtl->release();
  return 0;
}
#else
// One device buffer: leaves uploaded, the result read back.
void run(ggml_backend_t backend, ggml_cgraph* graph, Case& c) {
  ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(backend);
  size_t total = 0;
  std::vector<size_t> offsets;
  for (ggml_tensor* t : c.tensors) {
    offsets.push_back(total);
    total += (ggml_backend_buft_get_alloc_size(buft, t) + 255) / 256 * 256;
  }
  ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(buft, total);
  char* base = static_cast<char*>(ggml_backend_buffer_get_base(buffer));
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    ggml_backend_tensor_alloc(buffer, c.tensors[i], base + offsets[i]);
    if (i < c.inputs)
      ggml_backend_tensor_set(c.tensors[i], c.data[i].data(), 0, ggml_nbytes(c.tensors[i]));
  }
  if (ggml_backend_graph_compute(backend, graph) != GGML_STATUS_SUCCESS)
    throw std::runtime_error(std::string("graph compute failed: ") + gk_metal_last_error());
  ggml_backend_tensor_get(c.result, c.data.back().data(), 0, ggml_nbytes(c.result));
  ggml_backend_buffer_free(buffer);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASE\n", argv[0]);
    return 2;
  }
  try {
    ggml_backend_t backend = ggml_backend_metal_init();
    if (backend == nullptr) throw std::runtime_error("ggml_backend_metal_init failed");
    ggml_init_params params{ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true};
    ggml_context* ctx = ggml_init(params);
#ifdef GK_DRIVER_MPS
    if (std::string(argv[1]) == "private_upload") return private_upload(backend, ctx);
#endif
    Case c = build(ctx, argv[1]);
    ggml_cgraph* graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, c.result);
#ifdef GK_DRIVER_MPS
    // a second run makes nothing the first did not (pipelines and libraries are cached; buffers,
    // encoders' arguments and autoreleased strings are gone with their call)
    run(backend, graph, c);
    const auto live = fake_metal::live_objects();
    run(backend, graph, c);
    fake_metal::check_no_leaks(live, "a second graph compute");
#else
    run(backend, graph, c);
#endif
    const auto* bytes = reinterpret_cast<const uint8_t*>(c.data.back().data());
    for (size_t i = 0; i < c.data.back().size() * sizeof(float); ++i) std::printf("%02x", bytes[i]);
    std::printf("\n");
    std::string log(gk_metal_dispatches_json(nullptr, 0) + 1, '\0');
    log.resize(gk_metal_dispatches_json(log.data(), log.size()));
    std::printf("%s\n", log.c_str());
    ggml_free(ctx);
    ggml_backend_free(backend);
  } catch (const std::exception& e) {
    std::printf("ERROR: %s\n", e.what());
    return 1;
  }
  return 0;
}

// Ops over the packages' Graph for tests/test_mps_layer_twin.py: built with the MPS backend
// (common/metal/mps/mps_backend.cpp) against the Linux twin's runtime, whose "MPS tensors" are CPU
// tensors wrapped as Metal buffers of the fake framework.
#include <torch/extension.h>

#include "ggml_torch.h"

namespace gk = ggml_kernels;

namespace {

// rms_norm(x) * w into `out`: two leaves and a result noted by the views and compute(); upstream
// fuses the two into one kernel.
void rms_norm_mul(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor out) {
  const auto& G = gk::ggml();
  gk::Graph g;
  ggml_tensor* norm = G.ggml_rms_norm(g.ctx(), g.view(x), static_cast<float>(eps));
  g.compute(G.ggml_mul(g.ctx(), norm, g.view(w)), out);
}

// silu(rms_norm(x)): the norm's result is an intermediate (no fusion with a unary op), in the
// scratch tensor.
void rms_norm_silu(const at::Tensor& x, at::Tensor out) {
  const auto& G = gk::ggml();
  gk::Graph g;
  ggml_tensor* norm = G.ggml_rms_norm(g.ctx(), g.view(x), 1e-6f);
  g.compute(G.ggml_silu(g.ctx(), norm), out);
}

std::string dispatches() {
  const auto& G = gk::ggml();
  std::string log(G.gk_metal_dispatches_json(nullptr, 0) + 1, '\0');
  log.resize(G.gk_metal_dispatches_json(log.data(), log.size()));
  return log;
}

void reset_dispatches() { gk::ggml().gk_metal_dispatches_reset(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_mul", &rms_norm_mul);
  m.def("rms_norm_silu", &rms_norm_silu);
  m.def("dispatches", &dispatches);
  m.def("reset_dispatches", &reset_dispatches);
  m.def("backend", [] { return std::string(gk::backend_name()); });
}

// What the packages' Metal backends (metal/metal_backend.cpp on the emulated device,
// metal/mps/mps_backend.cpp on torch's MPS stream) do alike with a graph before and after
// upstream's ggml-metal backend runs it: order its tensors, refuse an op upstream has no kernel
// for, restore the tensors afterwards.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ggml_torch.h"

namespace ggml_kernels::metal_graph {

// Every tensor `t` depends on, then t: a view after its source, a node after its operands.
inline void collect(ggml_tensor* t, std::vector<ggml_tensor*>& order,
                    std::unordered_set<ggml_tensor*>& seen) {
  if (t == nullptr || !seen.insert(t).second) return;
  collect(t->view_src, order, seen);
  for (ggml_tensor* src : t->src) collect(src, order, seen);
  order.push_back(t);
}

// "MUL_MAT(Q4_K, F32) -> F32"
inline std::string describe(const ggml_tensor* node) {
  const auto& G = ggml();
  std::string text = std::string(G.ggml_op_desc(node)) + "(";
  for (int i = 0; i < GGML_MAX_SRC && node->src[i] != nullptr; ++i)
    text += (i ? ", " : "") + type_name(node->src[i]->type);
  return text + ") -> " + type_name(node->type);
}

// Pre-flight: upstream's supports_op for every node, so that an op ggml-metal has no kernel for is
// a Python NotImplementedError here, never an assert in its encoder.
inline void check_supported(ggml_backend_t backend, ggml_cgraph* graph) {
  const auto& G = ggml();
  for (int i = 0; i < G.ggml_graph_n_nodes(graph); ++i) {
    const ggml_tensor* node = G.ggml_graph_node(graph, i);
    TORCH_CHECK_NOT_IMPLEMENTED(G.ggml_backend_supports_op(backend, node),
                                "ggml-metal has no kernel for ", describe(node));
  }
}

inline size_t aligned(size_t n, size_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

// The bytes a non-view tensor takes in a buffer of `buft` (some ops keep scratch data after their
// result: upstream's get_alloc_size says how much), at least one.
inline size_t room(ggml_backend_buffer_type_t buft, ggml_tensor* t) {
  const auto& G = ggml();
  const size_t bytes = std::max(G.ggml_nbytes(t), G.ggml_backend_buft_get_alloc_size(buft, t));
  return std::max<size_t>(bytes, 1);
}

// Puts every tensor back as the graph built it (host pointers, no buffer), so that a later
// compute of the same Graph starts from the torch tensors' memory again.
struct Restore {
  std::vector<std::pair<ggml_tensor*, ggml_tensor>> saved;
  ~Restore() {
    for (auto& [t, copy] : saved) *t = copy;
  }
};

}  // namespace ggml_kernels::metal_graph

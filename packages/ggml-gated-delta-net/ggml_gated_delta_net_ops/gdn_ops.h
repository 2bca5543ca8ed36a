// What every backend of ggml-gated-delta-net shares: argument checks, dtype glue for graphs, and
// the causal conv's rules and rolling state (the conv's arithmetic is the backend's).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "ggml_torch.h"

namespace gdn_ops {

constexpr int64_t kMaxConvTaps = 64;  // causal_conv1d's kernel sizes (Qwen3.5 and Mamba use 4)

// float32, bfloat16 or float16 on this backend's device.
void check_float(const at::Tensor& t, const char* name);
// t as float32 inside the graph (a ggml cast when it is bf16 / f16).
ggml_tensor* as_f32(ggml_kernels::Graph& g, ggml_tensor* t);
// A float32 result cast to `dtype`, to be computed straight into a dst of that dtype.
ggml_tensor* as_dtype(ggml_kernels::Graph& g, ggml_tensor* t, at::ScalarType dtype);
// "[2, 3, 4]"
std::string shape_str(std::initializer_list<int64_t> dims);

struct ConvDims {
  int64_t B, C, T, K, W;  // W: the rolling state's width (K without a state)
  bool silu;
};

// The rules of both causal_conv1d entry points (in_place: the new rolling state overwrites
// `state`, which must then be given, be float32 or x's dtype, and share no memory with the
// inputs); returns the dims.
ConvDims check_conv_inputs(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& state,
                           const std::optional<at::Tensor>& bias,
                           std::optional<c10::string_view> activation, bool in_place);

// The new rolling state: the last W columns of [state | x] (zeros before the first input), in the
// state's dtype (x's without a state; `state` undefined then).
at::Tensor rolling_state(const at::Tensor& x, const at::Tensor& state, const ConvDims& dims);

// Whether the delta rule's graphs repeat the key heads (r times) first; defined per backend
// (conv_cpu.cpp, conv_metal.cpp). ggml-cpu's GATED_DELTA_NET broadcasts q / k over sequences
// (sequence i reads q sequence i / r); ggml-metal's kernel reads q / k at the value sequence's own
// index (no broadcast: past q's end when q has fewer sequences), so Metal repeats them.
extern const bool kRepeatKeyHeads;

// Whether the op's own code may read and write its tensors' memory; defined per backend
// (conv_cpu.cpp: true, the CPU build's tensors are host memory; conv_metal.cpp: false, for every
// Metal build, whose tensors on a Mac are MPS tensors in private Metal buffers: their data pointers
// are no host addresses). Where it is false, every step is a torch op on the tensors or a graph
// node bound to their storages (Graph::view / Graph::raw + Graph::note), and nothing of the op's
// own (a host scratch buffer) is bound into a graph.
extern const bool kTensorsInHostMemory;

// The one door of the op's own code to tensor memory: t's floats (t float32), for memcpy and
// loops on the CPU build's fast paths. RuntimeError naming `what` on a build whose tensors the
// host cannot address (kTensorsInHostMemory false), instead of reading or corrupting device memory:
// the Metal builds' tests run every path, so a step that reaches here there fails them. Counted
// (host_tensor_accesses, torch_binding.h).
float* host_floats(const at::Tensor& t, const char* what);

}  // namespace gdn_ops

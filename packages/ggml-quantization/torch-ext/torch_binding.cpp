// Op schemas of ggml-quantization and their per-backend implementations.
#include "torch_binding.h"

#include "registration.h"

GGML_KERNELS_LIBRARY(m) {
  // Packed GGUF weight (N, row_bytes) times activations x (..., K) -> (..., N) float32. The two
  // names run the same kernel; mul_mat_vec is the one transformers calls (at most 8 rows).
  m.def("mul_mat(Tensor blocks, Tensor x, int ggml_type, int out_features) -> Tensor");
  m.def("mul_mat_vec(Tensor blocks, Tensor x, int ggml_type, int out_features) -> Tensor");
  // Several packed weights that read the same activations (q/k/v, gate/up): one (..., N_i) float32
  // product each, as mul_mat; one activation row shares one quantization and one parallel region.
  m.def(
      "mul_mat_group(Tensor[] blocks, Tensor x, int[] ggml_types, int[] out_features) -> Tensor[]");
  // Experts (E, N, row_bytes), x (T, K), ids (T, n_ids) -> (T, n_ids, N) float32.
  m.def(
      "mul_mat_id(Tensor blocks, Tensor x, Tensor ids, int ggml_type, int out_features) -> Tensor");
  m.def("dequantize(Tensor blocks, int ggml_type, int rows, int cols, ScalarType dtype) -> Tensor");
  m.def(
      "get_rows(Tensor blocks, Tensor indices, int ggml_type, int cols, ScalarType dtype) -> "
      "Tensor");
  m.def("quantize(Tensor x, int ggml_type, Tensor? imatrix=None) -> Tensor");
  // A packed weight (N, row_bytes), N a multiple of 8, in ggml-cpu's repacked layout (its type id
  // plus 1024 names it); repacked_types() lists the GGUF type ids this CPU's ggml repacks.
  m.def("repack(Tensor blocks, int ggml_type) -> Tensor");
  m.def("unrepack(Tensor blocks, int ggml_type) -> Tensor");
  m.def("repacked_types() -> int[]", &repacked_types);
}

GGML_KERNELS_LIBRARY_IMPL(GGML_KERNELS_DISPATCH_KEY, m) {
  m.impl("mul_mat", &mul_mat);
  m.impl("mul_mat_vec", &mul_mat);
  m.impl("mul_mat_group", &mul_mat_group);
  m.impl("mul_mat_id", &mul_mat_id);
  m.impl("dequantize", &dequantize);
  m.impl("get_rows", &get_rows);
  m.impl("quantize", &quantize);
  m.impl("repack", &repack);
  m.impl("unrepack", &unrepack);
}

GGML_KERNELS_PYTHON_MODULE()

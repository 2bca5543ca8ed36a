// Packed weights in ggml-cpu's repacked layout: the layout llama.cpp's CPU backend gives Q4_0,
// Q4_K, IQ4_NL, MXFP4 (and Q2_K with AVX-512) weights at load, 8 rows interleaved block by block,
// so that products with 4 or more activation rows run ggml's tiled gemm kernels (q4_K_8x8_q8_K and
// friends) instead of one dot product per (weight row, activation row).
//
// A repacked weight is named by its GGUF type id plus kRepackedFlag: the ops of this package take
// that id wherever they take a type (mul_mat, mul_mat_vec, mul_mat_group, dequantize, get_rows).
// Its bytes are only meaningful to the CPU variant that made them (the layout depends on the
// instruction set). ggml repacks; the way back (for dequantize, get_rows and the products whose
// best kernel reads the plain layout) is the inverse of ggml's repack, which for every layout is
// a fixed permutation of bits (some flipped): it is learned once per type from ggml's own repack
// and checked against it (unrepack).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "ggml_runtime.h"

namespace ggml_quantization {

// Added to a GGUF type id for a weight in the repacked layout (GGUF's ids stay below 64).
constexpr int64_t kRepackedFlag = 1024;
// Rows interleaved by every x86 layout: a repacked weight has a multiple of this many rows.
constexpr int64_t kRepackRows = 8;

// A storage type id split into the GGUF type and whether the bytes are repacked. ValueError for
// an unknown type, or a repacked one this CPU's ggml has no layout for.
struct Storage {
  ggml_type type;
  bool repacked;
};
Storage check_storage(int64_t type_id);

// Whether this CPU's ggml repacks `type` (weights with a multiple of kRepackRows rows).
bool has_repacked_layout(ggml_type type);

// blocks (rows, row_bytes), rows a multiple of kRepackRows -> a new contiguous tensor of the same
// shape holding the repacked layout (ggml's own repack, split over torch's threads).
at::Tensor repack(const at::Tensor& blocks, ggml_type type, int64_t cols);

// Repacked rows [8 * g0, 8 * g1) of `repacked` (row stride in bytes `stride`) back to the plain
// layout: into dst, (8 * (g1 - g0)) rows of row_bytes each, dense.
void unrepack_groups(ggml_type type, const uint8_t* repacked, int64_t stride, int64_t row_bytes,
                     int64_t g0, int64_t g1, uint8_t* dst);

// Marks a graph tensor over repacked memory so that ggml-cpu runs its repacked kernels on it
// (the tensor's buffer type and kernel traits, as a CPU_REPACK buffer gives them at allocation).
void mark_repacked(ggml_tensor* t);

}  // namespace ggml_quantization

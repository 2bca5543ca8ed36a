// Functions of ggml-cpu that ggml does not export, exported by our CPU runtime under gk_ names
// (cpu_runtime_api.cpp, compiled into every CPU variant by tools/build/ggml_runtime.py).
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// llamafile's sgemm on one thread: C[j * ldc + i] = A row i . B row j for i < m (weight rows),
// j < n (activation rows), over k blocks of the types' block size; lda / ldb / ldc in elements of
// each type (blocks for a quantized one), as ggml's mul_mat passes them. False where sgemm does not
// take these types or this shape (the caller then computes it otherwise); nothing is written then.
bool gk_llamafile_sgemm(int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
                        int64_t ldb, void* C, int64_t ldc, int Atype, int Btype, int Ctype);

#ifdef __cplusplus
}
#endif

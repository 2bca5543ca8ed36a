// The CPU runtime's gk_ functions (cpu_runtime_api.h) over ggml-cpu's internals.
#include "cpu_runtime_api.h"

#include "ggml-cpu-impl.h"
#include "llamafile/sgemm.h"

extern "C" __attribute__((visibility("default"))) bool gk_llamafile_sgemm(
    int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B, int64_t ldb,
    void* C, int64_t ldc, int Atype, int Btype, int Ctype) {
  // Thread 0 of 1: the whole m x n here. No threadpool: the quantized types' sgemm splits by
  // ith / nth alone; the float types' would take chunks from a threadpool, so they are declined.
  if (Atype == GGML_TYPE_F32 || Atype == GGML_TYPE_F16 || Atype == GGML_TYPE_BF16) return false;
  ggml_compute_params params = {};
  params.ith = 0;
  params.nth = 1;
  return llamafile_sgemm(&params, m, n, k, A, lda, B, ldb, C, ldc, Atype, Btype, Ctype);
}

// The ggml CPU runtime as seen by a package's extension.
//
// ggml-base + ggml-cpu are built once per x86-64 feature level (tools/build/ggml_runtime.py) into
// libggml-kernels-cpu-<variant>.so next to the extension. At first use the best variant the running
// CPU supports is loaded with dlopen(RTLD_LOCAL) and ggml's C API is reached through the function
// table below, so no ggml symbol of ours can clash with another ggml in the same process.
//
// Usage:   const auto& G = ggml_kernels::ggml();   G.ggml_mul_mat(ctx, a, b);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "cpu/cpu_runtime_api.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-metal.h"
#include "ggml.h"
#include "metal/metal_device_api.h"

namespace ggml_kernels {

// Every ggml function a package may call. The member types come from ggml's own headers
// (decltype), so a signature can never drift from the pinned ggml. Base functions are in every
// runtime; the CPU ones only in the CPU runtime, the Metal ones only in the Metal runtime (the
// other backend's members stay null).
// clang-format off
#define GGML_KERNELS_BASE_FUNCTIONS(X)                                                             \
  X(ggml_init) X(ggml_free) X(ggml_tensor_overhead) X(ggml_graph_overhead_custom)                  \
  X(ggml_new_tensor) X(ggml_new_tensor_1d) X(ggml_new_tensor_2d) X(ggml_new_tensor_3d)             \
  X(ggml_new_tensor_4d) X(ggml_view_1d) X(ggml_view_2d) X(ggml_view_3d) X(ggml_view_4d)             \
  X(ggml_reshape_2d) X(ggml_reshape_3d) X(ggml_reshape_4d) X(ggml_permute) X(ggml_cont) X(ggml_cpy) \
  X(ggml_mul_mat) X(ggml_mul_mat_id) X(ggml_get_rows) X(ggml_new_graph_custom)                      \
  X(ggml_build_forward_expand) X(ggml_graph_n_nodes) X(ggml_graph_node) X(ggml_nbytes)             \
  X(ggml_row_size) X(ggml_blck_size) X(ggml_type_size) X(ggml_type_name) X(ggml_is_quantized)      \
  X(ggml_get_type_traits) X(ggml_quantize_chunk) X(ggml_quantize_requires_imatrix)                 \
  X(ggml_quantize_init) X(ggml_validate_row_data) X(ggml_set_abort_callback) X(ggml_version)       \
  X(ggml_commit) X(ggml_rms_norm) X(ggml_norm) X(ggml_mul) X(ggml_add) X(ggml_op_desc)             \
  X(ggml_l2_norm) X(ggml_soft_max_ext) X(ggml_top_k) X(ggml_argsort) X(ggml_argsort_top_k)         \
  X(ggml_flash_attn_ext) X(ggml_flash_attn_ext_set_prec) X(ggml_ssm_conv) X(ggml_gated_delta_net)  \
  X(ggml_silu) X(ggml_cast) X(ggml_sum_rows) X(ggml_div) X(ggml_scale) X(ggml_sigmoid)              \
  X(ggml_softplus) X(ggml_exp) X(ggml_concat) X(ggml_transpose) X(ggml_sqr) X(ggml_sqrt) X(ggml_neg)  \
  X(ggml_soft_max) X(ggml_scale_bias) X(ggml_clamp) X(ggml_swiglu_split) X(ggml_cumsum)            \
  X(ggml_set_rows) X(ggml_pad) X(ggml_dup) X(ggml_cont_2d) X(ggml_cont_3d) X(ggml_cont_4d)          \
  X(ggml_view_tensor) X(ggml_arange) X(ggml_fill) X(ggml_get_first_tensor) X(ggml_get_next_tensor) \
  X(ggml_flash_attn_ext_add_sinks) X(ggml_backend_reg_dev_get)                                     \
  X(ggml_backend_reg_get_proc_address) X(ggml_backend_buft_name) X(ggml_backend_buft_alloc_buffer)  \
  X(ggml_backend_buffer_init_tensor) X(ggml_backend_tensor_set) X(ggml_log_set)                    \
  X(ggml_backend_tensor_get) X(ggml_backend_tensor_alloc) X(ggml_backend_view_init)                \
  X(ggml_backend_buffer_get_base) X(ggml_backend_buffer_get_size) X(ggml_backend_buffer_free)      \
  X(ggml_backend_buft_get_alignment) X(ggml_backend_buft_get_alloc_size)                           \
  X(ggml_backend_buft_get_max_size)                                                                \
  X(ggml_backend_get_default_buffer_type) X(ggml_backend_supports_op) X(ggml_backend_graph_compute) \
  X(ggml_backend_name) X(ggml_sub) X(ggml_is_contiguous)
#define GGML_KERNELS_CPU_FUNCTIONS(X)                                                              \
  X(ggml_cpu_init) X(ggml_get_type_traits_cpu) X(ggml_graph_plan) X(ggml_graph_compute)            \
  X(ggml_threadpool_new) X(ggml_threadpool_free) X(ggml_threadpool_params_default)                 \
  X(ggml_backend_cpu_reg) X(gk_llamafile_sgemm)
// The Metal runtime: upstream's backend over a device layer (common/metal/metal_device_api.h), and
// that layer's dispatch log.
#define GGML_KERNELS_METAL_FUNCTIONS(X)                                                            \
  X(ggml_backend_metal_init) X(gk_metal_threadgroups_json) X(gk_metal_dispatches_json)             \
  X(gk_metal_dispatches_reset) X(gk_metal_last_error)
#define GGML_KERNELS_API_FUNCTIONS(X)                                                              \
  GGML_KERNELS_BASE_FUNCTIONS(X) GGML_KERNELS_CPU_FUNCTIONS(X) GGML_KERNELS_METAL_FUNCTIONS(X)
// clang-format on

struct GgmlApi {
#define GGML_KERNELS_MEMBER(name) decltype(&::name) name = nullptr;
  GGML_KERNELS_API_FUNCTIONS(GGML_KERNELS_MEMBER)
#undef GGML_KERNELS_MEMBER
};

// The loaded runtime (loads it on first call; throws a c10::Error if it cannot be loaded).
const GgmlApi& ggml();

// The backend this extension was built for: "cpu", or "metal-emu" (upstream's Metal backend on the
// emulated device, common/metal/).
const char* backend_name();
// CPU builds: the loaded CPU variant ("zen4", "skylakex", "haswell", "x64"); Metal builds: "".
std::string cpu_variant();
// The loaded runtime library's file.
std::string runtime_path();

// ---- implemented once per backend (common/cpu/, common/metal/) ----
namespace backend {
// Loads the runtime library next to the extension into `api`; returns its path and variant.
struct Loaded {
  std::string path, variant;
};
Loaded load(GgmlApi& api);
}  // namespace backend

// Shared by the backends' loaders: the folder holding this extension, and a runtime library
// opened privately (RTLD_LOCAL) with the base functions and `backend_functions` resolved into api.
std::string this_library_dir();
bool file_exists(const std::string& path);
enum class Functions { Cpu, Metal };
// nullptr with `error` set if the library cannot be opened; throws if a function is missing.
void* open_runtime(const std::string& path, Functions backend_functions, GgmlApi& api,
                   std::string& error);

}  // namespace ggml_kernels

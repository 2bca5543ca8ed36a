// torch <-> ggml glue shared by every package: argument checks that raise clear Python exceptions,
// ggml tensor headers that view torch memory (no copies), and one-call graph execution.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "ggml_runtime.h"

namespace ggml_kernels {

// ---- argument checks (TORCH_CHECK_* map to TypeError / ValueError / IndexError in Python) ----

// The largest tensor an op reads or makes: numel * element size, strides ignored (an expand()ed,
// stride-0 tensor counts at its full size, as the op's output and any copy of it would take that
// much). Checked before any copy or allocation, so a request beyond it is a ValueError, never an
// allocator failure or a half-made copy.
inline constexpr int64_t kMaxTensorBytes = int64_t{1} << 35;  // 32 GiB
// ValueError naming `name` if a tensor of `sizes` and `dtype` would take more than kMaxTensorBytes.
void check_size(at::IntArrayRef sizes, at::ScalarType dtype, const char* name);
// t defined, on the device the build's backend takes (backend::kDevice: the CPU, or MPS in an MPS
// build), within kMaxTensorBytes (check_size): every op input goes through it.
void check_device(const at::Tensor& t, const char* name);
void check_dtype(const at::Tensor& t, std::initializer_list<at::ScalarType> allowed,
                 const char* name);
void check_dim(const at::Tensor& t, int64_t dim, const char* name);
void check_contiguous(const at::Tensor& t, const char* name);
// Storage types (GGUF tensor types) the pinned ggml can hold; anything else raises ValueError.
ggml_type check_storage_type(int64_t type_id);
// Bytes of one packed row of `cols` elements; ValueError if cols is not a multiple of the block.
int64_t packed_row_bytes(ggml_type type, int64_t cols);
// blocks: uint8, on the backend's device, contiguous, last dim == packed_row_bytes(type, cols).
void check_packed(const at::Tensor& blocks, ggml_type type, int64_t cols, const char* name);
// Every value of an integer tensor lies in [0, limit); IndexError naming the first offender if not.
void check_indices(const at::Tensor& idx, int64_t limit, const char* name);
// For ops that write into `t` in place: no two of its elements share an address (an `expand`ed,
// stride-0 tensor). RuntimeError naming it otherwise, as torch's own in-place ops refuse.
void check_no_internal_overlap(const at::Tensor& t, const char* name);
// Whether the memory spans of a and b (first to last byte, whatever the strides) meet. Cheap and
// conservative: two strided tensors that interleave without sharing an element count as meeting.
bool may_overlap(const at::Tensor& a, const at::Tensor& b);
// For ops that write `written` while reading `input`: RuntimeError naming both unless they are
// apart in memory (may_overlap is false) or the very same view, as torch's copy_ refuses a partial
// overlap.
void check_no_overlap(const at::Tensor& written, const char* written_name, const at::Tensor& input,
                      const char* input_name);
// A float argument of an op (eps, scale, softcap) reaches ggml as a float32: a finite double beyond
// float32's range would be inf there, and the whole result NaN. Each op's check of such an argument
// asks fits_float32 and ends its message with kFloat32Range (the Python twins in _ggml_runtime.py
// say the same words).
inline bool fits_float32(double value) {
  return std::isfinite(value) && std::abs(value) <= std::numeric_limits<float>::max();
}
inline constexpr const char* kFloat32Range =
    ", within float32's range (magnitude at most 3.40282e+38: ggml computes in float32)";

ggml_type ggml_type_of(at::ScalarType dtype);
// GGUF's spelling of a type name ("Q4_K"; ggml itself says "q4_K").
std::string type_name(ggml_type type);

// ---- op outputs and inputs without a trip through torch's dispatcher ----
// Each torch op an op calls inside (at::empty, Tensor::to, view) goes through the dispatcher:
// ~0.3 us warm, several times that once a weight's stream has emptied the caches, against a decode
// step's whole product of ~2 us (a 4x256 Q8_0 weight, one row: 2.73 -> 1.97 us a call without
// them, Intel Xeon, 2026-12-07).

// An uninitialised tensor of `shape` and `dtype` on like's device: on the CPU allocated directly
// (at::detail::empty_cpu), elsewhere by at::empty.
at::Tensor new_tensor_like(const at::Tensor& like, at::IntArrayRef shape, at::ScalarType dtype);
// t as contiguous float32: t itself when it already is, else a converted copy.
at::Tensor float32_contiguous(const at::Tensor& t);

// ---- one ggml graph whose leaves view torch tensors ----

// Memory a Graph's backend gave its intermediate results, held as long as the Graph.
struct GraphMemory {
  // CPU: intermediate results of up to this many bytes in all come from a per-thread scratch
  // buffer (one Graph per thread at a time), bigger ones from torch tensors kept here. 1 MiB holds
  // a decode step's intermediates (within a core's L2): with 64 KiB, the bfloat16 gated norm of
  // one token (32 x 128 values, 9 nodes, 144 KiB) took a tensor per node, 19.5 against 15.6 us a
  // call (Intel Xeon, one thread, 2026-12-07).
  static constexpr size_t kScratchBytes = size_t{1} << 20;
  // The most memory a backend keeps between calls for reuse (the Metal device buffer, a ggml-cpu
  // work buffer): a call that needs more gets it for that call only, freed when it returns.
  static constexpr size_t kKeptBytes = size_t{1} << 26;  // 64 MiB
  size_t scratch_used = 0;
  std::vector<at::Tensor> keep_alive;
  // MPS builds: the torch tensor each leaf and bound result lies in (Graph::note), whose own Metal
  // buffer the backend binds (metal/mps/mps_backend.cpp). Empty in other builds.
  std::vector<std::pair<ggml_tensor*, at::Tensor>> tensors;
};

namespace backend {
// What every backend defines, in its own translation unit (common/cpu/cpu_backend.cpp,
// common/metal/metal_backend.cpp, common/metal/mps/mps_backend.cpp): tools/build/build.py's
// BACKENDS compiles one into a build.

// Runs `graph`, whose leaves and `results` lie in torch tensors' memory (or the memory a result was
// bound to), giving the other nodes memory, and leaves every result's values there.
void run_graph(ggml_cgraph* graph, ggml_tensor* const* results, size_t count, int n_threads,
               GraphMemory& memory);
// The device of the tensors the backend's ops take and return (check_device).
extern const c10::DeviceType kDevice;
// Whether an op splits its work over torch's threads, one graph per slice (the CPU), or builds one
// graph for the whole op (Metal: upstream's host code chooses its kernels from the whole shape,
// and a device runs one command buffer at a time).
extern const bool kSlicesOverThreads;
// Whether a Graph records the torch tensor each leaf and result lies in (Graph::note): the MPS
// backend binds that tensor's own Metal buffer.
extern const bool kNotesTensors;
// Whether the ops run on an Intel CPU (the CPU backend; false for the others): the CPU paths whose
// best choice was measured to differ between an Intel Xeon and an AMD EPYC read it (software
// prefetch in ggml-quantization, the decode split of ggml-attn).
extern const bool kIntelCpu;
}  // namespace backend

class Graph {
 public:
  explicit Graph(int max_tensors = 64);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  ggml_context* ctx() const { return ctx_; }

  // A ggml tensor over a torch tensor's memory, dims reversed (ggml lists the fastest first).
  // The innermost dim must be dense; other strides are kept as they are (at most 4 dims).
  ggml_tensor* view(const at::Tensor& t);
  // t[index] (along the first dim) the same way, without the torch select (~0.4 us each).
  ggml_tensor* view(const at::Tensor& t, int64_t index);
  // A packed GGUF weight: blocks uint8 (rows, row_bytes) or (experts, rows, row_bytes) as ggml
  // tensor {cols, rows[, experts]} of `type`. blocks may be a row slice (narrow along the rows) of
  // a bigger packed matrix: its strides are kept.
  ggml_tensor* packed(const at::Tensor& blocks, ggml_type type, int64_t cols);
  // A ggml tensor over raw memory: ne / nb in ggml's order (fastest first; nb in bytes). For hot
  // paths that would otherwise build several torch views (select, narrow, permute) per slice only
  // to describe a strided block: each torch view op costs about a microsecond.
  ggml_tensor* raw(ggml_type type, const void* data, const int64_t (&ne)[4], const size_t (&nb)[4]);
  // Records that `g` (a leaf, or a result) lies in t's memory: `g->data` is t.data_ptr() plus a
  // byte offset. The views above and bind() note their tensors; a caller of raw() over a torch
  // tensor's memory notes it. Only the MPS backend keeps it (backend::kNotesTensors: an MPS
  // tensor's data pointer is no address, the backend binds t's own Metal buffer).
  void note(ggml_tensor* g, const at::Tensor& t) {
    if (backend::kNotesTensors) memory_.tensors.emplace_back(g, t);
  }

  // Computes `result` straight into `dst`, a float32 tensor of the result's shape (dims reversed)
  // whose last dim is dense; other strides may be anything, e.g. a column slice of a bigger output.
  // The build's backend runs it (backend::run_graph): on the CPU on the calling thread, or with
  // n_threads > 1 on ggml's own threadpool for ops whose best split is ggml's internal one. On the
  // CPU intermediate results live as long as this Graph (small ones in a per-thread scratch buffer:
  // one Graph per thread at a time, as for the context memory).
  void compute(ggml_tensor* result, const at::Tensor& dst, int n_threads = 1);

  // The same into dst[index] (along the first dim), without the torch select.
  void compute(ggml_tensor* result, const at::Tensor& dst, int64_t index, int n_threads = 1);
  // The same into raw memory of the result's type: nb in bytes, ggml's order.
  void compute(ggml_tensor* result, void* dst, const size_t (&nb)[4], int n_threads = 1);

  // Several results in one graph: bind each to its output (as compute does), then run them all
  // (one graph plan and one compute for all, e.g. several weights' products on one thread).
  void bind(ggml_tensor* result, const at::Tensor& dst);
  void compute_bound(const std::vector<ggml_tensor*>& results, int n_threads = 1);

 private:
  void run(ggml_tensor* result, int n_threads);
  void run(ggml_tensor* const* results, size_t count, int n_threads);

  ggml_context* ctx_ = nullptr;
  GraphMemory memory_;
  int graph_size_;
};

// A tensor seen as rows of its last dim, (numel / n, n), by pointer and row stride, so that row
// slices become ggml tensors without torch view ops (narrow, reshape: ~0.4 us each, a tenth of a
// decode step's norm). Rows are at one stride when the tensor is contiguous or reshapes to (rows,
// n) with a dense last dim; anything else is copied once (kept alive here).
class Rows {
 public:
  explicit Rows(const at::Tensor& t);
  int64_t rows() const { return rows_; }
  // Rows [r0, r1) as a ggml tensor {n, r1 - r0}.
  ggml_tensor* view(Graph& g, int64_t r0, int64_t r1) const;
  // Computes `result` ({n, r1 - r0}, this tensor's type) into rows [r0, r1).
  void compute(Graph& g, ggml_tensor* result, int64_t r0, int64_t r1) const;

 private:
  at::Tensor keep_;
  char* data_ = nullptr;
  int64_t n_ = 0, rows_ = 0;
  size_t es_ = 0, stride_ = 0;  // element and row stride in bytes
  ggml_type type_ = GGML_TYPE_F32;
};

// Splits [0, n) into chunks of at least `min_chunk` items, each a multiple of `align` (but the
// last), and runs fn(begin, end) for every chunk on torch's threads. Threads take chunks from a
// shared counter as ggml's own threadpool does, so a thread the OS wakes late (another process on
// the core) leaves its share to the others instead of stalling the op; `chunks_per_thread` > 1
// makes that finer. Small problems run inline on the calling thread. On a backend that takes whole
// ops (backend::kSlicesOverThreads false) it is one call fn(0, n).
template <typename F>
void parallel_chunks(int64_t n, int64_t min_chunk, int64_t align, int64_t chunks_per_thread,
                     const F& fn) {
  if (n <= 0) return;
  if (!backend::kSlicesOverThreads) {
    fn(0, n);
    return;
  }
  const int64_t threads = std::max(1, at::get_num_threads());
  int64_t tasks = std::clamp<int64_t>(n / std::max<int64_t>(1, min_chunk), 1,
                                      threads * std::max<int64_t>(1, chunks_per_thread));
  int64_t chunk = (n + tasks - 1) / tasks;
  chunk = (chunk + align - 1) / align * align;
  tasks = (n + chunk - 1) / chunk;
  if (tasks == 1 || threads == 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < tasks; ++t) fn(t * chunk, std::min(n, (t + 1) * chunk));
    return;
  }
  std::atomic<int64_t> next{0};
  const at::ThreadLocalState caller;  // inference mode, grad mode...: workers see the caller's
  at::parallel_for(0, std::min(threads, tasks), 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard guard(caller);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      fn(t * chunk, std::min(n, (t + 1) * chunk));
    }
  });
}

}  // namespace ggml_kernels

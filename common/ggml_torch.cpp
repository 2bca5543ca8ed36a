#include "ggml_torch.h"

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <utility>

namespace ggml_kernels {

at::Tensor new_tensor_like(const at::Tensor& like, at::IntArrayRef shape, at::ScalarType dtype) {
  if (like.is_cpu()) return at::Tensor(at::detail::empty_cpu(shape, dtype));
  return at::empty(shape, like.options().dtype(dtype));
}

at::Tensor float32_contiguous(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t;
  return t.to(at::kFloat).contiguous();
}

// ---------------------------------------------------------------------------------------------
// checks

void check_size(at::IntArrayRef sizes, at::ScalarType dtype, const char* name) {
  double bytes = static_cast<double>(c10::elementSize(dtype));  // exact up to 2^53, far above
  for (const int64_t n : sizes) bytes *= static_cast<double>(n);
  TORCH_CHECK_VALUE(bytes <= static_cast<double>(kMaxTensorBytes), name, " of shape ", sizes,
                    " and dtype ", dtype, " would take ", bytes / (1 << 30),
                    " GiB; ggml-kernels takes tensors of at most ", kMaxTensorBytes >> 30,
                    " GiB (2^35 bytes), an expanded (stride-0) dim counted in full");
}

void check_device(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " is required, got None");
  TORCH_CHECK_VALUE(t.device().type() == backend::kDevice, name, " must be a ",
                    c10::DeviceTypeName(backend::kDevice), " tensor for the ", backend_name(),
                    " build, got ", t.device());
  check_size(t.sizes(), t.scalar_type(), name);
}

void check_dtype(const at::Tensor& t, std::initializer_list<at::ScalarType> allowed,
                 const char* name) {
  for (auto dt : allowed)
    if (t.scalar_type() == dt) return;
  std::string want;
  for (auto dt : allowed) want += (want.empty() ? "" : ", ") + std::string(c10::toString(dt));
  TORCH_CHECK_TYPE(false, name, " must have dtype ", want, "; got ", t.scalar_type());
}

void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
}

void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name,
                    " must be contiguous (call .contiguous() first); got strides ", t.strides());
}

namespace {
constexpr int kStorageTypes[] = {0,  1,  2,  3,  6,  7,  8,  10, 11, 12, 13, 14, 16, 17,
                                 18, 19, 20, 21, 22, 23, 29, 30, 34, 35, 39, 40, 41, 42};
}

ggml_type check_storage_type(int64_t type_id) {
  const bool known = std::find(std::begin(kStorageTypes), std::end(kStorageTypes), type_id) !=
                     std::end(kStorageTypes);
  TORCH_CHECK_VALUE(known, "unknown or unsupported ggml type id ", type_id,
                    " (GGUF storage types are 0-3, 6-8, 10-14, 16-23, 29, 30, 34, 35, 39-42)");
  return static_cast<ggml_type>(type_id);
}

int64_t packed_row_bytes(ggml_type type, int64_t cols) {
  const auto& G = ggml();
  const int64_t block = G.ggml_blck_size(type);
  TORCH_CHECK_VALUE(cols > 0, "cols must be positive, got ", cols);
  TORCH_CHECK_VALUE(cols % block == 0, "cols=", cols, " is not a multiple of the ", type_name(type),
                    " block size ", block);
  // blocks * block bytes, checked: ggml_row_size's type_size * cols / block wraps around for cols
  // near 2^60, and a wrapped size can equal a short row's
  const int64_t n_blocks = cols / block, block_bytes = static_cast<int64_t>(G.ggml_type_size(type));
  TORCH_CHECK_VALUE(n_blocks <= INT64_MAX / block_bytes, "cols=", cols,
                    " is too large: ", type_name(type),
                    " rows of that many values take more than 2^63 - 1 bytes");
  return n_blocks * block_bytes;
}

void check_packed(const at::Tensor& blocks, ggml_type type, int64_t cols, const char* name) {
  check_device(blocks, name);
  check_dtype(blocks, {at::kByte}, name);
  TORCH_CHECK_VALUE(blocks.dim() >= 2, name,
                    " must be (rows, row_bytes) packed GGUF data, got shape ", blocks.sizes());
  const int64_t rb = packed_row_bytes(type, cols);
  TORCH_CHECK_VALUE(blocks.size(-1) == rb, name, " has ", blocks.size(-1), " bytes per row but ",
                    type_name(type), " rows of ", cols, " values take ", rb, " bytes");
  check_contiguous(blocks, name);
}

void check_indices(const at::Tensor& idx, int64_t limit, const char* name) {
  if (idx.numel() == 0) return;
  auto [lo, hi] = at::aminmax(idx);
  const int64_t mn = lo.item<int64_t>(), mx = hi.item<int64_t>();
  TORCH_CHECK_INDEX(mn >= 0 && mx < limit, name, " out of range: values must lie in [0, ", limit,
                    "), got min ", mn, ", max ", mx);
}

void check_no_internal_overlap(const at::Tensor& t, const char* name) {
  TORCH_CHECK(
      at::has_internal_overlap(t) != at::MemOverlap::Yes, "unsupported operation: ", name,
      " is written in place but several of its elements share one memory location (strides ",
      t.strides(), ", e.g. an expand()); clone() it first");
}

namespace {
// [first byte, one past the last byte) of t's elements; empty for an empty tensor.
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (t.numel() == 0) return {begin, begin};
  int64_t low = 0, high = 0;  // element offsets of the extreme elements
  for (int64_t i = 0; i < t.dim(); ++i) {
    const int64_t reach = (t.size(i) - 1) * t.stride(i);
    (reach < 0 ? low : high) += reach;
  }
  const auto es = static_cast<int64_t>(t.element_size());
  return {begin + low * es, begin + (high + 1) * es};
}
}  // namespace

bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  const auto [a0, a1] = byte_span(a);
  const auto [b0, b1] = byte_span(b);
  return a0 < b1 && b0 < a1;
}

void check_no_overlap(const at::Tensor& written, const char* written_name, const at::Tensor& input,
                      const char* input_name) {
  const bool same_view = written.data_ptr() == input.data_ptr() &&
                         written.sizes() == input.sizes() && written.strides() == input.strides() &&
                         written.dtype() == input.dtype();
  TORCH_CHECK(same_view || !may_overlap(written, input), "unsupported operation: ", input_name,
              " shares memory with ", written_name,
              ", which the op writes while reading it; clone() ", input_name, " first");
}

std::string type_name(ggml_type type) {
  std::string name = ggml().ggml_type_name(type);
  for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

ggml_type ggml_type_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return GGML_TYPE_F32;
    case at::kHalf: return GGML_TYPE_F16;
    case at::kBFloat16: return GGML_TYPE_BF16;
    case at::kInt: return GGML_TYPE_I32;
    case at::kLong: return GGML_TYPE_I64;
    case at::kChar: return GGML_TYPE_I8;
    case at::kShort: return GGML_TYPE_I16;
    case at::kDouble: return GGML_TYPE_F64;
    default: TORCH_CHECK_TYPE(false, "ggml has no type for torch dtype ", dtype);
  }
}

// ---------------------------------------------------------------------------------------------
// Graph

namespace {
thread_local std::vector<uint8_t> t_ctx_buffer;
}  // namespace

Graph::Graph(int max_tensors) : graph_size_(std::max(16, max_tensors)) {
  const auto& G = ggml();
  const size_t size = G.ggml_tensor_overhead() * static_cast<size_t>(max_tensors) +
                      G.ggml_graph_overhead_custom(graph_size_, false) + 1024;
  if (t_ctx_buffer.size() < size) t_ctx_buffer.resize(size);
  ggml_init_params params{};
  params.mem_size = size;
  params.mem_buffer = t_ctx_buffer.data();
  params.no_alloc = true;
  ctx_ = G.ggml_init(params);
  TORCH_CHECK(ctx_ != nullptr, "ggml-kernels: ggml_init failed");
}

Graph::~Graph() {
  if (ctx_) ggml().ggml_free(ctx_);
}

namespace {

// ne / nb (ggml's order, bytes) of dims [first, t.dim()) of t: at most 4, the innermost dense.
void ggml_layout(const at::Tensor& t, int first, int64_t (&ne)[4], size_t (&nb)[4]) {
  const int nd = static_cast<int>(t.dim()) - first;
  TORCH_CHECK_VALUE(nd >= 1 && nd <= 4, "ggml tensors have 1 to 4 dims, got shape ", t.sizes(),
                    first ? " (after its first dim)" : "");
  TORCH_CHECK_VALUE(t.stride(-1) == 1 || t.size(-1) == 1,
                    "the last dim must be dense, got strides ", t.strides());
  const size_t es = static_cast<size_t>(t.element_size());
  for (int i = 0; i < 4; ++i) ne[i] = i < nd ? t.size(t.dim() - 1 - i) : 1;
  nb[0] = es;
  for (int i = 1; i < 4; ++i) {
    nb[i] = i < nd ? static_cast<size_t>(t.stride(t.dim() - 1 - i)) * es
                   : nb[i - 1] * static_cast<size_t>(ne[i - 1]);
  }
}

}  // namespace

ggml_tensor* Graph::view(const at::Tensor& t) {
  int64_t ne[4];
  size_t nb[4];
  ggml_layout(t, 0, ne, nb);
  ggml_tensor* g = raw(ggml_type_of(t.scalar_type()), t.data_ptr(), ne, nb);
  note(g, t);
  return g;
}

ggml_tensor* Graph::view(const at::Tensor& t, int64_t index) {
  TORCH_CHECK(t.dim() >= 2 && index >= 0 && index < t.size(0), "ggml-kernels: entry ", index,
              " of shape ", t.sizes());
  int64_t ne[4];
  size_t nb[4];
  ggml_layout(t, 1, ne, nb);
  ggml_tensor* g = raw(ggml_type_of(t.scalar_type()),
                       static_cast<const char*>(t.data_ptr()) +
                           index * t.stride(0) * static_cast<int64_t>(t.element_size()),
                       ne, nb);
  note(g, t);
  return g;
}

ggml_tensor* Graph::packed(const at::Tensor& blocks, ggml_type type, int64_t cols) {
  TORCH_CHECK_VALUE(blocks.dim() == 2 || blocks.dim() == 3, "packed weights are 2-D or 3-D, got ",
                    blocks.sizes());
  TORCH_CHECK(blocks.stride(-1) == 1, "ggml-kernels: packed rows must be dense");
  const int64_t rows = blocks.size(-2);
  const int64_t experts = blocks.dim() == 3 ? blocks.size(0) : 1;
  ggml_tensor* g = ggml().ggml_new_tensor_3d(ctx_, type, cols, rows, experts);
  TORCH_CHECK(static_cast<int64_t>(g->nb[1]) == blocks.size(-1), "ggml-kernels: row size mismatch");
  g->nb[1] =
      static_cast<size_t>(blocks.stride(-2));  // a row slice of a bigger matrix keeps its strides
  g->nb[2] = blocks.dim() == 3 ? static_cast<size_t>(blocks.stride(0)) : g->nb[1] * rows;
  g->nb[3] = g->nb[2] * experts;
  g->data = blocks.data_ptr();
  note(g, blocks);
  return g;
}

ggml_tensor* Graph::raw(ggml_type type, const void* data, const int64_t (&ne)[4],
                        const size_t (&nb)[4]) {
  int64_t dims[4] = {ne[0], ne[1], ne[2], ne[3]};
  ggml_tensor* g = ggml().ggml_new_tensor(ctx_, type, 4, dims);
  for (int i = 0; i < 4; ++i) g->nb[i] = nb[i];
  g->data = const_cast<void*>(data);
  return g;
}

void Graph::bind(ggml_tensor* result, const at::Tensor& dst) {
  const int nd = static_cast<int>(dst.dim());
  bool same = nd >= 1 && nd <= 4 && ggml_type_of(dst.scalar_type()) == result->type &&
              (dst.stride(-1) == 1 || dst.size(-1) == 1);
  for (int i = 0; same && i < 4; ++i) same = result->ne[i] == (i < nd ? dst.size(nd - 1 - i) : 1);
  TORCH_CHECK(same, "ggml-kernels: output buffer ", dst.sizes(),
              " does not match the graph result");
  const int64_t es = static_cast<int64_t>(dst.element_size());
  for (int i = 1; i < nd; ++i) result->nb[i] = static_cast<size_t>(dst.stride(nd - 1 - i) * es);
  for (int i = std::max(nd, 1); i < 4; ++i) result->nb[i] = result->nb[i - 1] * result->ne[i - 1];
  result->data = dst.data_ptr();
  note(result, dst);
}

void Graph::compute(ggml_tensor* result, const at::Tensor& dst, int n_threads) {
  bind(result, dst);
  if (dst.numel() == 0) return;
  run(result, n_threads);
}

void Graph::compute_bound(const std::vector<ggml_tensor*>& results, int n_threads) {
  if (!results.empty()) run(results.data(), results.size(), n_threads);
}

void Graph::compute(ggml_tensor* result, const at::Tensor& dst, int64_t index, int n_threads) {
  TORCH_CHECK(dst.dim() >= 2 && index >= 0 && index < dst.size(0) &&
                  ggml_type_of(dst.scalar_type()) == result->type,
              "ggml-kernels: output entry ", index, " of ", dst.sizes(),
              " does not match the graph result");
  int64_t ne[4];
  size_t nb[4];
  ggml_layout(dst, 1, ne, nb);
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(result->ne[i] == ne[i], "ggml-kernels: output entry of ", dst.sizes(),
                " does not match the graph result");
  }
  if (dst.numel() == 0) return;
  note(result, dst);
  compute(result,
          static_cast<char*>(dst.data_ptr()) +
              index * dst.stride(0) * static_cast<int64_t>(dst.element_size()),
          nb, n_threads);
}

void Graph::compute(ggml_tensor* result, void* dst, const size_t (&nb)[4], int n_threads) {
  for (int i = 0; i < 4; ++i) result->nb[i] = nb[i];
  result->data = dst;
  run(result, n_threads);
}

void Graph::run(ggml_tensor* result, int n_threads) { run(&result, 1, n_threads); }

void Graph::run(ggml_tensor* const* results, size_t count, int n_threads) {
  const auto& G = ggml();
  // Building a graph names every unnamed tensor with snprintf ("leaf_%d", "node_%d"), ~0.2 us each:
  // a quarter of a decode step's norm. Nothing here reads the names; a one-letter one skips that.
  for (ggml_tensor* t = G.ggml_get_first_tensor(ctx_); t != nullptr;
       t = G.ggml_get_next_tensor(ctx_, t)) {
    if (t->name[0] == '\0') {
      t->name[0] = 't';
      t->name[1] = '\0';
    }
  }
  ggml_cgraph* graph = G.ggml_new_graph_custom(ctx_, graph_size_, false);
  for (size_t i = 0; i < count; ++i) G.ggml_build_forward_expand(graph, results[i]);
  backend::run_graph(graph, results, count, n_threads, memory_);
}

// ---------------------------------------------------------------------------------------------
// Rows

Rows::Rows(const at::Tensor& t) : n_(t.dim() == 0 ? 1 : t.size(-1)) {
  rows_ = n_ == 0 ? 0 : t.numel() / n_;
  if (t.is_contiguous()) {
    keep_ = t;
  } else {
    at::Tensor t2 = t.reshape({rows_, n_});
    keep_ = t2.stride(1) == 1 || n_ == 1 ? t2 : t2.contiguous();
  }
  type_ = ggml_type_of(keep_.scalar_type());
  es_ = static_cast<size_t>(keep_.element_size());
  stride_ = (keep_.is_contiguous() || keep_.dim() < 2 ? static_cast<size_t>(n_)
                                                      : static_cast<size_t>(keep_.stride(0))) *
            es_;
  data_ = static_cast<char*>(keep_.data_ptr());
}

ggml_tensor* Rows::view(Graph& g, int64_t r0, int64_t r1) const {
  const int64_t m = r1 - r0;
  ggml_tensor* v =
      g.raw(type_, data_ + static_cast<size_t>(r0) * stride_, {n_, m, 1, 1},
            {es_, stride_, stride_ * static_cast<size_t>(m), stride_ * static_cast<size_t>(m)});
  g.note(v, keep_);
  return v;
}

void Rows::compute(Graph& g, ggml_tensor* result, int64_t r0, int64_t r1) const {
  const int64_t m = r1 - r0;
  TORCH_CHECK(result->type == type_ && result->ne[0] == n_ && result->ne[1] == m &&
                  result->ne[2] == 1 && result->ne[3] == 1,
              "ggml-kernels: a graph result does not match its ", m, " output rows of ", n_);
  if (m == 0 || n_ == 0) return;
  g.note(result, keep_);
  g.compute(result, data_ + static_cast<size_t>(r0) * stride_,
            {es_, stride_, stride_ * static_cast<size_t>(m), stride_ * static_cast<size_t>(m)});
}

}  // namespace ggml_kernels

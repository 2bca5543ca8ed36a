// ggml-norm's ops, for every backend: each op is a small ggml graph over views of the torch
// tensors, which the build's backend runs (common/cpu/: ggml-cpu's own code; common/metal/:
// upstream's Metal backend).
//
// x (..., n) is seen as rows of n values. On the CPU the rows are split over torch's threads
// (parallel_chunks), one single-threaded graph per row slice writing its rows of the output, as
// ggml's own threadpool would split them; a slice is at least kMinChunkBytes of float32 rows, so a
// decode step (a few rows) runs on the calling thread. On Metal an op is one graph.
//
// ggml-cpu's RMS_NORM and L2_NORM read float32 only: bf16/f16 inputs are converted inside the
// graph (a GGML_OP_CPY node per slice) and the result is converted back by the graph's last node,
// written straight into the output. The norm's sum of squares is accumulated in double by ggml, the
// rest is float32. RMS_NORM directly followed by MUL (the weight) is one fused pass in ggml-cpu
// (ggml_cpu_try_fuse_ops; ggml-metal fuses it too), as long as the weight is a float32 leaf:
// weights are therefore made float32 once per call, before the graphs (f32_vector).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "ggml_torch.h"
#include "torch_binding.h"

using namespace ggml_kernels;

namespace {

// Rows a slice takes at least, in float32 bytes: below this one thread does the whole op, since
// waking another costs more than the pass itself.
constexpr int64_t kMinChunkBytes = int64_t{1} << 16;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 18;

int64_t min_rows_per_task(int64_t n) { return std::max<int64_t>(1, kMinChunkBytes / (4 * n)); }

void check_float(const at::Tensor& t, const char* name) {
  check_device(t, name);
  check_dtype(t, {at::kFloat, at::kBFloat16, at::kHalf}, name);
}

void check_input(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dim (..., n), got a 0-D tensor");
}

void check_eps(double eps) {
  TORCH_CHECK_VALUE(fits_float32(eps) && eps >= 0.0, "eps must be a finite number >= 0",
                    kFloat32Range, ", got ", eps);
}

// A per-feature parameter (weight, bias): 1-D with x's last dim.
void check_vector(const at::Tensor& w, int64_t n, const char* name) {
  check_float(w, name);
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == n, name, " must be 1-D with ", n,
                    " values (x's last dim), got shape ", w.sizes());
}

// w[i] (+ 1 if kPlusOne) for n values, as float32: the same values as torch's `w.float()` (+ 1).
// In blocks of 16 the compiler turns into vector operations (a plain loop over n stayed scalar at
// -O2: 2 us of a 7.3 us zero-centred norm of 4096 values).
template <bool kPlusOne, typename T>
void to_f32(const T* __restrict__ w, float* __restrict__ out, int64_t n) {
  constexpr int64_t kBlock = 16;
  const auto value = [](T v) {
    return kPlusOne ? static_cast<float>(v) + 1.0f : static_cast<float>(v);
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (int64_t j = 0; j < kBlock; ++j) out[i + j] = value(w[i + j]);
  for (; i < n; ++i) out[i] = value(w[i]);
}

// A per-feature parameter (weight, bias) as the float32 vector ggml's binary ops broadcast over the
// rows, 1 + w if plus_one: the tensor itself when it already is one, else a tensor of torch's (on
// w's device: an MPS build binds only torch storages, never host memory of ours). On the CPU this
// is a loop into a new tensor: at::add's setup alone (~3 us) cost more than a decode step's norm,
// and `to` ~0.7 us of a bfloat16 gated norm's 15.
at::Tensor f32_vector(const at::Tensor& w, bool plus_one) {
  if (!plus_one && w.scalar_type() == at::kFloat) return w.contiguous();
  if (!w.is_cpu()) return plus_one ? (w.to(at::kFloat) + 1).contiguous() : float32_contiguous(w);
  const at::Tensor src = w.contiguous();
  at::Tensor out = new_tensor_like(src, {src.numel()}, at::kFloat);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, src.scalar_type(), "ggml_norm_to_f32", [&] {
        const scalar_t* in = src.const_data_ptr<scalar_t>();
        float* o = out.data_ptr<float>();
        plus_one ? to_f32<true>(in, o, src.numel()) : to_f32<false>(in, o, src.numel());
      });
  return out;
}

ggml_tensor* cast_to(Graph& g, ggml_tensor* t, ggml_type type) {
  return t->type == type ? t : ggml().ggml_cast(g.ctx(), t, type);
}

// t (float32) rounded to `type` and back: what torch's `t.to(dtype)` does to the values.
ggml_tensor* round_to(Graph& g, ggml_tensor* t, ggml_type type) {
  return type == GGML_TYPE_F32 ? t : cast_to(g, cast_to(g, t, type), GGML_TYPE_F32);
}

// F.normalize's NaN for clamp mode: a row holding NaN has a NaN norm, so all of its outputs are
// NaN. ggml's l2_norm clamps the norm with fmaxf, which drops the NaN (the norm becomes eps), and
// scales the row's other values by 1 / eps. A NaN input always gives a NaN output at its place, so
// only rows whose output holds NaN are looked at again (a row holding inf but no NaN gives NaN at
// the inf, 0 elsewhere, as F.normalize does, and is left alone).
template <typename T>
bool has_nan(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (p[i] != p[i]) return true;
  return false;
}

void nan_rows_like_normalize(const at::Tensor& x, at::Tensor& out, int64_t r0, int64_t r1) {
  const int64_t n = out.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, out.scalar_type(), "ggml_l2_norm_nan", [&] {
        scalar_t* o = out.data_ptr<scalar_t>();  // contiguous: made by the op
        for (int64_t r = r0; r < r1; ++r) {
          scalar_t* row = o + r * n;
          if (!has_nan(row, n)) continue;
          if (x.reshape({-1, n}).select(0, r).isnan().any().item<bool>()) {  // rare: a copy is fine
            std::fill(row, row + n, std::numeric_limits<scalar_t>::quiet_NaN());
          }
        }
      });
}

// fn(row0, row1) over slices of `rows` rows of n values: at least kMinChunkBytes each, and for
// big inputs at most about kMaxChunkBytes, so that a slice's float32 intermediates (the converted
// input, the weighted norm) stay in cache between the graph's passes and come from malloc's free
// lists instead of fresh pages.
template <typename F>
void for_row_slices(int64_t rows, int64_t n, const F& fn) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t per_thread = std::max<int64_t>(1, rows * n * 4 / (threads * kMaxChunkBytes));
  parallel_chunks(rows, min_rows_per_task(n), 1, per_thread, fn);
}

}  // namespace

at::Tensor norm_ops::rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps, bool zero_centered,
                              bool cast_before_weight) {
  check_input(x);
  check_eps(eps);
  const int64_t n = x.size(-1);
  const bool has_w = weight.has_value() && weight->defined();
  const bool has_b = bias.has_value() && bias->defined();
  if (has_w) check_vector(*weight, n, "weight");
  if (has_b) check_vector(*bias, n, "bias");
  TORCH_CHECK_VALUE(has_w || !zero_centered,
                    "zero_centered needs a weight: it computes norm(x) * (1 + weight)");
  if (cast_before_weight) {
    TORCH_CHECK_VALUE(
        has_w, "cast_before_weight needs a weight: it computes weight * norm(x).to(x.dtype)");
    TORCH_CHECK_VALUE(
        !zero_centered && !has_b,
        "cast_before_weight (Llama's rounding: weight * norm(x).to(x.dtype)) takes no "
        "bias and cannot be zero_centered");
  }
  const at::ScalarType out_dtype = cast_before_weight
                                       ? c10::promoteTypes(x.scalar_type(), weight->scalar_type())
                                       : x.scalar_type();
  check_size(x.sizes(), out_dtype, "the output");  // (a promoted dtype may double x's size)
  at::Tensor out = new_tensor_like(x, x.sizes(), out_dtype);
  if (x.numel() == 0) return out;

  const Rows x_rows(x), out_rows(out);
  const at::Tensor w = has_w ? f32_vector(*weight, zero_centered) : at::Tensor();
  const at::Tensor b = has_b ? f32_vector(*bias, false) : at::Tensor();
  const ggml_type x_type = ggml_type_of(x.scalar_type());
  const ggml_type out_type = ggml_type_of(out_dtype);
  const float feps = static_cast<float>(eps);
  for_row_slices(x_rows.rows(), n, [&](int64_t r0, int64_t r1) {
    const auto& G = ggml();
    Graph g(16);
    ggml_tensor* y =
        G.ggml_rms_norm(g.ctx(), cast_to(g, x_rows.view(g, r0, r1), GGML_TYPE_F32), feps);
    if (cast_before_weight) y = round_to(g, y, x_type);
    if (has_w) y = G.ggml_mul(g.ctx(), y, g.view(w));  // fused with the norm when it follows it
    if (has_b) y = G.ggml_add(g.ctx(), y, g.view(b));
    out_rows.compute(g, cast_to(g, y, out_type), r0, r1);
  });
  return out;
}

at::Tensor norm_ops::rms_norm_gated(const at::Tensor& x, const at::Tensor& z,
                                    const at::Tensor& weight, double eps, bool cast_before_weight) {
  check_input(x);
  check_eps(eps);
  const int64_t n = x.size(-1);
  check_float(z, "z");
  TORCH_CHECK_VALUE(z.sizes() == x.sizes(), "z (the gate) must have x's shape ", x.sizes(),
                    ", got ", z.sizes());
  check_vector(weight, n, "weight");
  at::Tensor out = new_tensor_like(x, x.sizes(), x.scalar_type());
  if (x.numel() == 0) return out;

  const Rows x_rows(x), z_rows(z), out_rows(out);
  const at::Tensor w = f32_vector(weight, false);
  const ggml_type x_type = ggml_type_of(x.scalar_type());
  const ggml_type prod_type =
      ggml_type_of(c10::promoteTypes(x.scalar_type(), weight.scalar_type()));
  const float feps = static_cast<float>(eps);
  for_row_slices(x_rows.rows(), n, [&](int64_t r0, int64_t r1) {
    const auto& G = ggml();
    Graph g(16);
    ggml_tensor* y =
        G.ggml_rms_norm(g.ctx(), cast_to(g, x_rows.view(g, r0, r1), GGML_TYPE_F32), feps);
    if (cast_before_weight) y = round_to(g, y, x_type);
    y = G.ggml_mul(g.ctx(), y, g.view(w));
    if (cast_before_weight) y = round_to(g, y, prod_type);
    ggml_tensor* gate = cast_to(g, z_rows.view(g, r0, r1), GGML_TYPE_F32);
    y = G.ggml_swiglu_split(g.ctx(), gate, y);  // silu(gate) * y in float32
    out_rows.compute(g, cast_to(g, y, x_type), r0, r1);
  });
  return out;
}

at::Tensor norm_ops::l2_norm(const at::Tensor& x, double eps, c10::string_view mode) {
  check_input(x);
  check_eps(eps);
  const bool clamp = mode == "clamp";
  TORCH_CHECK_VALUE(clamp || mode == "rsqrt",
                    "mode must be \"clamp\" (x / max(||x||, eps), ggml's "
                    "l2_norm) or \"rsqrt\" (x / sqrt(||x||^2 + eps), transformers' l2norm), got \"",
                    std::string(mode), "\"");
  const int64_t n = x.size(-1);
  at::Tensor out = new_tensor_like(x, x.sizes(), x.scalar_type());
  if (x.numel() == 0) return out;

  const Rows x_rows(x), out_rows(out);
  const ggml_type x_type = ggml_type_of(x.scalar_type());
  const float feps = static_cast<float>(eps);
  for_row_slices(x_rows.rows(), n, [&](int64_t r0, int64_t r1) {
    const auto& G = ggml();
    Graph g(16);
    ggml_tensor* xf = cast_to(g, x_rows.view(g, r0, r1), GGML_TYPE_F32);
    ggml_tensor* y;
    if (clamp) {
      y = G.ggml_l2_norm(g.ctx(), xf, feps);
    } else {
      // x / sqrt(S + eps) = rms_norm(x, eps / n) / sqrt(n), with S the row's sum of squares: ggml's
      // RMS_NORM pass and a scale instead of four ops (sqr, sum_rows, sqrt, div).
      y = G.ggml_rms_norm(g.ctx(), xf, static_cast<float>(eps / static_cast<double>(n)));
      y = G.ggml_scale(g.ctx(), y, static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));
    }
    out_rows.compute(g, cast_to(g, y, x_type), r0, r1);
    if (clamp) nan_rows_like_normalize(x, out, r0, r1);
  });
  return out;
}

// ggml-cpu's repacked weight layout: reached through the CPU backend's CPU_REPACK buffer type, as
// llama.cpp reaches it, and undone by the inverse of ggml's own repack (see repack_cpu.h).
#include "repack_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "ggml_torch.h"

using namespace ggml_kernels;

namespace ggml_quantization {
namespace {

// A one-tensor CPU_REPACK buffer: its buffer type is what makes ggml-cpu look up a weight's
// repacked kernels (tensor->extra, set by the buffer's init_tensor). Weights stay in torch memory;
// only their ggml headers point at this buffer. Null if the runtime has no CPU_REPACK type.
ggml_backend_buffer_t repack_buffer() {
  static ggml_backend_buffer_t buffer = []() -> ggml_backend_buffer_t {
    const auto& G = ggml();
    ggml_backend_reg_t reg = G.ggml_backend_cpu_reg();
    auto extra_types = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
        G.ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
    if (extra_types == nullptr) return nullptr;
    for (auto* t = extra_types(G.ggml_backend_reg_dev_get(reg, 0)); t && *t; ++t) {
      if (std::strcmp(G.ggml_backend_buft_name(*t), "CPU_REPACK") == 0)
        return G.ggml_backend_buft_alloc_buffer(*t, 64);
    }
    return nullptr;
  }();
  return buffer;
}

// Whether ggml-cpu has kernels for `t` (its type and row count) in the repacked layout; if so the
// header now carries them.
bool attach_repacked_kernels(ggml_tensor* t) {
  ggml_backend_buffer_t buffer = repack_buffer();
  if (buffer == nullptr) return false;
  t->buffer = buffer;
  ggml().ggml_backend_buffer_init_tensor(buffer, t);
  return t->extra != nullptr;
}

// ggml's repack of `rows` plain rows at src into dst (both dense, rows a multiple of 8).
void ggml_repack(ggml_type type, int64_t cols, int64_t rows, const uint8_t* src, uint8_t* dst) {
  const auto& G = ggml();
  Graph g(2);
  const int64_t ne[4] = {cols, rows, 1, 1};
  const size_t rb = G.ggml_row_size(type, cols);
  const size_t nb[4] = {G.ggml_type_size(type), rb, rb * rows, rb * rows};
  ggml_tensor* t = g.raw(type, dst, ne, nb);
  TORCH_CHECK(attach_repacked_kernels(t), "ggml-kernels: no repacked layout for ", type_name(type));
  G.ggml_backend_tensor_set(t, src, 0, rb * rows);
}

// The inverse of ggml's repack of one unit (8 rows x one block), as moves of whole bytes and of
// masked bit fields. Plain byte `row * type_size + offset` of the unit is rebuilt from repacked
// bytes; `flip` is ggml's repack of an all-zero unit (the bits every repack sets).
struct Inverse {
  struct ByteRun {  // len plain bytes from len repacked bytes, bits in place (some flipped)
    uint16_t row, offset, src, len;
    bool flipped;
  };
  // plain |= ((repacked[src] ^ flip[src]) & mask), shifted left by `shift` (right when negative)
  struct Field {
    uint16_t row, offset, src;
    uint8_t mask;
    int8_t shift;
  };
  bool valid = false;
  int64_t unit = 0, block_bytes = 0;
  std::vector<uint8_t> flip;
  std::vector<ByteRun> runs;
  std::vector<Field> fields;
  std::vector<std::pair<uint16_t, uint16_t>> cleared;  // (row, offset) of bytes built from fields

  void apply(const uint8_t* unit_src, int64_t row_bytes, uint8_t* dst) const {
    for (const auto& [row, offset] : cleared) dst[row * row_bytes + offset] = 0;
    for (const auto& r : runs) {
      uint8_t* d = dst + r.row * row_bytes + r.offset;
      for (int i = 0; i < r.len; ++i) d[i] = unit_src[r.src + i] ^ flip[r.src + i];
    }
    for (const auto& f : fields) {
      const uint8_t v = (unit_src[f.src] ^ flip[f.src]) & f.mask;
      dst[f.row * row_bytes + f.offset] |= f.shift >= 0 ? v << f.shift : v >> -f.shift;
    }
  }
};

// Where each plain bit of a unit goes in ggml's repack: repacks one unit per plain bit (that bit
// alone set) and an all-zero unit; empty if some bit does not land on exactly one bit.
std::vector<int64_t> learn_bit_targets(ggml_type type, std::vector<uint8_t>& flip) {
  const auto& G = ggml();
  const int64_t ts = static_cast<int64_t>(G.ggml_type_size(type)), unit = 8 * ts;
  const int64_t bits = unit * 8, cols = G.ggml_blck_size(type);
  std::vector<uint8_t> plain((bits + 1) * unit, 0), packed(plain.size());
  for (int64_t i = 0; i < bits; ++i) plain[(i + 1) * unit + i / 8] = uint8_t(1u << (i % 8));
  ggml_repack(type, cols, 8 * (bits + 1), plain.data(), packed.data());
  flip.assign(packed.begin(), packed.begin() + unit);
  std::vector<int64_t> target(bits, -1);
  std::vector<bool> hit(bits, false);
  for (int64_t i = 0; i < bits; ++i) {
    const uint8_t* out = packed.data() + (i + 1) * unit;
    for (int64_t b = 0; b < unit; ++b) {
      const uint8_t d = out[b] ^ flip[b];
      for (int k = 0; d && k < 8; ++k) {
        if (!(d >> k & 1)) continue;
        if (target[i] >= 0 || hit[b * 8 + k]) return {};  // two targets, or a shared one
        target[i] = b * 8 + k;
        hit[b * 8 + k] = true;
      }
    }
    if (target[i] < 0) return {};  // the bit is dropped
  }
  return target;
}

// The moves of `Inverse` from the learned bit targets: bytes whose 8 bits come in place from one
// repacked byte become byte runs, the rest one field per (plain byte, repacked byte, shift).
Inverse compile_inverse(ggml_type type, const std::vector<int64_t>& target,
                        std::vector<uint8_t> flip) {
  Inverse inv;
  inv.block_bytes = static_cast<int64_t>(ggml().ggml_type_size(type));
  inv.unit = 8 * inv.block_bytes;
  inv.flip = std::move(flip);
  for (int64_t j = 0; j < inv.unit; ++j) {
    const auto row = uint16_t(j / inv.block_bytes), offset = uint16_t(j % inv.block_bytes);
    const int64_t src = target[j * 8] / 8;
    bool in_place = target[j * 8] % 8 == 0;
    for (int k = 1; in_place && k < 8; ++k) in_place = target[j * 8 + k] == src * 8 + k;
    if (in_place) {
      auto& runs = inv.runs;
      if (!runs.empty() && runs.back().row == row &&
          runs.back().offset + runs.back().len == offset &&
          runs.back().src + runs.back().len == src && runs.back().len < 8) {
        ++runs.back().len;
      } else {
        runs.push_back({row, offset, uint16_t(src), 1, false});
      }
      runs.back().flipped = runs.back().flipped || inv.flip[src] != 0;
      continue;
    }
    inv.cleared.emplace_back(row, offset);
    for (int k = 0; k < 8; ++k) {
      const int64_t t = target[j * 8 + k];
      const auto shift = int8_t(k - t % 8);
      auto& fields = inv.fields;
      auto it = std::find_if(fields.begin(), fields.end(), [&](const Inverse::Field& f) {
        return f.row == row && f.offset == offset && f.src == t / 8 && f.shift == shift;
      });
      if (it == fields.end())
        it = fields.insert(fields.end(), {row, offset, uint16_t(t / 8), 0, shift});
      it->mask |= uint8_t(1u << (t % 8));
    }
  }
  return inv;
}

// True if inv undoes ggml's repack of a few random rows exactly.
bool undoes_ggml_repack(ggml_type type, const Inverse& inv) {
  const auto& G = ggml();
  const int64_t blocks = 3, cols = blocks * G.ggml_blck_size(type), rows = 16;
  const int64_t rb = inv.block_bytes * blocks;
  std::vector<uint8_t> plain(rows * rb), packed(rows * rb), back(rows * rb);
  std::mt19937 bits(12345);  // not torch's generator: learning must not move the caller's seed
  for (auto& b : plain) b = static_cast<uint8_t>(bits());
  ggml_repack(type, cols, rows, plain.data(), packed.data());
  for (int64_t g = 0; g < rows / 8; ++g) {
    for (int64_t x = 0; x < blocks; ++x) {
      inv.apply(packed.data() + (g * blocks + x) * inv.unit, rb,
                back.data() + g * 8 * rb + x * inv.block_bytes);
    }
  }
  return back == plain;
}

// The inverse for `type`, learned on first use (invalid where ggml has no repacked layout for the
// type on this CPU, or its repack is not a permutation of bits).
const Inverse& inverse(ggml_type type) {
  static std::array<Inverse, GGML_TYPE_COUNT> inverses;
  static std::array<std::once_flag, GGML_TYPE_COUNT> once;
  std::call_once(once[type], [type] {
    const auto& G = ggml();
    if (G.ggml_blck_size(type) <= 1 || G.ggml_type_size(type) == 0) return;  // float or removed
    Graph g(2);
    const int64_t ne[4] = {G.ggml_blck_size(type), 8, 1, 1};
    const size_t ts = G.ggml_type_size(type), nb[4] = {ts, ts, ts * 8, ts * 8};
    if (!attach_repacked_kernels(g.raw(type, nullptr, ne, nb))) return;
    std::vector<uint8_t> flip;
    const auto target = learn_bit_targets(type, flip);
    if (target.empty()) return;
    Inverse inv = compile_inverse(type, target, std::move(flip));
    inv.valid = undoes_ggml_repack(type, inv);
    inverses[type] = std::move(inv);
  });
  return inverses[type];
}

}  // namespace

bool has_repacked_layout(ggml_type type) { return inverse(type).valid; }

Storage check_storage(int64_t type_id) {
  if (type_id < kRepackedFlag || type_id >= 2 * kRepackedFlag)
    return {check_storage_type(type_id), false};
  const ggml_type type = check_storage_type(type_id - kRepackedFlag);
  TORCH_CHECK_VALUE(has_repacked_layout(type), "ggml type id ", type_id, " names a repacked ",
                    type_name(type), " weight, but this CPU's ggml (", cpu_variant(),
                    ") has no repacked layout for ", type_name(type));
  return {type, true};
}

at::Tensor repack(const at::Tensor& blocks, ggml_type type, int64_t cols) {
  TORCH_CHECK_VALUE(has_repacked_layout(type), "this CPU's ggml (", cpu_variant(),
                    ") has no repacked layout for ", type_name(type));
  const int64_t rows = blocks.size(0), rb = blocks.size(1);
  TORCH_CHECK_VALUE(rows % kRepackRows == 0, "repacking takes rows in groups of ", kRepackRows,
                    "; blocks has ", rows);
  auto out = at::empty_like(blocks, at::MemoryFormat::Contiguous);
  const auto* src = blocks.data_ptr<uint8_t>();
  auto* dst = out.data_ptr<uint8_t>();
  parallel_chunks(rows, std::max<int64_t>(kRepackRows, (int64_t{1} << 18) / rb), kRepackRows, 1,
                  [&](int64_t r0, int64_t r1) {
                    ggml_repack(type, cols, r1 - r0, src + r0 * rb, dst + r0 * rb);
                  });
  return out;
}

namespace {

// `inv` for one row length: its 8- and 2-byte runs (all the quants and scales of the block-32
// layouts) as straight-line moves at absolute offsets, the bytes built from bit fields (Q4_K's and
// Q2_K's scales) each assembled in a register from the same number of parts, branch-free, and
// stored once, the other runs as `inv` applies them. Q4_K 6144x1024 on an Intel Xeon, one / two
// threads: 1.60 / 1.25 ms with each field or-ed into memory, 0.83 / 0.42 ms so (Q4_0: 0.38 / 0.22).
struct UnitProgram {
  struct Move8 {
    int64_t dst, src;
    uint64_t flip;
  };
  struct Move2 {
    int64_t dst, src;
  };
  struct Part {  // ((src byte ^ flip) & mask) << 8 >> right: the bits shifted into place
    uint16_t src;
    uint8_t flip, mask, right;
  };
  std::vector<Move8> move8;
  std::vector<Move2> move2;
  // the plain bytes built from bit fields, at built[i] from parts [i * width, (i + 1) * width)
  // (padded with parts that add no bits, so every byte has the same count)
  std::vector<int64_t> built;
  std::vector<Part> parts;
  uint32_t width = 0;
  Inverse rest;

  UnitProgram(const Inverse& inv, int64_t row_bytes) : rest(inv) {
    rest.runs.clear();
    rest.fields.clear();
    rest.cleared.clear();
    std::vector<std::vector<Part>> per_byte;
    for (const auto& [row, offset] : inv.cleared) {
      built.push_back(row * row_bytes + offset);
      auto& mine = per_byte.emplace_back();
      for (const auto& f : inv.fields) {
        if (f.row != row || f.offset != offset) continue;
        mine.push_back({f.src, inv.flip[f.src], f.mask, static_cast<uint8_t>(8 - f.shift)});
      }
      width = std::max(width, static_cast<uint32_t>(mine.size()));
    }
    for (auto& mine : per_byte) {
      mine.resize(width, Part{0, 0, 0, 8});
      parts.insert(parts.end(), mine.begin(), mine.end());
    }
    for (const auto& r : inv.runs) {
      const int64_t d = r.row * row_bytes + r.offset;
      if (r.len == 8) {
        uint64_t f;
        std::memcpy(&f, inv.flip.data() + r.src, 8);
        move8.push_back({d, r.src, f});
      } else if (r.len == 2 && !r.flipped) {
        move2.push_back({d, r.src});
      } else {
        rest.runs.push_back(r);
      }
    }
  }

  void apply(const uint8_t* unit_src, int64_t row_bytes, uint8_t* dst) const {
    for (const auto& m : move8) {
      uint64_t v;
      std::memcpy(&v, unit_src + m.src, 8);
      v ^= m.flip;
      std::memcpy(dst + m.dst, &v, 8);
    }
    for (const auto& m : move2) std::memcpy(dst + m.dst, unit_src + m.src, 2);
    switch (width) {  // the common widths unrolled (Q4_K's scales: 3)
      case 0: break;
      case 1: build<1>(unit_src, dst); break;
      case 2: build<2>(unit_src, dst); break;
      case 3: build<3>(unit_src, dst); break;
      case 4: build<4>(unit_src, dst); break;
      default: build<0>(unit_src, dst);
    }
    if (!rest.runs.empty()) rest.apply(unit_src, row_bytes, dst);
  }

  // the bytes built from bit fields; W parts each (0: `width`, not unrolled)
  template <uint32_t W>
  void build(const uint8_t* unit_src, uint8_t* dst) const {
    const uint32_t w = W ? W : width;
    const Part* p = parts.data();
    for (const int64_t d : built) {
      unsigned v = 0;
      for (uint32_t i = 0; i < w; ++i, ++p)
        v |= (((unit_src[p->src] ^ p->flip) & p->mask) << 8u) >> p->right;
      dst[d] = static_cast<uint8_t>(v);
    }
  }
};

// The program of `type` for rows of row_bytes, built once per thread (get_rows and dequantize
// unpack one group at a time).
const UnitProgram& program_for(ggml_type type, const Inverse& inv, int64_t row_bytes) {
  thread_local std::map<std::pair<int, int64_t>, std::unique_ptr<UnitProgram>> programs;
  auto& program = programs[{static_cast<int>(type), row_bytes}];
  if (!program) program = std::make_unique<UnitProgram>(inv, row_bytes);
  return *program;
}

}  // namespace

void unrepack_groups(ggml_type type, const uint8_t* repacked, int64_t stride, int64_t row_bytes,
                     int64_t g0, int64_t g1, uint8_t* dst) {
  const Inverse& inv = inverse(type);
  TORCH_CHECK(inv.valid, "ggml-kernels: no repacked layout for ", type_name(type));
  const UnitProgram& program = program_for(type, inv, row_bytes);
  const int64_t blocks = row_bytes / inv.block_bytes;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = repacked + g * kRepackRows * stride;
    uint8_t* out = dst + (g - g0) * kRepackRows * row_bytes;
    for (int64_t x = 0; x < blocks; ++x)
      program.apply(group + x * inv.unit, row_bytes, out + x * inv.block_bytes);
  }
}

void mark_repacked(ggml_tensor* t) {
  TORCH_CHECK(attach_repacked_kernels(t), "ggml-kernels: no repacked kernels for a ",
              type_name(t->type), " tensor of ", t->ne[1], " rows");
}

}  // namespace ggml_quantization

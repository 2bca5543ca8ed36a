// Drives the fake Metal framework and the fake MPS stream through metal-cpp, the way a device
// layer does, for tests/test_mps_emu_fake.py:
//
//   fake-metal-driver KERNELS_DIR SCENARIO
//
// KERNELS_DIR: upstream's ggml-metal/kernels (the library source). SCENARIO "dispatch" encodes
// upstream's kernel_mul_mv_f32_f32 through metal-cpp (own command buffer, then torch's way on the
// MPS stream) and compares the bytes with the emulator's direct path and a float64 reference; it
// prints "OK ...", then the dispatch records as the C API gives them (JSON), and exits 0;
// "trampoline" sends a probe class messages with every kind of argument (xmm and general registers,
// MTLSize and scalars on the stack) and result (double, a struct in memory, nil receivers). Every
// other scenario does one thing a real Metal runtime refuses and prints "REFUSED: <message>" (exit
// 0) when the fake threw, or "NOT REFUSED" (exit 1).
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu_runtime.h"
#include "fake_mps.h"
#include "fake_mps_stream.h"
#include "ggml-metal-impl.h"

// The GNU runtime's class building (libobjc4), for the trampoline probe.
extern "C" {
Class objc_allocateClassPair(Class super_class, const char* name, size_t extra_bytes);
void objc_registerClassPair(Class cls);
BOOL class_addMethod(Class cls, SEL name, IMP imp, const char* types);
BOOL class_addIvar(Class cls, const char* name, size_t size, unsigned char log2_align,
                   const char* type);
id class_createInstance(Class cls, size_t extra_bytes);
}

namespace {

namespace emu = ggml_kernels::metal::emu;

constexpr const char* kKernel = "kernel_mul_mv_f32_f32";
// a mat-vec shape that reaches the kernel's edges: ne00 not a multiple of 32 (the tail loop), an
// odd row count (the last threadgroup's second row is past the end), three vectors
constexpr int kNe00 = 200, kNe01 = 7, kNe11 = 3;
// upstream's launch for F32 weights at this size (ggml-metal-device.cpp): 2 simdgroups, 2 rows each
constexpr int16_t kNsg = 2;
constexpr int kNr0 = 2;
constexpr size_t kSmem = 32 * sizeof(float) * kNr0;

std::string g_kernels_dir;

NS::String* str(const char* s) { return NS::String::string(s, NS::UTF8StringEncoding); }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

ggml_metal_kargs_mul_mv mul_mv_args() {
  ggml_metal_kargs_mul_mv a{};
  a.ne00 = kNe00, a.ne01 = kNe01, a.ne02 = 1;
  a.nb00 = sizeof(float), a.nb01 = kNe00 * sizeof(float), a.nb02 = a.nb01 * kNe01, a.nb03 = a.nb02;
  a.ne10 = kNe00, a.ne11 = kNe11, a.ne12 = 1;
  a.nb10 = sizeof(float), a.nb11 = kNe00 * sizeof(float), a.nb12 = a.nb11 * kNe11, a.nb13 = a.nb12;
  a.ne0 = kNe01, a.ne1 = kNe11;
  a.nr0 = kNr0;
  a.r2 = 1, a.r3 = 1;
  return a;
}

// The function constants upstream's host code sets for this kernel (FC_MUL_MV + 0..5).
std::map<int, int> mul_mv_constants() {
  return {{FC_MUL_MV + 0, kNsg}, {FC_MUL_MV + 1, 0}, {FC_MUL_MV + 2, 1},
          {FC_MUL_MV + 3, 1},    {FC_MUL_MV + 4, 1}, {FC_MUL_MV + 5, 0}};
}

MTL::FunctionConstantValues* constant_values(const std::map<int, int>& constants) {
  auto* cv = MTL::FunctionConstantValues::alloc()->init();
  for (const auto& [index, value] : constants) {
    if (index == FC_MUL_MV + 5) {
      const bool b = value != 0;
      cv->setConstantValue(&b, MTL::DataTypeBool, index);
    } else {
      const int16_t s = static_cast<int16_t>(value);
      cv->setConstantValue(&s, MTL::DataTypeShort, index);
    }
  }
  return cv;
}

// Device, library (upstream's mul_mv.metal as the source) and the kernel's pipeline.
struct Setup {
  MTL::Device* device = nullptr;
  MTL::Library* library = nullptr;
  MTL::ComputePipelineState* pipeline = nullptr;
  MTL::CommandQueue* queue = nullptr;

  explicit Setup(const std::map<int, int>& constants = mul_mv_constants()) {
    device = MTL::CreateSystemDefaultDevice();
    auto* options = MTL::CompileOptions::alloc()->init();
    options->setFastMathEnabled(true);
    options->setLanguageVersion(MTL::LanguageVersion3_1);
    NS::Object* keys[] = {str("GGML_METAL_HAS_BF16")};
    NS::Object* values[] = {str("1")};
    options->setPreprocessorMacros(NS::Dictionary::dictionary(values, keys, 1));
    NS::Error* error = nullptr;
    const std::string source = read_file(g_kernels_dir + "/mul_mv.metal");
    library = device->newLibrary(str(source.c_str()), options, &error);
    options->release();
    require(library != nullptr, "newLibraryWithSource");
    auto* cv = constant_values(constants);
    MTL::Function* fn = library->newFunction(str(kKernel), cv, &error);
    cv->release();
    if (fn == nullptr) throw std::runtime_error(error->localizedDescription()->utf8String());
    pipeline = device->newComputePipelineState(fn, &error);
    fn->release();
    require(pipeline != nullptr, "newComputePipelineStateWithFunction");
    queue = device->newCommandQueue();
  }
  ~Setup() {
    queue->release();
    pipeline->release();
    library->release();
    device->release();
  }
};

struct Data {
  std::vector<float> x = std::vector<float>(kNe01 * kNe00), y = std::vector<float>(kNe11 * kNe00);
  Data() {
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37 * i);
    for (size_t i = 0; i < y.size(); ++i) y[i] = std::cos(0.11 * i);
  }
};

// Binds args, weights, vectors and output, and dispatches the kernel as upstream's host code does.
void encode_mul_mv(MTL::ComputeCommandEncoder* enc, MTL::ComputePipelineState* pipeline,
                   MTL::Buffer* x, MTL::Buffer* y, MTL::Buffer* dst) {
  const ggml_metal_kargs_mul_mv args = mul_mv_args();
  enc->setComputePipelineState(pipeline);
  enc->setBytes(&args, sizeof(args), 0);
  enc->setBuffer(x, 0, 1);
  enc->setBuffer(y, 0, 2);
  enc->setBuffer(dst, 0, 3);
  enc->setThreadgroupMemoryLength(kSmem, 0);
  enc->dispatchThreadgroups(MTL::Size((kNe01 + kNr0 - 1) / kNr0, kNe11, 1), MTL::Size(32, kNsg, 1));
  enc->memoryBarrier(MTL::BarrierScopeBuffers);
}

// The emulator's direct path: the same launch with host pointers, no Metal in between.
std::vector<float> direct(const Data& d) {
  std::vector<float> out(kNe11 * kNe01, -1.0f);
  ggml_metal_kargs_mul_mv args = mul_mv_args();
  emu::Launch launch;
  launch.kernel = kKernel;
  for (const auto& [index, value] : mul_mv_constants()) launch.constants[index] = value;
  launch.buffers = {&args, const_cast<float*>(d.x.data()), const_cast<float*>(d.y.data()),
                    out.data()};
  launch.threadgroup_memory[0] = kSmem;
  const uint32_t grid[3] = {(kNe01 + kNr0 - 1) / kNr0, kNe11, 1}, threads[3] = {32, kNsg, 1};
  std::copy(grid, grid + 3, launch.grid);
  std::copy(threads, threads + 3, launch.threads);
  emu::run(launch);
  return out;
}

double max_error_vs_reference(const Data& d, const float* out) {
  double worst = 0;
  for (int j = 0; j < kNe11; ++j)
    for (int i = 0; i < kNe01; ++i) {
      double ref = 0;
      for (int k = 0; k < kNe00; ++k) ref += double(d.x[i * kNe00 + k]) * d.y[j * kNe00 + k];
      worst = std::max(worst, std::fabs(ref - out[j * kNe01 + i]));
    }
  return worst;
}

int scenario_dispatch() {
  at::mps::getCurrentMPSStream();  // the stream (its device and queue) lives as long as the process
  const auto live_before = fake_metal::live_objects();
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  Data d;
  const std::vector<float> want = direct(d);
  std::vector<float> out_own(want.size(), -1.0f), out_stream(want.size(), -1.0f);
  {
    Setup s;
    require(s.device->maxThreadgroupMemoryLength() == 32768, "maxThreadgroupMemoryLength");
    require(s.device->supportsFamily(MTL::GPUFamilyApple7), "supportsFamily(Apple7)");
    require(s.device->supportsFamily(MTL::GPUFamilyMetal3), "supportsFamily(Metal3)");
    require(!s.device->supportsFamily(MTL::GPUFamilyApple9), "!supportsFamily(Apple9)");
    require(s.device->maxThreadsPerThreadgroup().width == 1024,
            "maxThreadsPerThreadgroup (a struct returned in memory: objc_msgSend_stret)");
    require(std::string(s.device->name()->utf8String()).find("fake") != std::string::npos, "name");
    require(s.pipeline->maxTotalThreadsPerThreadgroup() == 1024, "maxTotalThreadsPerThreadgroup");
    require(s.pipeline->threadExecutionWidth() == 32, "threadExecutionWidth");
    // Foundation's UTF-8 string constructor (metal-cpp has none: sent as metal-cpp sends any)
    using WithUtf8 = NS::String* (*)(const void*, SEL, const char*);
    NS::String* abc = reinterpret_cast<WithUtf8>(&objc_msgSend)(
        objc_lookUpClass("NSString"), sel_registerName("stringWithUTF8String:"), "abc");
    require(abc->length() == 3 && abc->isEqualToString(str("abc")), "stringWithUTF8String:");
    // a message to nil returns 0 (sent as metal-cpp sends any: objc_msgSend cast to the method's
    // type)
    using Length = NS::UInteger (*)(const void*, SEL);
    require(reinterpret_cast<Length>(&objc_msgSend)(nullptr, sel_registerName("length")) == 0,
            "a message to nil returns 0");

    // weights in a buffer of the device (shared storage: the host fills it), vectors and output in
    // host memory wrapped as private buffers (an MPS tensor's storage)
    MTL::Buffer* x =
        s.device->newBuffer(d.x.size() * sizeof(float), MTL::ResourceStorageModeShared);
    std::memcpy(x->contents(), d.x.data(), x->length());
    MTL::Buffer* y = fake_metal::wrap_host_memory(d.y.data(), d.y.size() * sizeof(float));
    require(y->contents() == nullptr, "a private buffer's contents() is nullptr");
    MTL::Buffer* dst = fake_metal::wrap_host_memory(out_own.data(), out_own.size() * sizeof(float));

    // 1. a command buffer of our own
    MTL::CommandBuffer* cb = s.queue->commandBuffer();
    MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
    encode_mul_mv(enc, s.pipeline, x, y, dst);
    enc->endEncoding();
    require(out_own[0] == -1.0f, "nothing runs before commit");
    cb->commit();
    cb->waitUntilCompleted();
    require(cb->status() == MTL::CommandBufferStatusCompleted, "command buffer completed");
    dst->release();

    // 2. torch's way: encode on the MPS stream's encoder inside dispatch_sync_f on its queue,
    // leave committing to the stream
    MTL::Buffer* dst2 =
        fake_metal::wrap_host_memory(out_stream.data(), out_stream.size() * sizeof(float));
    struct Work {
      MTL::ComputePipelineState* pipeline;
      MTL::Buffer *x, *y, *dst;
    } work{s.pipeline, x, y, dst2};
    at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
    dispatch_sync_f(stream->queue(), &work, [](void* p) {
      auto* w = static_cast<Work*>(p);
      auto* enc = static_cast<MTL::ComputeCommandEncoder*>(
          at::mps::getCurrentMPSStream()->commandEncoder());
      encode_mul_mv(enc, w->pipeline, w->x, w->y, w->dst);
    });
    stream->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
    dst2->release();
    y->release();
    x->release();
  }
  pool->release();
  fake_metal::check_no_leaks(live_before, "the dispatch scenario");

  require(std::memcmp(out_own.data(), want.data(), want.size() * sizeof(float)) == 0,
          "own command buffer: bytes equal to the emulator's direct path");
  require(std::memcmp(out_stream.data(), want.data(), want.size() * sizeof(float)) == 0,
          "MPS stream: bytes equal to the emulator's direct path");
  const double err = max_error_vs_reference(d, out_own.data());
  require(err < 1e-4, "within 1e-4 of the float64 reference");
  const auto records = fake_metal::dispatches();
  require(records.size() == 2 && records[0].kernel == kKernel, "two dispatch records");
  const std::vector<std::string> calls = fake_metal::calls();
  auto count = [&](const std::string& line) {
    return std::count(calls.begin(), calls.end(), line);
  };
  require(count("-[MTLComputeCommandEncoder dispatchThreadgroups:threadsPerThreadgroup:] 4x3x1 of "
                "32x2x1") == 2,
          "both dispatches in the call log, with their grids");
  require(count("-[MTLComputeCommandEncoder setBuffer:offset:atIndex:] 0 @2") == 2,
          "bindings in the call log");
  require(count("+[NSString stringWithCString:encoding:] \"kernel_mul_mv_f32_f32\"") == 1,
          "class methods in the call log");
  require(count("-[MTLBuffer length]") >= 1, "getters in the call log");
  if (std::getenv("GK_FAKE_METAL_PRINT_CALLS") != nullptr)
    for (const std::string& line : calls) std::fprintf(stderr, "%s\n", line.c_str());
  std::printf("OK dispatches=%zu max_abs_err_vs_f64=%.3g calls=%zu source_hash=%llx\n",
              records.size(), err, fake_metal::calls().size(),
              static_cast<unsigned long long>(fake_metal::last_library_source_hash()));
  std::string json(gk_fake_metal_dispatches_json(nullptr, 0), '\0');
  gk_fake_metal_dispatches_json(json.data(), json.size() + 1);
  std::printf("%s\n", json.c_str());  // the C API's view of the same records
  return 0;
}

// ---- the objc_msgSend trampolines, on a probe class: every kind of argument arrives ----

struct Triple {  // 24 bytes: returned in memory (objc_msgSend_stret)
  double a, b, c;
};

// 8 doubles fill xmm0-7, 4 longs rdx..r9 after self and the selector; the rest is on the stack:
// an MTLSize by value, a double and two longs past the registers.
double probe_mix(id, SEL, double d0, double d1, double d2, double d3, double d4, double d5,
                 double d6, double d7, long i0, long i1, long i2, long i3, MTL::Size s, double d8,
                 long i4, long i5) {
  return d0 + 2 * d1 + 3 * d2 + 4 * d3 + 5 * d4 + 6 * d5 + 7 * d6 + 8 * d7 + 9 * d8 + 10.0 * i0 +
         100.0 * i1 + 1e3 * i2 + 1e4 * i3 + 1e5 * i4 + 1e6 * i5 + 1e-1 * s.width + 1e-2 * s.height +
         1e-3 * s.depth;
}

Triple probe_triple(id, SEL, long x, float f) { return {double(x), 2.0 * x, double(f)}; }

int scenario_trampoline() {
  Class cls = objc_allocateClassPair(nullptr, "GKTrampolineProbe", 0);
  class_addIvar(cls, "isa", sizeof(Class), 3, "#");
  class_addMethod(cls, sel_registerName("mix"), reinterpret_cast<IMP>(&probe_mix), "d@:");
  class_addMethod(cls, sel_registerName("triple"), reinterpret_cast<IMP>(&probe_triple), "v@:");
  objc_registerClassPair(cls);
  id probe = class_createInstance(cls, 0);

  using Mix = double (*)(id, SEL, double, double, double, double, double, double, double, double,
                         long, long, long, long, MTL::Size, double, long, long);
  const MTL::Size s(7, 8, 9);
  const double want = probe_mix(probe, nullptr, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, s, 9, 5, 6);
  const double got = reinterpret_cast<Mix>(&objc_msgSend_fpret)(
      probe, sel_registerName("mix"), 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, s, 9, 5, 6);
  require(got == want, "objc_msgSend_fpret: every register and stack argument arrives");
  const double got_plain = reinterpret_cast<Mix>(&objc_msgSend)(
      probe, sel_registerName("mix"), 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, s, 9, 5, 6);
  require(got_plain == want, "objc_msgSend with a double result");

  using Stret = void (*)(Triple*, id, SEL, long, float);
  Triple t{-1, -1, -1};
  reinterpret_cast<Stret>(&objc_msgSend_stret)(&t, probe, sel_registerName("triple"), 21, 0.5f);
  require(t.a == 21 && t.b == 42 && t.c == 0.5, "objc_msgSend_stret");
  Triple untouched{-1, -1, -1};
  reinterpret_cast<Stret>(&objc_msgSend_stret)(&untouched, nullptr, sel_registerName("triple"), 1,
                                               1.0f);
  require(untouched.a == -1, "objc_msgSend_stret to nil leaves the result alone");
  using Nil = double (*)(id, SEL);
  require(reinterpret_cast<Nil>(&objc_msgSend_fpret)(nullptr, sel_registerName("mix")) == 0.0,
          "objc_msgSend_fpret to nil returns 0.0");
  std::printf("OK mix=%.6f\n", got);
  return 0;
}

// A command buffer with an encoder on it, for the refusal scenarios.
struct Encoding {
  Setup setup;
  MTL::CommandBuffer* cb;
  MTL::ComputeCommandEncoder* enc;
  Encoding() : cb(setup.queue->commandBuffer()), enc(cb->computeCommandEncoder()) {
    enc->setComputePipelineState(setup.pipeline);
  }
};

const std::map<std::string, std::function<void()>>& refusals() {
  static const std::map<std::string, std::function<void()>> r = {
      {"encoder-after-end",
       [] {
         Encoding e;
         e.enc->endEncoding();
         const int v = 0;
         e.enc->setBytes(&v, sizeof(v), 0);
       }},
      {"binding-index",
       [] {
         Encoding e;
         MTL::Buffer* b = e.setup.device->newBuffer(64, MTL::ResourceStorageModeShared);
         e.enc->setBuffer(b, 0, 31);
       }},
      {"threadgroup-memory",
       [] {
         Encoding e;
         e.enc->setThreadgroupMemoryLength(16384, 0);
         e.enc->setThreadgroupMemoryLength(32768, 1);  // each fits; together they do not
         e.enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
       }},
      {"threadgroup-memory-one",
       [] {
         Encoding e;
         e.enc->setThreadgroupMemoryLength(32768 + 16, 0);
       }},
      {"unbound-argument",
       [] {
         Encoding e;
         MTL::Buffer* b = e.setup.device->newBuffer(4096, MTL::ResourceStorageModeShared);
         const ggml_metal_kargs_mul_mv args = mul_mv_args();
         e.enc->setBytes(&args, sizeof(args), 0);
         e.enc->setBuffer(b, 0, 1);
         e.enc->setBuffer(b, 0, 3);  // src1 (argument 2) left out
         e.enc->setThreadgroupMemoryLength(kSmem, 0);
         e.enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, kNsg, 1));
       }},
      {"unset-threadgroup-memory",
       [] {
         Encoding e;
         MTL::Buffer* b = e.setup.device->newBuffer(4096, MTL::ResourceStorageModeShared);
         const ggml_metal_kargs_mul_mv args = mul_mv_args();
         e.enc->setBytes(&args, sizeof(args), 0);
         for (int i = 1; i <= 3; ++i) e.enc->setBuffer(b, 0, i);
         e.enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, kNsg, 1));
       }},
      {"missing-constant",
       [] {
         auto constants = mul_mv_constants();
         constants.erase(FC_MUL_MV + 0);  // nsg
         Setup s(constants);
       }},
      {"unspecialized-function",
       [] {
         Setup s;
         MTL::Function* fn = s.library->newFunction(str(kKernel));
         NS::Error* error = nullptr;
         if (s.device->newComputePipelineState(fn, &error) == nullptr)
           throw std::runtime_error(error->localizedDescription()->utf8String());
       }},
      {"double-release",
       [] {
         Setup s;
         MTL::Buffer* b = s.device->newBuffer(64, MTL::ResourceStorageModeShared);
         b->release();
         b->release();
       }},
      {"use-after-release",
       [] {
         Setup s;
         MTL::Buffer* b = s.device->newBuffer(64, MTL::ResourceStorageModeShared);
         b->release();
         (void)b->contents();
       }},
      {"leak",
       [] {
         const auto before = fake_metal::live_objects();
         NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
         {
           Setup s;
           (void)s.device->newBuffer(64, MTL::ResourceStorageModeShared);  // never released
         }
         pool->release();
         fake_metal::check_no_leaks(before, "the leak scenario");
       }},
      {"reentrant-dispatch",
       [] {
         dispatch_queue_t q = at::mps::getCurrentMPSStream()->queue();
         dispatch_sync_f(q, q, [](void* queue) {
           dispatch_sync_f(static_cast<dispatch_queue_t>(queue), nullptr, [](void*) {});
         });
       }},
      {"encoder-off-queue", [] { at::mps::getCurrentMPSStream()->commandEncoder(); }},
      {"unknown-selector",
       [] {
         Setup s;
         (void)s.device->newSharedEvent();
       }},
      {"commit-open-encoder",
       [] {
         Encoding e;
         e.cb->commit();
       }},
      {"autorelease-without-pool",
       [] {
         MTL::Device* device = MTL::CreateSystemDefaultDevice();
         (void)device->name();
       }},
  };
  return r;
}

int scenario_refusal(const std::string& name) {
  auto it = refusals().find(name);
  if (it == refusals().end()) {
    std::fprintf(stderr, "unknown scenario %s\n", name.c_str());
    return 2;
  }
  const bool needs_no_pool = name == "autorelease-without-pool";
  NS::AutoreleasePool* pool = needs_no_pool ? nullptr : NS::AutoreleasePool::alloc()->init();
  try {
    it->second();
  } catch (const std::exception& e) {
    std::printf("REFUSED: %s\n", e.what());
    return 0;
  }
  if (pool != nullptr) pool->release();
  std::printf("NOT REFUSED\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s KERNELS_DIR SCENARIO\n", argv[0]);
    return 2;
  }
  g_kernels_dir = argv[1];
  const std::string scenario = argv[2];
  try {
    if (scenario == "dispatch") return scenario_dispatch();
    if (scenario == "trampoline") return scenario_trampoline();
    return scenario_refusal(scenario);
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
}

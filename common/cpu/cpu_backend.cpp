// The CPU backend of the packages' ggml graphs: ggml-cpu's own code, run on the calling thread (or
// ggml's threadpool), the graph's intermediate results in host memory.
//
// ggml-base + ggml-cpu are built once per x86-64 feature level (tools/build/ggml_runtime.py) into
// libggml-kernels-cpu-<variant>.so next to the extension; the best variant the running CPU
// supports is loaded (GGML_KERNELS_CPU_VARIANT forces one).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "ggml_torch.h"

namespace ggml_kernels {
namespace {

// Best first. Names and required features match VARIANTS in tools/build/ggml_runtime.py.
bool has_haswell() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
}
bool has_skylakex() {
  return has_haswell() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw");
}
bool has_zen4() {
  return has_skylakex() && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
}
bool has_x64() { return true; }

struct Variant {
  const char* name;
  bool (*supported)();
};
constexpr Variant kVariants[] = {
    {"zen4", has_zen4}, {"skylakex", has_skylakex}, {"haswell", has_haswell}, {"x64", has_x64}};

}  // namespace

const char* backend_name() { return "cpu"; }
const c10::DeviceType backend::kDevice = c10::DeviceType::CPU;
const bool backend::kSlicesOverThreads = true;
const bool backend::kIntelCpu = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") != 0;
}();
const bool backend::kNotesTensors = false;

backend::Loaded backend::load(GgmlApi& api) {
  const std::string dir = this_library_dir();
  const char* forced = std::getenv("GGML_KERNELS_CPU_VARIANT");
  std::string tried;
  for (const auto& v : kVariants) {
    if (forced && *forced && std::strcmp(forced, v.name) != 0) continue;
    const std::string path = dir + "/libggml-kernels-cpu-" + v.name + ".so";
    if (!v.supported()) {
      TORCH_CHECK(!(forced && *forced), "GGML_KERNELS_CPU_VARIANT=", forced,
                  ": this CPU lacks the instructions that variant needs");
      continue;
    }
    if (!file_exists(path)) {
      tried += " " + path + " (missing)";
      continue;
    }
    std::string error;
    if (open_runtime(path, Functions::Cpu, api, error) == nullptr) {
      tried += " " + path + " (" + error + ")";
      continue;
    }
    api.ggml_cpu_init();
    return {path, v.name};
  }
  TORCH_CHECK(false, "ggml-kernels: no usable ggml CPU runtime",
              forced ? std::string(" for GGML_KERNELS_CPU_VARIANT=") + forced : std::string(),
              " in ", dir, ":", tried);
}

namespace {

// A ggml threadpool with its work buffer (kept for the next graph up to GraphMemory::kKeptBytes).
struct Pool {
  ggml_threadpool* threadpool = nullptr;
  int n_threads = 0;
  std::unique_ptr<uint8_t, decltype(&std::free)> work{nullptr, &std::free};
  size_t work_size = 0;

  void run(ggml_cgraph* graph, int threads, uint32_t poll) {
    const GgmlApi& G = ggml();
    if (threadpool == nullptr || n_threads != threads) {
      if (threadpool) G.ggml_threadpool_free(threadpool);
      ggml_threadpool_params params = G.ggml_threadpool_params_default(threads);
      params.poll = poll;
      threadpool = G.ggml_threadpool_new(&params);
      TORCH_CHECK(threadpool != nullptr, "ggml-kernels: could not start a ggml threadpool");
      n_threads = threads;
    }
    ggml_cplan plan = G.ggml_graph_plan(graph, threads, threadpool);
    if (plan.work_size > work_size) {
      const size_t size = (plan.work_size + 63) / 64 * 64;
      work.reset(static_cast<uint8_t*>(std::aligned_alloc(64, size)));
      TORCH_CHECK(work != nullptr, "ggml-kernels: out of memory for a ", size, "-byte work buffer");
      work_size = size;
    }
    plan.work_data = work.get();
    const ggml_status status = G.ggml_graph_compute(graph, &plan);
    if (work_size > GraphMemory::kKeptBytes) {  // a big graph's work buffer is not kept
      work.reset();
      work_size = 0;
    }
    TORCH_CHECK(status == GGML_STATUS_SUCCESS,
                "ggml-kernels: ggml_graph_compute failed with status ", static_cast<int>(status));
  }

  ~Pool() {
    // A one-thread pool owns no threads; freeing it at thread exit only returns its memory.
    if (threadpool && n_threads == 1) ggml().ggml_threadpool_free(threadpool);
  }
};

struct SharedPool {
  std::mutex mu;
  Pool pool;
};

SharedPool& shared_pool() {
  static SharedPool* p = [] {
    auto* created = new SharedPool();  // never destroyed: its workers may outlive static teardown
    // A forked child has none of the parent's worker threads: forget the pool there (leaking it)
    // so the child starts its own instead of waiting on threads that do not exist.
    pthread_atfork(nullptr, nullptr, [] {
      SharedPool& sp = shared_pool();
      new (&sp.mu) std::mutex();
      sp.pool.threadpool = nullptr;
      sp.pool.n_threads = 0;
    });
    return created;
  }();
  return *p;
}

// Runs `graph` on the calling thread. Ops split their work over torch's threads (at::parallel_for,
// see parallel_chunks in ggml_torch.h) and run one single-threaded ggml graph per slice, so ggml
// starts no threads of its own and never competes with torch's thread pool for the cores. Each
// torch thread keeps its own one-thread ggml threadpool and work buffer: no locks.
void compute_graph(ggml_cgraph* graph) {
  thread_local Pool pool;
  pool.run(graph, 1, 0);
}

// Runs `graph` on ggml's own threadpool with n_threads threads (calls are serialised). For ops
// that cannot be sliced from outside; the pool's workers sleep between graphs.
void compute_graph_threaded(ggml_cgraph* graph, int n_threads) {
  n_threads = std::max(1, std::min(n_threads, GGML_MAX_N_THREADS));
  SharedPool& sp = shared_pool();
  std::lock_guard<std::mutex> lock(sp.mu);
  sp.pool.run(graph, n_threads, /*poll=*/0);
}

thread_local std::vector<uint8_t> t_scratch;

}  // namespace

void backend::run_graph(ggml_cgraph* graph, ggml_tensor* const*, size_t, int n_threads,
                        GraphMemory& memory) {
  const auto& G = ggml();
  const int n = G.ggml_graph_n_nodes(graph);
  // Intermediate results get memory in graph order: small ones (a decode step's) from this thread's
  // scratch buffer, which like the context buffer serves one graph at a time, instead of an
  // allocation each; big ones (prefill) as torch tensors that live as long as the Graph.
  size_t scratch = 0;
  for (int i = 0; i < n; ++i) {
    const ggml_tensor* node = G.ggml_graph_node(graph, i);
    if (node->data == nullptr && node->view_src == nullptr)
      scratch += (G.ggml_nbytes(node) + 63) / 64 * 64;
  }
  // (continuing after what an earlier compute of this Graph took: its nodes may be read again)
  const bool use_scratch = memory.scratch_used + scratch <= GraphMemory::kScratchBytes;
  if (use_scratch && t_scratch.size() < GraphMemory::kScratchBytes + 64)
    t_scratch.resize(GraphMemory::kScratchBytes + 64);  // never moves after
  uintptr_t next =
      ((reinterpret_cast<uintptr_t>(t_scratch.data()) + 63) & ~uintptr_t(63)) + memory.scratch_used;
  if (use_scratch) memory.scratch_used += scratch;
  for (int i = 0; i < n; ++i) {
    ggml_tensor* node = G.ggml_graph_node(graph, i);
    if (node->data != nullptr) continue;
    if (node->view_src != nullptr) {
      node->data = static_cast<char*>(node->view_src->data) + node->view_offs;
    } else if (use_scratch) {
      node->data = reinterpret_cast<void*>(next);
      next += (G.ggml_nbytes(node) + 63) / 64 * 64;
    } else {
      memory.keep_alive.push_back(
          at::empty({static_cast<int64_t>(G.ggml_nbytes(node)) + 64}, at::kByte));
      const auto addr = reinterpret_cast<uintptr_t>(memory.keep_alive.back().data_ptr());
      node->data = reinterpret_cast<void*>((addr + 63) & ~uintptr_t(63));
    }
  }
  if (n_threads > 1) {
    compute_graph_threaded(graph, n_threads);
  } else {
    compute_graph(graph);
  }
}

}  // namespace ggml_kernels

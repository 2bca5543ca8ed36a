#include "ggml_runtime.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

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

struct Runtime {
  GgmlApi api;
  std::string variant;
  std::string path;
};

std::string this_library_dir() {
  Dl_info info{};
  TORCH_CHECK(dladdr(reinterpret_cast<void*>(&this_library_dir), &info) && info.dli_fname,
              "ggml-kernels: cannot locate the extension library on disk");
  std::string file = info.dli_fname;
  auto slash = file.rfind('/');
  return slash == std::string::npos ? std::string(".") : file.substr(0, slash);
}

bool file_exists(const std::string& p) {
  struct stat st{};
  return ::stat(p.c_str(), &st) == 0;
}

// ggml's messages on stderr as its default logger writes them, without the debug ones (ggml-cpu's
// repack says "repack tensor ..." at debug level for every weight it repacks).
void log_without_debug(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_DEBUG) return;
  std::fputs(text, stderr);
  std::fflush(stderr);
}

Runtime* load_runtime() {
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
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      tried += " " + path + " (" + dlerror() + ")";
      continue;
    }
    auto* rt = new Runtime();
    rt->variant = v.name;
    rt->path = path;
#define GGML_KERNELS_RESOLVE(name)                                               \
  rt->api.name = reinterpret_cast<decltype(rt->api.name)>(dlsym(handle, #name)); \
  TORCH_CHECK(rt->api.name != nullptr, "ggml-kernels: ", path, " does not export " #name);
    GGML_KERNELS_API_FUNCTIONS(GGML_KERNELS_RESOLVE)
#undef GGML_KERNELS_RESOLVE
    rt->api.ggml_log_set(log_without_debug, nullptr);
    rt->api.ggml_cpu_init();
    return rt;  // lives for the whole process, like the library itself
  }
  TORCH_CHECK(false, "ggml-kernels: no usable ggml CPU runtime",
              forced ? std::string(" for GGML_KERNELS_CPU_VARIANT=") + forced : std::string(),
              " in ", dir, ":", tried);
}

Runtime& runtime() {
  static Runtime* rt = load_runtime();  // thread-safe, retried on the next call if it threw
  return *rt;
}

// A ggml threadpool with its work buffer.
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

}  // namespace

const GgmlApi& ggml() { return runtime().api; }
std::string cpu_variant() { return runtime().variant; }
std::string runtime_path() { return runtime().path; }

void compute_graph(ggml_cgraph* graph) {
  thread_local Pool pool;
  pool.run(graph, 1, 0);
}

void compute_graph_threaded(ggml_cgraph* graph, int n_threads) {
  n_threads = std::max(1, std::min(n_threads, GGML_MAX_N_THREADS));
  SharedPool& sp = shared_pool();
  std::lock_guard<std::mutex> lock(sp.mu);
  sp.pool.run(graph, n_threads, /*poll=*/0);
}

}  // namespace ggml_kernels

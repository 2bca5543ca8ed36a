// The ggml runtime's loading, shared by the backends (the choice of library is theirs:
// common/cpu/cpu_backend.cpp, common/metal/metal_backend.cpp).
#include "ggml_runtime.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdio>

namespace ggml_kernels {
namespace {

// ggml's messages on stderr as its default logger writes them, without the debug ones (ggml-cpu's
// repack says "repack tensor ..." at debug level for every weight it repacks).
void log_without_debug(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_DEBUG) return;
  std::fputs(text, stderr);
  std::fflush(stderr);
}

struct Runtime {
  GgmlApi api;
  backend::Loaded loaded;
};

Runtime& runtime() {
  static Runtime* rt = [] {         // thread-safe, retried on the next call if it threw
    auto* created = new Runtime();  // lives for the whole process, like the library itself
    created->loaded = backend::load(created->api);
    return created;
  }();
  return *rt;
}

}  // namespace

std::string this_library_dir() {
  Dl_info info{};
  TORCH_CHECK(dladdr(reinterpret_cast<void*>(&this_library_dir), &info) && info.dli_fname,
              "ggml-kernels: cannot locate the extension library on disk");
  std::string file = info.dli_fname;
  auto slash = file.rfind('/');
  return slash == std::string::npos ? std::string(".") : file.substr(0, slash);
}

bool file_exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

void* open_runtime(const std::string& path, Functions backend_functions, GgmlApi& api,
                   std::string& error) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    error = dlerror();
    return nullptr;
  }
#define GGML_KERNELS_RESOLVE(name)                                       \
  api.name = reinterpret_cast<decltype(api.name)>(dlsym(handle, #name)); \
  TORCH_CHECK(api.name != nullptr, "ggml-kernels: ", path, " does not export " #name);
  GGML_KERNELS_BASE_FUNCTIONS(GGML_KERNELS_RESOLVE)
  if (backend_functions == Functions::Cpu) {
    GGML_KERNELS_CPU_FUNCTIONS(GGML_KERNELS_RESOLVE)
  } else {
    GGML_KERNELS_METAL_FUNCTIONS(GGML_KERNELS_RESOLVE)
  }
#undef GGML_KERNELS_RESOLVE
  api.ggml_log_set(log_without_debug, nullptr);
  return handle;
}

const GgmlApi& ggml() { return runtime().api; }
std::string cpu_variant() { return runtime().loaded.variant; }
std::string runtime_path() { return runtime().loaded.path; }

}  // namespace ggml_kernels

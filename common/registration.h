// Op registration and the Python module of a package's extension.
//
// The builder compiles each package with -DTORCH_EXTENSION_NAME=<id> (e.g.
// _ggml_quantization_cpu_1a2b3c4): that is both the torch op namespace and the Python module name,
// so two builds of one package never clash in a process.
#pragma once

#define Py_LIMITED_API 0x03090000
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "ggml_runtime.h"
#include "ggml_torch.h"

#define GGML_KERNELS_CONCAT_(a, b) a##b
#define GGML_KERNELS_CONCAT(a, b) GGML_KERNELS_CONCAT_(a, b)
#define GGML_KERNELS_STR_(x) #x
#define GGML_KERNELS_STR(x) GGML_KERNELS_STR_(x)

// TORCH_LIBRARY with the namespace taken from TORCH_EXTENSION_NAME.
#define GGML_KERNELS_LIBRARY(m) TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, m)
#define GGML_KERNELS_LIBRARY_IMPL(key, m) TORCH_LIBRARY_IMPL_EXPAND(TORCH_EXTENSION_NAME, key, m)
// More ops of that namespace from a backend's own translation unit (metal/metal_emu_ops.cpp).
#define GGML_KERNELS_LIBRARY_FRAGMENT(m) TORCH_LIBRARY_FRAGMENT_EXPAND(TORCH_EXTENSION_NAME, m)
#define TORCH_LIBRARY_EXPAND(ns, m) TORCH_LIBRARY(ns, m)
#define TORCH_LIBRARY_FRAGMENT_EXPAND(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TORCH_LIBRARY_IMPL_EXPAND(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace ggml_kernels::python {

inline PyObject* str_result(const std::string& s) { return PyUnicode_FromString(s.c_str()); }

// fn() with a C++ exception turned into Python's RuntimeError.
template <typename F>
PyObject* guarded(F&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// Python-callable facts about the loaded ggml runtime (for logs, tests and bug reports).
inline PyObject* py_cpu_variant(PyObject*, PyObject*) {
  return guarded([] { return str_result(cpu_variant()); });
}
inline PyObject* py_runtime_path(PyObject*, PyObject*) {
  return guarded([] { return str_result(runtime_path()); });
}
inline PyObject* py_ggml_version(PyObject*, PyObject*) {
  return guarded([] {
    const auto& G = ggml();
    return str_result(std::string(G.ggml_version()) + " (" + G.ggml_commit() + ")");
  });
}
inline PyObject* py_backend(PyObject*, PyObject*) { return str_result(backend_name()); }
inline PyObject* py_max_tensor_bytes(PyObject*, PyObject*) {
  return PyLong_FromLongLong(kMaxTensorBytes);
}

inline PyMethodDef kMethods[] = {
    {"cpu_variant", py_cpu_variant, METH_NOARGS, "ggml CPU variant loaded for this CPU"},
    {"runtime_path", py_runtime_path, METH_NOARGS, "path of the loaded ggml runtime library"},
    {"ggml_version", py_ggml_version, METH_NOARGS, "ggml version and commit"},
    {"backend", py_backend, METH_NOARGS, "the backend this build runs ops on"},
    {"max_tensor_bytes", py_max_tensor_bytes, METH_NOARGS,
     "the largest tensor (numel * element size) an op reads or makes"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace ggml_kernels::python

// The extension's Python module: importing it registers the ops (static initialisers).
#define GGML_KERNELS_PYTHON_MODULE()                                                    \
  static PyModuleDef ggml_kernels_module_def = {PyModuleDef_HEAD_INIT,                  \
                                                GGML_KERNELS_STR(TORCH_EXTENSION_NAME), \
                                                nullptr,                                \
                                                -1,                                     \
                                                ggml_kernels::python::kMethods,         \
                                                nullptr,                                \
                                                nullptr,                                \
                                                nullptr,                                \
                                                nullptr};                               \
  extern "C" __attribute__((visibility("default"))) PyObject* GGML_KERNELS_CONCAT(      \
      PyInit_, TORCH_EXTENSION_NAME)(void) {                                            \
    return PyModule_Create(&ggml_kernels_module_def);                                   \
  }

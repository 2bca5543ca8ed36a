"""What tests share: loading our builds as users do (kernel_testing) and llama.cpp's own ggml
through ctypes as an independent oracle (ggml_ctypes)."""

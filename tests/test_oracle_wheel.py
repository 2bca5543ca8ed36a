"""The llama.cpp oracle wheel is built for an explicit instruction set read from the CPU's flags,
never ggml's native build and never AMX (whose code crashed llama_decode on an Intel Xeon), and its
cache folder names that set, so a wheel built on another CPU is not reused."""

from __future__ import annotations

from tools.build import llama_cpp_wheel as wheel

HASWELL = {"sse4_2", "avx", "f16c", "fma", "bmi2", "avx2"}
AVX512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
SAPPHIRE_RAPIDS = HASWELL | AVX512 | {"avx512vbmi", "avx512_vnni", "avx512_bf16", "avx_vnni",
                                      "amx_tile", "amx_int8", "amx_bf16"}


def test_amx_is_never_enabled():
    chosen = wheel.instruction_set(SAPPHIRE_RAPIDS)
    assert chosen == ["SSE42", "AVX", "F16C", "FMA", "BMI2", "AVX2", "AVX_VNNI", "AVX512", "AVX512_VBMI",
                      "AVX512_VNNI", "AVX512_BF16"]
    args = wheel.cmake_args(chosen)
    assert "-DGGML_NATIVE=OFF" in args
    for amx in ("AMX_TILE", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{amx}=OFF" in args and f"-DGGML_{amx}=ON" not in args


def test_avx512_extensions_need_avx512_itself():
    chosen = wheel.instruction_set(HASWELL | {"avx512_vnni", "avx512_bf16"})  # no avx512bw: not usable
    assert chosen == ["SSE42", "AVX", "F16C", "FMA", "BMI2", "AVX2"]
    assert "-DGGML_AVX512_BF16=OFF" in wheel.cmake_args(chosen)


def test_each_instruction_set_has_its_own_cache_folder():
    tags = {wheel.cache_tag(wheel.instruction_set(flags)) for flags in (set(), HASWELL, HASWELL | AVX512, SAPPHIRE_RAPIDS)}
    assert len(tags) == 4
    assert wheel.cache_tag([]) == "x86_64-baseline"


def test_this_cpu_s_set_is_what_its_flags_allow():
    flags = wheel.cpu_flags()
    for name in wheel.instruction_set():
        assert all(f in flags for f in dict(wheel.X86_OPTIONS)[name])

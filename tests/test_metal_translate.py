"""The .metal -> C++ translator (tools/build/metal_translate.py) on small pieces of MSL written here:
each rewrite, and the registry it generates. The translations of upstream's real files are compiled
by every build and run by tests/test_metal_host.py."""

from __future__ import annotations

import pytest

from tools.build import metal_translate as mt

KERNEL = """
constant bool FC_use [[function_constant(FC_X + 1)]];
template <typename T>
kernel void kernel_scale(
        constant args_t & args,
        device const char * src,
        device       char * dst [[buffer(4)]],
        device       char * next,
        threadgroup float * shmem [[threadgroup(0)]],
        uint3   tgpig [[threadgroup_position_in_grid]],
        ushort  tiisg [[thread_index_in_simdgroup]]) {
    threadgroup float partial[32];
    float acc[4] = { [0 ... 3] = 0.0f };
    half h = 1.5h;
}
typedef decltype(kernel_scale<float>) kernel_scale_t;
template [[host_name("kernel_scale_f32")]] kernel kernel_scale_t kernel_scale<float>;
kernel void kernel_plain(device char * dst, uint tid [[thread_position_in_grid]]) {}
"""


def test_function_constants_become_per_dispatch_globals():
    assert "GK_FUNCTION_CONSTANT(bool, FC_use, FC_X + 1)" in mt.translate(KERNEL, "t.metal")


def test_parameters_bind_by_attribute_and_implicit_buffer_indices():
    out = mt.translate(KERNEL, "t.metal")
    params = next(line for line in out.splitlines() if line.startswith("const gk_emu::Param gk_params_kernel_scale[]"))
    assert "{gk_emu::Param::Kind::Buffer, 0}, {gk_emu::Param::Kind::Buffer, 1}, {gk_emu::Param::Kind::Buffer, 4}, " \
           "{gk_emu::Param::Kind::Buffer, 5}, {gk_emu::Param::Kind::Threadgroup, 0}" in params
    assert "gk_emu::kThreadgroupPositionInGrid" in params and "gk_emu::kThreadIndexInSimdgroup" in params
    signature = out.split("void kernel_scale(")[1].split(") {")[0]
    assert "[[" not in signature and "shmem ," in signature  # attributes read, then dropped


def test_host_names_and_plain_kernels_are_registered():
    out = mt.translate(KERNEL, "t.metal")
    assert 'KernelRegistrar gk_registrar_0("kernel_scale_f32", &gk_entry_0, "t.metal")' in out
    # the instance is taken where it stood (its arguments may use macros #undef'd further down)
    assert "constexpr auto gk_instance_0 = &kernel_scale<float>;" in out
    assert "gk_emu::invoke(gk_instance_0, c, gk_params_kernel_scale)" in out
    assert "gk_emu::invoke(&kernel_plain, c, gk_params_kernel_plain)" in out
    assert '"kernel_plain"' in out and "template [[host_name" not in out


def test_rewrites_of_c_only_and_msl_only_syntax():
    out = mt.translate(KERNEL, "t.metal")
    assert "float acc[4]; for (auto& gk_e : acc) gk_e = 0.0f;" in out  # GNU range initialiser
    assert "half h = ((half) 1.5f);" in out  # half literal
    assert "float (&partial)[32] = gk_threadgroup_local<float[32]>(0);" in out  # shared, not per thread
    assert out.count("namespace {") >= 2  # the file in its own unnamed namespace


def test_instances_keep_macros_undefined_later():
    """fa_*.metal spell template arguments with a macro (FA_TYPES) they #undef at the end."""
    src = KERNEL + "#define TYPES float\ntemplate [[host_name(\"kernel_scale_m\")]] kernel kernel_scale_t kernel_scale<TYPES>;\n#undef TYPES\n"
    out = mt.translate(src, "t.metal")
    assert out.index("= &kernel_scale<TYPES>;") < out.index("#undef TYPES")
    assert "kernel_scale_m" in mt.kernel_names(src)


def test_literal_conditionals_keep_the_compiled_branch():
    src = "a\n#if 1\nb\n#else\nc\n#endif\n#if 0\nd\n#else\ne\n#endif\n#if defined(X)\nf\n#endif\n"
    assert mt.prune_literal_conditionals(src) == "a\nb\ne\n#if defined(X)\nf\n#endif\n"


def test_an_unknown_parameter_attribute_is_an_error():
    with pytest.raises(ValueError, match="attribute the emulator does not know"):
        mt.translate("kernel void k(device char * x [[stage_in]]) {}", "t.metal")


def test_an_instance_of_another_file_is_an_error():
    with pytest.raises(ValueError, match="not a kernel of this file"):
        mt.translate('template [[host_name("k_f32")]] kernel k_t elsewhere<float>;', "t.metal")


def test_lane_zero_branches_are_convergence_points():
    """On a GPU a SIMD group's lanes run in lock-step: lane 0's branch runs after every lane's
    earlier statements and before their later ones; the emulator meets there explicitly when the
    branch touches threadgroup memory, and leaves a lane's own store to device memory alone."""
    body = """kernel void k(device float * dst, threadgroup float * ss [[threadgroup(0)]], ushort tiisg) {
    threadgroup half  * sm  = (threadgroup half  *) (ss + 8);
    float s = ss[tiisg];
    if (tiisg == 0 && ok) {
        ss[0] = s; { }
    }
    if (tiisg == 0) { sm[1] = 0; }
    if (tiisg == 0) { dst[0] = s; }
    float t = ss[1];"""
    out = mt.converge_around_lane_zero_branches(body)
    assert "if (gk_simd_converge(), tiisg == 0 && ok) {" in out and "if (gk_simd_converge(), tiisg == 0) { sm[1] = 0; }" in out
    assert out.index("} gk_simd_converge();") > out.index("ss[0] = s; { }") and out.endswith("float t = ss[1];")
    assert "    if (tiisg == 0) { dst[0] = s; }" in out
    assert mt.threadgroup_names(body) == {"ss", "sm"}
    with pytest.raises(ValueError, match="with an else"):
        mt.converge_around_lane_zero_branches("if (tiisg == 0) { a(); } else { b(); }")
    with pytest.raises(ValueError, match="not a braced block"):
        mt.converge_around_lane_zero_branches("if (tiisg == 0) a();")

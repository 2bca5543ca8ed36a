"""The fake Metal framework and fake MPS stream of the Linux twin (common/metal/mps_emu/,
tools/build/mps_runtime.py), driven through metal-cpp by a C++ driver (tests/mps_emu/) the way the
MPS device layer drives them: a dispatch of upstream's kernel_mul_mv_f32_f32 gives the same bytes
as the emulator's direct path (bitwise: the same kernel on the same inputs, no Metal in between)
and is within 1e-4 of a float64 reference (200-term float32 dot products of values in [-1, 1]);
each thing a real Metal runtime refuses is a C++ exception with a clear message, caught by the
driver (the process does not abort). The driver tests are in the slow tier: the first build compiles
the framework with clang (about a minute, after installing clang-16 and libobjc4 where missing), and
nothing in them depends on torch's version."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.build import mps_runtime, upstream
from tools.testing.metal_host import MetalHost, library_path

F32, F16, Q4_0, Q8_0, Q4_K, Q6_K, I32, BF16 = 0, 1, 2, 8, 12, 14, 26, 30  # ggml.h's enum ggml_type


@pytest.fixture(scope="module")
def driver():
    out = mps_runtime.build()
    kernels = upstream.ggml_tree() / "src" / "ggml-metal" / "kernels"

    def run(scenario: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(out / "fake-metal-driver"), str(kernels), scenario], capture_output=True, text=True,
                              timeout=120)

    return run


@pytest.mark.slow
def test_a_dispatch_through_metal_cpp_gives_the_emulators_bytes(driver):
    res = driver("dispatch")
    assert res.returncode == 0 and res.stdout.startswith("OK dispatches=2"), res.stdout + res.stderr
    records = json.loads(res.stdout.splitlines()[1])  # as gk_fake_metal_dispatches_json gives them
    assert [(d["kernel"], d["grid"], d["threads"]) for d in records] == [("kernel_mul_mv_f32_f32", [4, 3, 1], [32, 2, 1])] * 2
    assert records[0]["constants"] == {"600": 2, "601": 0, "602": 1, "603": 1, "604": 1, "605": 0}
    assert records[0]["bytes"] == {"0": 112} and records[0]["threadgroup_memory"] == {"0": 256}


@pytest.mark.slow
def test_the_trampolines_pass_every_argument_and_result(driver):
    res = driver("trampoline")
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stdout + res.stderr


C_API_SCRIPT = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])  # registers its classes in this process

def text(name):
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]
    size = fn(None, 0)
    out = ctypes.create_string_buffer(size + 1)
    assert fn(out, size + 1) == size
    return json.loads(out.value)

lib.gk_fake_metal_reset()
before = text("gk_fake_metal_live_objects_json").get("MTLDevice", 0)
lib.MTLCreateSystemDefaultDevice.restype = ctypes.c_void_p
made = bool(lib.MTLCreateSystemDefaultDevice())
print(json.dumps({"made": made, "before": before, "after": text("gk_fake_metal_live_objects_json")["MTLDevice"],
                  "calls": text("gk_fake_metal_calls_json"), "dispatches": text("gk_fake_metal_dispatches_json")}))
"""


@pytest.mark.slow
def test_the_c_api_gives_calls_dispatches_and_live_objects_as_json(driver):
    # a process of its own: libobjc aborts when a second copy of the framework (a build-mps-emu
    # folder's, loaded by other tests) registers the same classes
    res = subprocess.run([sys.executable, "-c", C_API_SCRIPT, str(mps_runtime.out_dir() / mps_runtime.LIBRARY)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads(res.stdout)
    assert got["made"] and got["after"] == got["before"] + 1
    assert got["calls"] == ["MTLCreateSystemDefaultDevice"] and got["dispatches"] == []


REFUSALS = {
    "encoder-after-end": "-[MTLComputeCommandEncoder setBytes:length:atIndex:] after endEncoding",
    "binding-index": "argument index 31 (Metal has buffer indices 0..30)",
    "threadgroup-memory": "49152 bytes of threadgroup memory in all, over the device's 32768",
    "threadgroup-memory-one": "32784 bytes, over the device's 32768-byte threadgroup memory",
    "unbound-argument": "kernel_mul_mv_f32_f32 reads argument 2, and no buffer or bytes are bound there",
    "unset-threadgroup-memory": "kernel_mul_mv_f32_f32 uses threadgroup memory 0, and none was set",
    "missing-constant": "function kernel_mul_mv_f32_f32: no value for its function constants at indices 600",
    "unspecialized-function": "has function constants without a value (indices 600, 602, 603, 604)",
    "double-release": "-[MTLBuffer release] sent to an object already released",
    "use-after-release": "-[MTLBuffer contents] sent to an object already released",
    "leak": "the leak scenario leaked 1 MTLBuffer",
    "reentrant-dispatch": "dispatch_sync_f onto the MPS stream's queue from work already running on it",
    "encoder-off-queue": "MPSStream::commandEncoder() outside dispatch_sync_f on the stream's queue",
    "unknown-selector": "newSharedEvent]: a selector the fake Metal framework does not implement",
    "commit-open-encoder": "-[MTLCommandBuffer commit]: an encoder of this command buffer has not ended",
    "autorelease-without-pool": "this thread has no NSAutoreleasePool",
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(REFUSALS))
def test_what_metal_refuses_is_an_exception_with_a_clear_message(driver, scenario):
    res = driver(scenario)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("REFUSED: ") and REFUSALS[scenario] in res.stdout, res.stdout


KERNELS = """
#define FC_GROUP 700
constant short FC_a [[function_constant(FC_GROUP + 0)]];
constant bool  FC_b [[function_constant(FC_GROUP + 1)]];
constant int   FC_c [[function_constant(FC_GROUP + 2)]];

static inline float helper(float x) { return FC_b ? x : -x; }

template <typename T, void (*deq)(device const T *, thread float &)>
void impl(device const T * src, device float * dst) {
    float v; deq(src, v); dst[0] = helper(v) * FC_a; // FC_c only in a comment
}

template <typename T, void (*deq)(device const T *, thread float &)>
kernel void kernel_templ(device const T * src, device float * dst) { impl<T, deq>(src, dst); }

typedef decltype(kernel_templ<float, deq_f32>) templ_t;
template [[host_name("kernel_templ_f32")]] kernel templ_t kernel_templ<float, deq_f32>;

kernel void kernel_plain(device float * dst) { dst[0] = FC_c; }
kernel void kernel_none(device float * dst) { dst[0] = 1; }
"""


def test_the_constants_a_kernel_reads_come_from_its_function_and_its_callees():
    found = mps_runtime.kernel_constants(KERNELS, {"FC_GROUP": 700})
    assert found == {"kernel_templ_f32": [700, 701], "kernel_plain": [702], "kernel_none": []}


def test_missing_debian_packages_are_named(monkeypatch):
    monkeypatch.setattr(mps_runtime, "_missing_packages", lambda: ["clang-16", "libobjc4"])
    monkeypatch.setattr(mps_runtime.os, "geteuid", lambda: 1000)  # not root: nothing is installed
    with pytest.raises(RuntimeError, match="apt-get install clang-16 libobjc4"):
        mps_runtime.require_tools()


def _graphs():
    """Graphs that reach mat-vec, mat-vec-ext, mat-mat (and their _id forms), get_rows, norms,
    element-wise and flash attention (vec and its reduce) kernels."""
    for wt in (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q6_K):
        for rows in (1, 4, 9):
            yield lambda g, wt=wt, rows=rows: g.mul_mat(g.tensor(wt, 256, 64), g.tensor(F32, 256, rows))
        yield lambda g, wt=wt: g.get_rows(g.tensor(wt, 256, 16), g.tensor(I32, 4))
        for tokens in (3, 40):
            yield lambda g, wt=wt, t=tokens: g.mul_mat_id(g.tensor(wt, 256, 32, 8), g.tensor(F32, 256, 2, t),
                                                          g.tensor(I32, 2, t))
    yield lambda g: g.mul(g.rms_norm(g.tensor(F32, 256, 4)), g.tensor(F32, 256))
    yield lambda g: g.l2_norm(g.tensor(F32, 256, 4))
    yield lambda g: g.silu(g.add(g.tensor(F32, 256, 4), g.tensor(F32, 256, 4)))
    for d in (64, 128):
        yield lambda g, d=d: g.flash_attn(g.tensor(F32, d, 1, 4), g.tensor(F16, d, 256, 2), g.tensor(F16, d, 256, 2),
                                          g.tensor(F16, 256, 8))


def test_the_kernel_table_asks_no_more_than_upstreams_host_code_gives():
    """The table is a reading of the sources (a kernel reads the constants it and its callees name,
    and every argument and threadgroup memory of its signature): it must not refuse a function or a
    dispatch upstream's host code makes. Checked on the dispatches upstream's host code encodes for
    the emulated device (only logged)."""
    if not library_path().exists():
        pytest.fail(f"{library_path()} is missing: `python -m tools.build` builds it with the ggml runtime")
    table = mps_runtime.library_facts(upstream.ggml_tree() / "src" / "ggml-metal" / "kernels")
    host = MetalHost()
    with_constants = set()
    for build in _graphs():
        for d in host.compute(build, execute=False).dispatches:
            facts = table[d["kernel"]]
            missing = set(facts.constants) - {int(k) for k in d["constants"]}
            assert not missing, f"{d['kernel']}: upstream sets no value for constants {sorted(missing)}"
            assert set(facts.buffers) <= {int(k) for k in d["buffers"]}, (d["kernel"], facts, d["buffers"])
            assert set(facts.threadgroups) <= {int(k) for k in d["threadgroup_memory"]}, (d["kernel"], facts)
            if facts.constants:
                with_constants.add(d["kernel"])
    assert len(with_constants) >= 30, sorted(with_constants)  # kernels with constants that were checked


def test_a_kernels_arguments_are_its_signatures():
    found = mps_runtime.kernel_arguments(KERNELS)
    assert found == {"kernel_templ_f32": ([0, 1], []), "kernel_plain": ([0], []), "kernel_none": ([0], [])}
    mul_mv = mps_runtime.library_facts(upstream.ggml_tree() / "src" / "ggml-metal" / "kernels")["kernel_mul_mv_f32_f32"]
    assert (mul_mv.constants, mul_mv.buffers, mul_mv.threadgroups) == ([600, 602, 603, 604], [0, 1, 2, 3], [0])


def test_no_build_under_the_sanitizers(monkeypatch):
    monkeypatch.setattr(mps_runtime.sanitize, "enabled", lambda: True)
    with pytest.raises(RuntimeError, match="not built under GGML_KERNELS_SANITIZE"):
        mps_runtime.build()

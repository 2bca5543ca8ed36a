"""The MPS device layer (common/metal/mps/) end to end on the Linux twin: upstream's ggml-metal backend
over our layer, over metal-cpp and the fake Metal framework and MPS stream (common/metal/mps_emu/),
whose committed dispatches run on the emulated device. A C++ driver (tests/mps_emu/) runs the same
ggml graphs there, the tensors' own memory wrapped as Metal buffers, and on the emulated runtime
(libggml-kernels-metal-emu.so, uploads and read-backs). Only the device layer differs, so results
must be equal bit for bit, and the dispatch logs must name the same kernels, pipelines, grids,
function constants and threadgroup memory. A second compute leaves no Metal object behind (the
fake counts them)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tools import REPO
from tools.build import ggml_runtime, metal_runtime, upstream
from tools.build import ninja_build as ninja

pytestmark = pytest.mark.slow  # builds the twin's driver (~1 min of clang on two cores)

MPS = REPO / "common" / "metal" / "mps"
DRIVER = REPO / "tests" / "mps_emu" / "mps_layer_driver.cpp"
LAYER = ["mps_device.cpp", "mps_context.cpp", "metal_cpp_impl.cpp"]
CASES = ["rms_norm", "rms_norm_mul"]
GLUE_OPS = REPO / "tests" / "mps_emu" / "mps_glue_ops.cpp"


def _build(out: Path) -> tuple[Path, Path]:
    """(twin driver, emulated-runtime driver) in `out`; the twin's runtime (mps_runtime.twin_runtime)
    on the way, whose objects the twin driver links."""
    mps_runtime = pytest.importorskip("tools.build.mps_runtime")

    mps_runtime.twin_runtime(2)
    fake = mps_runtime.out_dir() / mps_runtime.LIBRARY  # the framework, with its own emulator
    runtime = ggml_runtime.runtime_dir()
    tree = upstream.ggml_tree()
    metal_dir = tree / "src" / "ggml-metal"
    metal = REPO / "common" / "metal"
    ggml = [f"-isystem{tree / 'include'}", f"-isystem{tree / 'src'}", f"-isystem{metal_dir}"]
    clang = mps_runtime.CXXFLAGS + [f"-I{mps_runtime.FAKE_DIR / 'shims'}", f"-I{mps_runtime.metal_cpp()}"]
    n = ninja.NinjaFile()
    n.rule("clang", f"{mps_runtime.CLANG} -MMD -MF $out.d $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("gxx", "g++ -MMD -MF $out.d -std=gnu++17 -O2 -fPIC -pthread $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("link", f"{mps_runtime.CLANG} -o $out $in $ldflags", "LINK $out")
    twin = out / "mps-layer-driver"
    n.build(out / "obj" / "driver-mps.o", "clang", DRIVER,
            variables={"flags": ninja.quote(clang + ["-DGK_DRIVER_MPS", f"-I{metal}", f"-I{MPS}", f"-I{mps_runtime.FAKE_DIR}"] + ggml)})
    objs = [*mps_runtime.twin_objects(), *mps_runtime.runtime_link_objects(runtime)]
    n.build(twin, "link", [out / "obj" / "driver-mps.o", *objs], implicit=[fake],
            variables={"ldflags": ninja.quote([str(fake), f"-Wl,-rpath,{fake.parent}", *mps_runtime.LINK_LIBS,
                                               *mps_runtime.torch_link_flags()])})
    emu = out / "emu-driver"
    n.build(out / "obj" / "driver-emu.o", "gxx", DRIVER, variables={"flags": ninja.quote([f"-I{metal}"] + ggml)})
    n.build(emu, "link", [out / "obj" / "driver-emu.o"],
            variables={"ldflags": ninja.quote([f"-L{runtime}", f"-l:{metal_runtime.LIBRARY}", f"-Wl,-rpath,{runtime}"])})
    n.write(out / "build.ninja")
    ninja.run(out, 2)
    return twin, emu


@pytest.fixture(scope="module")
def drivers():
    if shutil.which("clang++-16") is None:
        pytest.skip("no clang++-16 (metal-cpp needs clang's blocks)")
    return _build(OUT)


def _run(exe: Path, case: str) -> tuple[str, list[dict]]:
    res = subprocess.run([str(exe), case], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{exe.name} {case}: {res.stdout}{res.stderr}"
    result, log = res.stdout.splitlines()
    return result, json.loads(log)


OUT = ggml_runtime.runtime_dir() / "mps-layer-twin"
SAME_CHOICES = ("kernel", "pipeline", "grid", "threads", "constants", "threadgroup_memory")


@pytest.mark.parametrize("case", CASES)
def test_the_layer_on_the_twin_gives_the_emulated_devices_bits(drivers, case):
    twin, emu = drivers
    twin_bytes, twin_log = _run(twin, case)
    emu_bytes, emu_log = _run(emu, case)
    assert twin_bytes == emu_bytes and set(twin_bytes) != {"0"}
    # the twin ran the graph twice (the leak check); the emulated runtime once
    assert len(twin_log) == 2 * len(emu_log) > 0
    for twin_d, emu_d in zip(twin_log, emu_log * 2, strict=True):
        assert {k: twin_d[k] for k in SAME_CHOICES} == {k: emu_d[k] for k in SAME_CHOICES}
        assert set(twin_d["buffers"]) == set(emu_d["buffers"])


def test_an_upload_into_a_private_buffer_is_refused_not_a_crash(drivers):
    """An MPS tensor's buffer (private storage) refuses it; a buffer of the layer's own (ggml's
    buffer type, shared storage) takes it and gives the bytes back."""
    twin, _ = drivers
    res = subprocess.run([str(twin), "private_upload"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("OWN ROUND TRIP\nREFUSED: ") and "private storage" in res.stdout, res.stdout


def _place(src: Path, dest: Path) -> None:
    """src's bytes at dest, replaced by a rename (never rewritten in place: a process may have it
    mapped) and only when they differ."""
    if dest.exists() and dest.read_bytes() == src.read_bytes():
        return
    tmp = dest.with_suffix(".tmp")
    shutil.copy2(src, tmp)
    tmp.replace(dest)


def _extension(name: str, sources: list[Path], *, mps: bool, flags: tuple[str, ...] = ()):
    """An extension of the packages' glue (Graph, ggml_runtime) with `sources`, over the twin's
    runtime and the MPS backend (mps) or the emulated runtime and its backend, built in the cache."""
    from tools.build import mps_runtime
    from tools.testing import jit_extension

    build_dir = OUT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    runtime = mps_runtime.twin_runtime(2) if mps else ggml_runtime.runtime_dir() / metal_runtime.LIBRARY
    _place(runtime, build_dir / runtime.name)  # a backend loads its runtime from beside itself
    common = REPO / "common"
    cflags = ["-O1", "-DGGML_KERNELS_BACKEND_METAL=1", "-Wno-deprecated-declarations", *flags]
    ldflags = []
    backend = common / "metal" / "metal_backend.cpp"
    if mps:
        backend = MPS / "mps_backend.cpp"
        fake = mps_runtime.out_dir() / mps_runtime.LIBRARY
        cflags += ["-DGGML_KERNELS_BACKEND_MPS=1", f"'-DGGML_KERNELS_MPS_RUNTIME=\"{mps_runtime.TWIN_RUNTIME}\"'",  # through ninja's shell
                   "-DGGML_KERNELS_MPS_DEVICE=CPU"]  # the twin's MPS tensors are CPU tensors
        # mps_platform.h on the twin (the backend's tensor_buffer, synchronize): clang-built, over the fake
        ldflags = [str(mps_runtime.platform_object()), str(fake), f"-Wl,-rpath,{fake.parent}",
                   f"-l:{mps_runtime.OBJC_RUNTIME}"]
    return jit_extension.load(build_dir, name=name, verbose=False,
                              sources=[str(p) for p in [*sources, common / "ggml_torch.cpp", common / "ggml_runtime.cpp", backend]],
                              extra_include_paths=[str(common), str(MPS), str(upstream.ggml_tree() / "include")],
                              extra_cflags=cflags, extra_ldflags=ldflags)


@pytest.fixture(scope="module")
def glue(drivers):
    return _extension("mps_glue_twin", [GLUE_OPS], mps=True)


def _rms_norm(x, eps):
    import torch

    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def test_the_mps_backend_binds_tensors_in_place_copies_strided_results_and_uses_scratch(glue):
    import torch

    assert glue.backend() == "metal"
    torch.manual_seed(0)
    x, w = torch.randn(5, 4096), torch.randn(4096)
    ref = (_rms_norm(x, 1e-6) * w.double()).float()
    out = torch.empty(5, 4096)
    glue.reset_dispatches()
    glue.rms_norm_mul(x, w, 1e-6, out)  # in place: the result is computed in out's own memory
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    kernels = [d["kernel"] for d in json.loads(glue.dispatches())]
    assert kernels == ["kernel_rms_norm_mul_f32_4"]

    wide = torch.full((5, 8192), 7.0)
    glue.rms_norm_mul(x, w, 1e-6, wide[:, 1000:5096])  # strided: computed in the scratch, copied
    torch.testing.assert_close(wide[:, 1000:5096], ref, rtol=1e-5, atol=1e-5)
    assert (wide[:, :1000] == 7).all() and (wide[:, 5096:] == 7).all()

    # x and out are views of one storage: one buffer, at their offsets
    both = torch.cat([x, torch.zeros(5, 4096)], dim=1)
    glue.rms_norm_mul(both[:, :4096], w, 1e-6, both[:, 4096:])
    torch.testing.assert_close(both[:, 4096:], ref, rtol=1e-5, atol=1e-5)

    out = torch.empty(5, 4096)
    glue.reset_dispatches()
    glue.rms_norm_silu(x, out)  # the norm's result lives in the scratch tensor
    torch.testing.assert_close(out, torch.nn.functional.silu(_rms_norm(x, 1e-6)).float(), rtol=1e-5, atol=1e-5)
    kernels = [d["kernel"] for d in json.loads(glue.dispatches())]
    assert len(kernels) == 2 and kernels[0] == "kernel_rms_norm_f32_4", kernels


NORM = REPO / "packages" / "ggml-norm"


@pytest.fixture(scope="module")
def norm_ops(drivers):
    """ggml-norm's ops built over the MPS backend on the twin, and over the emulated backend."""
    import torch

    sources = [NORM / "torch-ext" / "torch_binding.cpp", NORM / "ggml_norm_ops" / "norm.cpp"]
    flags = ("-DGGML_KERNELS_DISPATCH_KEY=CPU", f"-I{NORM / 'torch-ext'}", f"-I{NORM / 'ggml_norm_ops'}")
    _extension("ggml_norm_mps_twin", sources, mps=True, flags=flags)
    _extension("ggml_norm_metal_emu", sources, mps=False, flags=flags)
    return torch.ops.ggml_norm_mps_twin, torch.ops.ggml_norm_metal_emu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ggml_norm_rms_norm_on_the_twin_gives_the_emulated_builds_bits(norm_ops, dtype):
    """ggml-norm's rms_norm op as the package builds it, over the MPS backend and layer on the twin,
    and over the emulated backend: the same bits (casts for bfloat16, a strided input). Without a
    weight: the package converts weights on the host into memory of its own (F32Vector), which an
    MPS build cannot bind."""
    import torch

    twin, emu = norm_ops
    torch.manual_seed(1)
    dt = getattr(torch, dtype)
    x = torch.randn(7, 1000).to(dt)
    for xs in [x, x[:, :512], x[1:4]]:
        ours, theirs = twin.rms_norm(xs, None, None, 1e-6, False, False), emu.rms_norm(xs, None, None, 1e-6, False, False)
        assert ours.dtype == theirs.dtype == dt and torch.equal(ours, theirs), xs.shape
        assert not torch.equal(ours, torch.zeros_like(ours))

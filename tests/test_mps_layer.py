"""The MPS device layer (common/metal/mps/) compiles on Linux as it will on a Mac: against metal-cpp
(from the package index, in the cache), the Linux shims of the fake Metal framework and upstream's
headers, with clang's blocks as metal-cpp needs; the supports_op slice against its header; the
darwin platform part and the packages' MPS backend against torch's headers (the Linux wheel ships
ATen/mps). It calls no metal-cpp method CALLS.md does not list, and has no platform conditional.
Skipped where a part is missing (clang++-16, metal-cpp, the shims, the pinned ggml tree)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tools import REPO
from tools.build import metal_runtime, upstream

MPS = REPO / "common" / "metal" / "mps"
SHIMS = REPO / "common" / "metal" / "mps_emu" / "shims"
LAYER = ["mps_device.cpp", "mps_context.cpp", "metal_cpp_impl.cpp"]
CLANG = shutil.which("clang++-16")
GXX = shutil.which("g++")


def _ggml_tree() -> Path:
    root = upstream.cache_dir() / f"ggml-{upstream.pin()['llama_cpp']['commit'][:12]}"
    if not (root / ".complete").exists():
        pytest.skip("the pinned ggml tree is not in the cache (python -m tools.build.upstream)")
    return root / "ggml"


def _metal_cpp() -> Path:
    """metal-cpp as the builds unpack it from the mlx-metal wheel (darwin toolchain or Linux twin)."""
    cache = upstream.cache_dir()
    found = sorted([*cache.glob("darwin/mlx-metal-*/metal_cpp"), *cache.glob("metal-cpp-*/metal_cpp")])
    found = [p for p in found if (p / "Metal" / "Metal.hpp").is_file()]
    if not found:
        pytest.skip("metal-cpp is not in the cache (it comes with the darwin or the Linux-twin build)")
    return found[-1]


def _layer_flags() -> list[str]:
    if CLANG is None:
        pytest.skip("no clang++-16 (metal-cpp needs clang's blocks)")
    if not (SHIMS / "TargetConditionals.h").is_file():
        pytest.skip("no Linux shims for metal-cpp (common/metal/mps_emu/shims/)")
    tree = _ggml_tree()
    return ["-std=c++17", "-fblocks", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", f"-I{SHIMS}",
            f"-I{_metal_cpp()}", f"-I{MPS}", f"-I{MPS.parent}", f"-isystem{tree / 'include'}",
            f"-isystem{tree / 'src'}", f"-isystem{tree / 'src' / 'ggml-metal'}"]


def _compile_all(commands: list[list[str]]) -> None:
    """Runs the compiles side by side; fails with every compiler message."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    errors = [f"$ {' '.join(c)}\n{p.communicate()[0]}" for c, p in zip(commands, procs, strict=True) if p.wait() != 0]
    assert not errors, "\n".join(errors)


def test_device_layer_compiles_against_metal_cpp():
    flags = _layer_flags()
    _compile_all([[CLANG, *flags, str(MPS / f)] for f in LAYER])


@pytest.mark.skipif(GXX is None, reason="no g++")
def test_supports_op_slice_compiles_against_the_layer_header(tmp_path):
    tree = _ggml_tree()
    metal_dir = tree / "src" / "ggml-metal"
    text = metal_runtime.slice_supports_op((metal_dir / "ggml-metal-device.m").read_text())
    cpp = tmp_path / "metal_supports_op.cpp"
    cpp.write_text(mps_slice(text))
    _compile_all([[GXX, "-std=c++17", "-fsyntax-only", f"-I{MPS}", f"-I{MPS.parent}", f"-isystem{tree / 'include'}",
                   f"-isystem{tree / 'src'}", f"-isystem{metal_dir}", str(cpp)]])


def mps_slice(sliced: str) -> str:
    """The emulated build's supports_op slice over the MPS layer's header instead of its own."""
    assert sliced.startswith(metal_runtime.SLICE_PRELUDE)
    return ('#include "mps_device.h"\n#include "ggml-metal-common.h"\n#include "ggml-metal-impl.h"\n#include "ggml-impl.h"\n'
            + sliced[len(metal_runtime.SLICE_PRELUDE):])


def _method_names(text: str) -> set[str]:
    """Lower-case method names called as `->name(` or `MTL::Class::name(` / `NS::Class::name(`."""
    names = set(re.findall(r"->\s*([a-z]\w*)\s*\(", text))
    return names | set(re.findall(r"\b(?:MTL|NS)::\w+::([a-z]\w*)\s*\(", text))


def test_layer_calls_only_the_metal_cpp_methods_calls_md_lists():
    metal_cpp = _metal_cpp()
    declared = set()
    for header in [*metal_cpp.glob("Metal/*.hpp"), *metal_cpp.glob("Foundation/*.hpp")]:
        declared |= set(re.findall(r"\b(?:MTL|NS)::\w+::([a-z]\w*)\s*\(", header.read_text()))
    used = set()
    for f in ["mps_device.cpp", "mps_context.cpp"]:
        used |= _method_names(re.sub(r"//[^\n]*", "", (MPS / f).read_text())) & declared
    listed = _method_names((MPS / "CALLS.md").read_text())
    assert used, "no metal-cpp call found: the scan is broken"
    assert used <= listed, f"metal-cpp calls missing from CALLS.md: {sorted(used - listed)}"


def test_layer_has_no_platform_conditionals():
    for f in ["mps_device.cpp", "mps_context.cpp", "mps_device.h", "mps_platform.h", "metal_source.h"]:
        conditionals = [line for line in (MPS / f).read_text().splitlines() if re.match(r"\s*#\s*(if|ifdef|ifndef|elif)\b", line)]
        assert not conditionals, f"{f}: {conditionals}"


@pytest.mark.slow
def test_darwin_platform_and_mps_backend_compile_against_torch_headers():
    import torch.utils.cpp_extension as ext

    flags = _layer_flags()
    torch_includes = [f"-isystem{p}" for p in ext.include_paths()]
    tree = _ggml_tree()
    common = REPO / "common"
    backend = [GXX or CLANG, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-Wno-deprecated-declarations",
               "-DGGML_KERNELS_BACKEND_METAL=1", "-DGGML_KERNELS_BACKEND_MPS=1", *torch_includes,
               f"-I{tree / 'include'}", f"-I{common}", f"-I{MPS}", str(MPS / "mps_backend.cpp")]
    _compile_all([[CLANG, *flags, *torch_includes, str(MPS / "mps_platform_darwin.cpp")], backend])

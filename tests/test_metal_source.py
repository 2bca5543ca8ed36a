"""The embedded Metal shader source of the MPS device layer (tools/build/metal_source.py): includes
resolved as upstream's embed step does, segments shared between kinds, the kernel -> kind index, and
the generated C++ giving back each kind's text exactly. Small trees written here, then the pinned
upstream tree when it is in the cache."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tools import REPO
from tools.build import metal_source, upstream

HEADER_DIR = REPO / "common" / "metal" / "mps"
CXX = shutil.which("g++") or shutil.which("clang++-16")


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "ggml-metal"


SMALL = {
    "ggml-common.h": "#pragma once\n#define QK 32\n",
    "ggml-metal/ggml-metal-impl.h": "#pragma once\nstruct args { int n; };\n",
    "ggml-metal/kernels/common.h": '#pragma once\n#include "ggml-metal-impl.h"\n#include <metal_stdlib>\n',
    "ggml-metal/kernels/dequantize.h": '#pragma once\n#include "common.h"\n#include "ggml-common.h"\n',
    "ggml-metal/kernels/fa_common.metal": '#include "common.h"\ntemplate <typename T> kernel void fa(device T * x) {}\n',
    "ggml-metal/kernels/norm.metal": '#include "common.h"\nconstant int n_norm = 4;\n'
    'kernel void kernel_norm(device float * x) {}\n'
    "#if 0\nkernel void kernel_dead(device float * x) {}\n#endif\n",
    "ggml-metal/kernels/fa.metal": '#include "common.h"\n#include "dequantize.h"\n#include "fa_common.metal"\n'
    'typedef decltype(fa<float>) fa_t;\n'
    'template [[host_name("kernel_fa_f32")]] kernel fa_t fa<float>;\n',
}


def test_includes_are_resolved_once_and_pragma_once_dropped(tmp_path):
    emb = metal_source.embed(_tree(tmp_path, SMALL))
    assert list(emb.kinds) == ["fa", "norm"]  # fa_common.metal is shared, no kind of its own
    fa = emb.source("fa")
    assert '#include "' not in fa and "#pragma once" not in fa
    assert fa.count("struct args") == 1 and fa.count("#define QK 32") == 1  # common.h reached twice
    assert "#include <metal_stdlib>" in fa  # the Metal compiler's own headers stay
    assert fa.index("struct args") < fa.index("#define QK") < fa.index("kernel_fa_f32")


def test_kinds_share_segments_and_index_their_kernels(tmp_path):
    emb = metal_source.embed(_tree(tmp_path, SMALL))
    shared = [i for i in emb.kinds["fa"] if i in emb.kinds["norm"]]
    assert any("struct args" in emb.segments[i] for i in shared)
    assert sum("struct args" in s for s in emb.segments) == 1
    assert emb.kernels == {"kernel_fa_f32": 0, "kernel_norm": 1}  # not the template, not #if 0's


def test_a_kernel_in_two_files_or_a_missing_include_is_an_error(tmp_path):
    files = dict(SMALL)
    files["ggml-metal/kernels/other.metal"] = "kernel void kernel_norm(device float * x) {}\n"
    with pytest.raises(ValueError, match="kernel_norm.*norm.metal.*other.metal"):
        metal_source.embed(_tree(tmp_path / "dup", files))
    files = dict(SMALL)
    files["ggml-metal/kernels/norm.metal"] = '#include "nowhere.h"\n'
    with pytest.raises(ValueError, match="nowhere.h"):
        metal_source.embed(_tree(tmp_path / "missing", files))
    with pytest.raises(ValueError, match="no kernel files"):
        metal_source.embed(_tree(tmp_path / "empty", {"ggml-metal/ggml-metal-impl.h": ""}))


def test_a_segment_holding_the_delimiter_is_an_error(tmp_path):
    files = dict(SMALL)
    files["ggml-metal/kernels/norm.metal"] = '// )gk_msl" \nkernel void kernel_norm(device float * x) {}\n'
    with pytest.raises(ValueError, match="delimiter"):
        metal_source.to_cpp(metal_source.embed(_tree(tmp_path, files)), "test")


# Prints every kind's joined source and the index, as the device layer reads them.
DUMP = r"""
#include <cstdio>
#include <cstring>
#include "metal_source.h"
using namespace ggml_kernels::metal_source;
int main() {
  for (int k = 0; k < kKindCount; ++k) {
    std::printf("@@kind %s\n", kKinds[k].name);
    for (int i = 0; i < kKinds[k].count; ++i) std::fputs(kKinds[k].segments[i], stdout);
  }
  for (int i = 0; i < kKernelCount; ++i) {
    std::printf("@@kernel %s %d\n", kKernels[i].name, kKernels[i].kind);
    if (i > 0 && std::strcmp(kKernels[i - 1].name, kKernels[i].name) >= 0) return 1;
  }
}
"""


def _expected_dump(emb: metal_source.Embedding) -> str:
    text = "".join(f"@@kind {kind}\n{emb.source(kind)}" for kind in emb.kinds)
    return text + "".join(f"@@kernel {n} {k}\n" for n, k in sorted(emb.kernels.items()))


def _run_dump(tmp_path: Path, emb: metal_source.Embedding) -> str:
    (tmp_path / "gen.cpp").write_text(metal_source.to_cpp(emb, "test"))
    (tmp_path / "dump.cpp").write_text(DUMP)
    exe = tmp_path / "dump"
    subprocess.run([CXX, "-std=c++17", "-O0", f"-I{HEADER_DIR}", str(tmp_path / "gen.cpp"), str(tmp_path / "dump.cpp"),
                    "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_generated_cpp_gives_back_each_kind_exactly(tmp_path):
    emb = metal_source.embed(_tree(tmp_path / "src", SMALL))
    assert _run_dump(tmp_path, emb) == _expected_dump(emb)


def test_write_rewrites_only_on_change(tmp_path):
    metal_dir = _tree(tmp_path / "src", SMALL)
    out = metal_source.write(metal_dir, tmp_path / "gen" / "metal_source.cpp")
    stamp = out.stat().st_mtime_ns
    metal_source.write(metal_dir, out)
    assert out.stat().st_mtime_ns == stamp


def _pinned_metal_dir() -> Path:
    root = upstream.cache_dir() / f"ggml-{upstream.pin()['llama_cpp']['commit'][:12]}"
    if not (root / ".complete").exists():
        pytest.skip("the pinned ggml tree is not in the cache (python -m tools.build.upstream)")
    return root / "ggml" / "src" / "ggml-metal"


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_pinned_upstream_kernels_embed_whole(tmp_path):
    metal_dir = _pinned_metal_dir()
    emb = metal_source.embed(metal_dir)
    compiled = sorted(p.stem for p in (metal_dir / "kernels").glob("*.metal") if p.name not in metal_source.SHARED_FILES)
    assert sorted(emb.kinds) == compiled
    assert emb.kernels["kernel_rms_norm_f32"] == list(emb.kinds).index("norm")
    assert emb.kernels["kernel_mul_mv_q4_K_f32"] == list(emb.kinds).index("mul_mv")
    for kind in emb.kinds:
        assert '#include "' not in emb.source(kind), kind
    # ggml-common.h (and the other shared headers) once in the binary, not in each kind
    assert sum(len(s) for s in emb.segments) < 1_500_000
    assert _run_dump(tmp_path, emb) == _expected_dump(emb)

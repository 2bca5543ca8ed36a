"""Facts that must live in more than one place agree with their one source.

- CPU levels: tools/build/ggml_runtime.py CPU_LEVELS (what is built) is the source; the loader's
  kVariants in common/cpu/cpu_backend.cpp (what is picked at run time) lists the same names, best first.
- Storage types: ggml_quantization/types.py (STORAGE_TYPES, GGMLType) is the Python source; the
  C++ check (kStorageTypes in common/ggml_torch.cpp and its error message) holds the same ids, the
  built op refuses exactly the others, and the names and ids are ggml's own (ggml.h of the pin).
- Build variant names: the integration's locate.Backend.variant() is the one rule (the integration
  installs without this checkout); tools/build (torch_variant(), darwin.variant_name()) read it from
  the integration's file, and the names are kernels' (torch<XY>-<abi>-<arch>).
- Hub ids: each package's build.toml; every Hub id written in the repo's Python is one of them, and
  the integration knows all of them.
- A CPU build on a CUDA torch needs backend="cpu": the integration's locate.backend_kwargs() is the
  one rule (kernel_testing.backend_kwargs() takes it from the integration's file).
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from tools import REPO
from tools.build import ggml_runtime, upstream
from tools.build.build import torch_variant
from tools.testing.kernel_testing import hub_ids, integration_locate, load_kernel

TYPES_PY = REPO / "packages/ggml-quantization/torch-ext/ggml_quantization/types.py"


def _types():
    """ggml_quantization/types.py on its own (it imports nothing of the package): no build needed."""
    spec = importlib.util.spec_from_file_location("_ggml_quantization_types", TYPES_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _cpp_array(path: str, name: str) -> str:
    text = (REPO / path).read_text()
    match = re.search(rf"{name}\[\]\s*=\s*\{{(.*?)\}};", text, re.S)
    assert match, f"{name} not found in {path}"
    return match.group(1)


def _ranges(text: str) -> set[int]:
    """'0-3, 6, 8-9' -> {0, 1, 2, 3, 6, 8, 9}"""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def test_cpu_levels_match_the_loader():
    loader = re.findall(r'\{"(\w+)",\s*has_\w+\}', _cpp_array("common/cpu/cpu_backend.cpp", "kVariants"))
    assert loader == list(reversed(ggml_runtime.CPU_LEVELS))  # the loader tries the best first
    assert set(ggml_runtime.CPUINFO_FLAG) == set(ggml_runtime.CPU_LEVELS) - {"x64"}


def test_storage_types_match_the_cpp_check():
    types = _types()
    cpp = {int(n) for n in re.findall(r"\d+", _cpp_array("common/ggml_torch.cpp", "kStorageTypes"))}
    assert cpp == set(types.STORAGE_TYPES)
    message = re.search(r"GGUF storage types are ([\d, -]+)\)", (REPO / "common/ggml_torch.cpp").read_text())
    assert message and _ranges(message.group(1)) == set(types.STORAGE_TYPES)


def test_storage_types_are_what_the_built_op_accepts():
    quant = load_kernel("ggml-org/ggml-quantization")
    blocks = torch.zeros(1, 1024, dtype=torch.uint8)
    for type_id in range(64):
        try:
            quant.ops.dequantize.default(blocks, type_id, 1, 256, torch.float32)
        except (ValueError, RuntimeError) as e:
            refused = "unknown or unsupported ggml type id" in str(e)
        else:
            refused = False
        assert refused == (type_id not in quant.STORAGE_TYPES), type_id


def test_type_names_and_ids_are_ggmls():
    header = upstream.cache_dir() / f"ggml-{upstream.pin()['llama_cpp']['commit'][:12]}" / "ggml/include/ggml.h"
    if not header.exists():
        pytest.skip("ggml's sources are not fetched yet (python -m tools.build.upstream)")
    ggml = {name: int(v) for name, v in re.findall(r"GGML_TYPE_(\w+)\s*=\s*(\d+),", header.read_text())}
    ours = {t.name: int(t) for t in _types().GGMLType}
    assert {name: ggml.get(name) for name in ours} == ours


def test_variant_name_is_the_integrations_rule_in_kernels_form():
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert torch_variant() == integration_locate().cpu_variant() == f"torch{major}{minor}-cxx11-cpu-x86_64-linux"


def test_hub_ids_come_from_build_toml():
    known = set(hub_ids())
    orgs = {repo_id.split("/")[0] for repo_id in known}
    pattern = re.compile(rf"""["']((?:{"|".join(map(re.escape, orgs))})/[\w.-]+)["']""")
    sources = [p for folder in ("tests", "tools", "integration", "packages") for p in (REPO / folder).rglob("*.py")
               if "build" not in p.relative_to(REPO).parts]
    written = {(m.group(1), str(p.relative_to(REPO))) for p in sources for m in pattern.finditer(p.read_text())}
    assert not {(repo_id, path) for repo_id, path in written if repo_id not in known}
    assert set(integration_locate().HUB_IDS) == known

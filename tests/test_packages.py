"""Every package build, the way the Hub and kernels see it: loads through get_kernel in a fresh
process, exports what `__all__` promises, carries valid metadata, and passes kernel-abi-check
(manylinux_2_28, abi3) with every ggml CPU level beside it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tools import REPO
from tools.build import upstream
from tools.testing.kernel_testing import CPU_LEVELS, backend_kwargs, fresh_process, hub_ids, local_kernels_env

PACKAGES = hub_ids()


def variant_dirs(path):
    return sorted(p for p in (path / "build").glob("torch*-cpu-*") if p.is_dir())


def result_of(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[6:])


@pytest.fixture(scope="module")
def fresh_loads():
    """Every package loaded through get_kernel in one fresh process (one interpreter start for all
    five): repo id -> its `__all__` and the names of it the module lacks."""
    code = f"""
import json, kernels
res = {{}}
for repo_id in {sorted(PACKAGES)!r}:
    k = kernels.get_kernel(repo_id, version=1, **{backend_kwargs()!r})
    res[repo_id] = {{"missing": [n for n in k.__all__ if not hasattr(k, n)], "all": sorted(k.__all__)}}
print("RESULT" + json.dumps(res))
"""
    return result_of(fresh_process(code, {"LOCAL_KERNELS": local_kernels_env()}))


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
def test_get_kernel_in_fresh_process(fresh_loads, repo_id):
    res = fresh_loads[repo_id]
    assert res["all"] and res["missing"] == []


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
def test_build_layout_and_metadata(repo_id):
    from kernels import Metadata

    dirs = variant_dirs(PACKAGES[repo_id])
    assert dirs, f"{repo_id} has no build"
    for d in dirs:
        meta = json.loads((d / "metadata.json").read_text())
        assert meta["name"] == PACKAGES[repo_id].name and meta["version"] == 1
        assert meta["backend"] == {"type": "cpu"}
        Metadata.read_from_file(d / "metadata.json")  # kernels' own parser accepts it
        ext = list(d.glob(f"{meta['id']}.abi3.so"))
        assert len(ext) == 1 and (d / "_ops.py").read_text().count(meta["id"]) >= 2
        for name in ("__init__.py", "layers.py", "reference.py"):
            assert (d / name).exists(), name
        for level in CPU_LEVELS:
            assert (d / f"libggml-kernels-cpu-{level}.so").exists(), level


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
def test_every_variant_carries_the_license(repo_id):
    """The binaries contain ggml: each variant ships our LICENSE and, as LICENSE.ggml, the one of the
    pinned upstream sources, byte for byte."""
    dirs = variant_dirs(PACKAGES[repo_id])
    assert dirs, f"{repo_id} has no build"
    for d in dirs:
        assert (d / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes(), d.name
        assert (d / "LICENSE.ggml").read_bytes() == upstream.upstream_license().read_bytes(), d.name
        assert json.loads((d / "metadata.json").read_text())["license"] == "MIT", d.name


def _exports(module: Path) -> list[str]:
    """A module's `__all__`, read from its source (no build needed)."""
    for node in ast.parse(module.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if getattr(target, "id", None) == "__all__":
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module} has no __all__")


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
def test_card_names_the_hub_id_and_every_export(repo_id):
    """CARD.md (the package's card on the Hub) loads the right id and lists every public name."""
    pkg = PACKAGES[repo_id]
    card = (pkg / "CARD.md").read_text()
    assert card.startswith("---\nlibrary_name: kernels\nlicense: mit\n"), "front matter"
    assert f'get_kernel("{repo_id}", version=1)' in card
    (py,) = (pkg / "torch-ext").glob("*/__init__.py")
    names = _exports(py) + _exports(py.with_name("layers.py"))
    assert [n for n in names if not re.search(rf"\b{re.escape(n)}\b", card)] == []


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
def test_abi(repo_id):
    kernel_abi_check = pytest.importorskip("kernel_abi_check")
    for d in variant_dirs(PACKAGES[repo_id]):
        for so in sorted(d.glob("*.so")):
            obj = kernel_abi_check.ObjectFile(str(so))
            assert list(obj.check_manylinux("manylinux_2_28")) == [], so.name
            if so.name.endswith(".abi3.so"):
                assert list(obj.check_python_abi("3.9")) == [], so.name


@pytest.fixture(scope="module")
def unknown_level_loads():
    """Every package loaded with GGML_KERNELS_CPU_VARIANT naming no level we build, in one fresh
    process: repo id -> the exception raised (a crash would end the process, and every test)."""
    code = f"""
import json
from tools import REPO
from tools.build import upstream
from tools.testing.kernel_testing import load_kernel, point_hub_ids_at_local_builds
point_hub_ids_at_local_builds()
res = {{}}
for repo_id in {sorted(PACKAGES)!r}:
    try:
        res[repo_id] = repr(load_kernel(repo_id).info())
    except Exception as e:
        res[repo_id] = f"{{type(e).__name__}}: {{e}}"
print("RESULT" + json.dumps(res))
"""
    return result_of(fresh_process(code, {"GGML_KERNELS_CPU_VARIANT": "pentium"}))


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
def test_unknown_forced_cpu_level_is_a_clear_error(unknown_level_loads, repo_id):
    """GGML_KERNELS_CPU_VARIANT naming no level we build: a Python exception, not a crash."""
    assert "no usable ggml CPU runtime for GGML_KERNELS_CPU_VARIANT=pentium" in unknown_level_loads[repo_id]

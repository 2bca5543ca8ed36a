"""`enable()` / `disable()`: all or nothing, reversible, version-checked, quiet, and usable outside
this checkout.

Every process-wide test runs in a fresh interpreter (enable() patches transformers for the whole
process). "Untouched" is judged independently of the integration's own undo log: each internal
listed in `compat.INTERNALS` is looked up before and after, and must be the very same object.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ggml_kernels_integration import compat, kernels_gate, locate
from ggml_kernels_integration.patching import PatchSet

from tools.testing.kernel_testing import REPO, fresh_process

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Shared by the fresh-process scripts: a snapshot of every internal and of what enable() may touch.
SNAPSHOT = """
import json, logging, os, sys
import ggml_kernels_integration as gk
from ggml_kernels_integration import compat
from transformers.integrations.gguf import gguf_conversion_mapping as gcm

def snapshot():
    objs = {f"{m}.{p}": compat.resolve(m, p) for m, p, _ in compat.INTERNALS}
    logger = logging.getLogger("ggml_kernels_integration")
    return objs, os.environ.get("LOCAL_KERNELS"), sorted(gcm.GGUF_ARCHS), (logger.level, list(logger.handlers), logger.propagate)

def differences(a, b):
    out = [k for k in a[0] if a[0][k] is not b[0][k]]
    return out + [name for name, x, y in zip(("LOCAL_KERNELS", "GGUF_ARCHS", "logger"), a[1:], b[1:]) if x != y]
"""


def run(code: str, env: dict | None = None) -> dict:
    proc = fresh_process(SNAPSHOT + code, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_internal_the_integration_relies_on_is_there():
    """One place that says what moved when transformers, kernels or gguf-py is upgraded."""
    assert compat.moved_internals() == []
    assert len(compat.INTERNALS) >= 25


def test_a_moved_internal_is_named(monkeypatch):
    from transformers.integrations.gguf import utils as gguf_utils

    monkeypatch.setattr(gguf_utils.GgufLinear, "_unpack_matmul", lambda self, packed: None)
    monkeypatch.delattr(compat.resolve("transformers.integrations.gguf", "reader"), "LazyGgufTensor")
    problems = compat.moved_internals()
    assert any("GgufLinear._unpack_matmul: parameters ('self', 'packed')" in p for p in problems), problems
    assert any("LazyGgufTensor.__getitem__: missing" in p for p in problems), problems
    with pytest.raises(compat.InternalsChangedError, match="GgufLinear._unpack_matmul"):
        compat.check_internals()


def test_the_kernel_hooks_enable_adds_are_those_transformers_gives():
    """Where transformers does not take the installed kernels (5.23 with kernels 0.17) its classes have no
    kernel hooks, and `kernels_gate` adds them from its tables; where it does, its own hooks say the same."""
    if not compat.transformers_uses_kernels():
        pytest.skip("transformers does not take this kernels: its classes carry no hooks to compare with")
    for name, layer in kernels_gate.LAYER_CLASSES.items():
        assert compat.resolve(*name.rsplit(".", 1)).kernel_layer_name == layer, name
    for name, (function, layer) in kernels_gate.FUNCTION_USERS.items():
        assert compat.resolve(name.rsplit(".", 1)[0], function).kernel_layer_name == layer, name


def test_versions_outside_the_tested_range_are_refused():
    compat.check_versions(compat.installed_versions())  # the pinned environment passes
    with pytest.raises(compat.UnsupportedVersionError) as error:
        compat.check_versions({"transformers": "5.24.0", "kernels": "0.17.2"})
    message = str(error.value)
    for part in ("transformers 5.24.0", "kernels 0.17.2", ">=5.22.2,<5.24", "allow_untested_versions=True"):
        assert part in message
    for transformers in ("5.22.2", "5.23.0"):
        assert compat.untested_versions({"transformers": transformers, "kernels": "0.17.2"}) == []
    assert compat.untested_versions({"transformers": "5.22.2", "kernels": "0.18.2"}) == [
        "kernels 0.18.2 (tested: >=0.17.2,<0.18)"
    ]


def test_patch_set_restores_attributes_items_and_environment(monkeypatch):
    class Owner:
        inherited = "base"

    class Child(Owner):
        own = "own"

    table = {"kept": 1}
    monkeypatch.delenv("GGML_KERNELS_TEST_VAR", raising=False)
    patches = PatchSet()
    patches.set_attr(Child, "own", "new")
    patches.set_attr(Child, "inherited", "shadow")
    assert patches.wrap(Child, "own", lambda old: old + "+") == "new"
    patches.set_item(table, "added", 2)
    patches.set_item(table, "kept", 3)
    patches.set_env("GGML_KERNELS_TEST_VAR", "x")
    assert (Child.own, Child.inherited, table, len(patches)) == ("new+", "shadow", {"kept": 3, "added": 2}, 6)
    patches.restore()
    assert (Child.own, Child.inherited, table, "inherited" in Child.__dict__) == ("own", "base", {"kept": 1}, False)
    import os

    assert "GGML_KERNELS_TEST_VAR" not in os.environ and len(patches) == 0


@pytest.mark.slow
def test_enable_disable_enable_restores_everything_and_works_again():
    out = run("""
import torch
from tools.models import make_gguf
from transformers import AutoModelForCausalLM
before = snapshot()
gk.enable()
enabled = snapshot()
changed = differences(before, enabled)
gk.enable()  # again: nothing wrapped twice
twice = differences(enabled, snapshot())
gk.disable()
restored = differences(before, snapshot())
gk.enable()
path = make_gguf.ensure("qwen35-tiny", "Q4_K_M")
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
s = gk.summary(model)
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
gk.disable()
from ggml_kernels_integration import kernels_gate
qwen35 = [n for n in kernels_gate.LAYER_CLASSES if ".modeling_qwen3_5." in n]
print(json.dumps({"changed": changed, "twice": twice, "restored": restored,
                  "again": differences(before, snapshot()), "finite": bool(torch.isfinite(logits).all()),
                  "ours": sorted(name for name, _ in s.ours), "packed": dict(s.packed),
                  "hooks": sorted({hasattr(compat.resolve(*n.rsplit(".", 1)), "kernel_layer_name") for n in qwen35})}))
""")
    # what enable() changes, judged from outside: at least one internal per job it does
    for name in ("hub_kernels.get_kernel", "GgufLinear.forward", "GgufLinear._unpack_matmul", "DynamicLayer.update",
                 "load_gguf_checkpoint", "GGUFReader._get_field_parts", "LazyGgufTensor.__getitem__",
                 "quantizer_gguf.read_gguf_metadata", "get_ggml_layer_mapping", "kernel_can_read",
                 "_process_model_after_weight_loading", "LOCAL_KERNELS", "GGUF_ARCHS"):
        assert any(name in c for c in out["changed"]), (name, out["changed"])
    assert out["twice"] == [] and out["restored"] == [] and out["again"] == []
    assert out["finite"] and out["packed"].get("GgufLinear", 0) > 0
    assert {"RMSNormZeroCentered", "Qwen3_5GatedDeltaNet"} <= set(out["ours"])
    # kernel hooks enable() gave the classes (where transformers gave them none) are gone with disable()
    assert out["hooks"] == [compat.transformers_uses_kernels()]


@pytest.mark.slow
@pytest.mark.parametrize("step", ["_check_files_before_transformers_reads_them", "_after_each_gguf_load"])
def test_a_failure_midway_leaves_everything_as_it_was(step):
    """A failing step (early, and the last one) undoes the steps before it; a later enable() works."""
    out = run(f"""
before = snapshot()
real = getattr(gk, "{step}")
def failing(*args, **kwargs):
    real(*args, **kwargs)  # let it patch, then fail
    raise OSError("injected")
setattr(gk, "{step}", failing)
try:
    gk.enable()
    raised = None
except OSError as e:
    raised = str(e)
after = differences(before, snapshot())
setattr(gk, "{step}", real)
gk.enable()
ok = bool(differences(before, snapshot())) and gk.is_enabled()
print(json.dumps({{"raised": raised, "after": after, "enabled": gk.is_enabled(), "ok": ok}}))
""")
    assert out == {"raised": "injected", "after": [], "enabled": True, "ok": True}


@pytest.mark.slow
def test_a_load_reports_once_and_kernels_warnings_are_held_back():
    code = """
import torch
from tools.models import make_gguf
from transformers import AutoModelForCausalLM
gk.enable()
for config in ("qwen35-tiny", "qwen35moe-tiny"):
    path = make_gguf.ensure(config, "Q4_K_M")
    AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
print(json.dumps({}))
"""
    proc = fresh_process(SNAPSHOT + code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "No kernel mapping found" not in err
    assert err.count("ggml-kernels: Qwen3_5ForCausalLM on cpu") == 1
    assert err.count("ggml-kernels: Qwen3_5MoeForCausalLM on cpu") == 1
    assert "RMSNormZeroCentered" in err and "ggml-org/ggml-gated-delta-net" in err
    assert "SoftmaxTopKRouter" in err and "transformers-community/topk" in err


def test_builds_come_from_the_environment_first(tmp_path, monkeypatch):
    ours = locate.builds()
    assert locate.QUANTIZATION in ours, "build the packages first (nox -s build)"
    monkeypatch.setattr(locate, "CHECKOUT_PACKAGES", tmp_path / "nothing")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.delenv(locate.BUILDS_ENV, raising=False)
    assert locate.builds() == {}
    # a folder of package folders, a package folder, and `<hub id>=<kernel folder>` entries
    monkeypatch.setenv(locate.BUILDS_ENV, str(REPO / "packages"))
    assert locate.builds() == ours
    norm = ours["ggml-org/ggml-norm"]
    monkeypatch.setenv(locate.BUILDS_ENV, str(norm))
    assert locate.builds() == {"ggml-org/ggml-norm": norm}
    # a downloaded kernel repository: variant folders under build/, no build.toml
    copy = tmp_path / "hub-download"
    shutil.copytree(norm / "build", copy / "build")
    monkeypatch.setenv(locate.BUILDS_ENV, f"ggml-org/ggml-norm={copy}")
    assert locate.builds() == {"ggml-org/ggml-norm": copy}
    # an entry that holds no build is passed over, with a warning naming it and what is used instead
    monkeypatch.setenv(locate.BUILDS_ENV, f"ggml-org/ggml-norm={tmp_path / 'empty'}")
    monkeypatch.setenv("LOCAL_KERNELS", f"ggml-org/ggml-norm={copy}")
    with pytest.warns(UserWarning, match=f"names {tmp_path / 'empty'} for ggml-org/ggml-norm, .*: using {copy}"):
        assert locate.builds() == {"ggml-org/ggml-norm": copy}
    monkeypatch.delenv("LOCAL_KERNELS")
    with pytest.warns(UserWarning, match="no other build was found"):
        assert locate.builds() == {}
    monkeypatch.setenv(locate.BUILDS_ENV, str(tmp_path / "mistyped"))
    with pytest.warns(UserWarning, match="mistyped is neither"):
        assert locate.builds() == {}


@pytest.mark.slow
def test_an_installed_integration_finds_builds_through_the_environment(tmp_path):
    """A regular (not editable) install outside the checkout: only GGML_KERNELS_BUILDS tells it."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(REPO / "integration")], check=True, capture_output=True)
    code = (
        "import json, ggml_kernels_integration as gk, ggml_kernels_integration.locate as loc\n"
        "print(json.dumps([str(loc.CHECKOUT_PACKAGES), sorted(gk.builds())]))"
    )
    env = {"PYTHONPATH": str(target), "LOCAL_KERNELS": ""}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**_clean_env(), **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    checkout, found = json.loads(proc.stdout)
    assert not Path(checkout).exists() and found == []
    env[locate.BUILDS_ENV] = str(REPO / "packages")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**_clean_env(), **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert locate.QUANTIZATION in json.loads(proc.stdout)[1]


def _clean_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", locate.BUILDS_ENV)}


# the Metal backends that run here (the "mps" one needs a Mac: test_integration_mps.py)
METAL_BACKENDS = [name for name, backend in locate.BACKENDS.items() if backend.emulated]


@pytest.mark.parametrize("backend", METAL_BACKENDS)
def test_each_backend_has_its_own_build_folders(backend):
    """`builds("metal-emu")` takes each package's build-metal-emu/ folder (a kernel folder whose
    variants kernels finds directly), `builds("mps-emu")` build-mps-emu/, `builds()` the package
    folders (variants under build/)."""
    cpu, metal = locate.builds(), locate.builds(backend)
    assert set(metal) == set(locate.HUB_IDS) == set(cpu), "build the packages first (nox -s build)"
    for repo_id, folder in metal.items():
        assert folder == cpu[repo_id] / f"build-{backend}" and locate.variant_dir(folder) is not None
    assert locate.required(backend) == locate.HUB_IDS and locate.required("cpu") == (locate.QUANTIZATION,)


def test_an_unknown_backend_is_named():
    for call in (locate.builds, locate.required, locate.backend_of):
        with pytest.raises(ValueError, match="unknown backend 'cuda': expected one of cpu, metal-emu, mps-emu, mps"):
            call("cuda")


def test_enable_refuses_bad_backend_arguments_before_changing_anything():
    out = run("""
before = snapshot()
errors = []
for kwargs in ({"backend": "mps-gpu"}, {"backend": "metal-emu", "repack_weights": True},
               {"backend": "mps-emu", "repack_weights": True}, {"repack_weights": "sometimes"}):
    try:
        gk.enable(**kwargs)
    except ValueError as e:
        errors.append(str(e))
untouched = differences(before, snapshot())
gk.enable()
try:
    gk.enable(backend="metal-emu")
except RuntimeError as e:
    errors.append(str(e))
try:
    gk.metal_dispatches()
except RuntimeError as e:
    errors.append(str(e))
cpu = gk.backend()
gk.disable()
gk.enable(backend="metal-emu")
metal = gk.backend()
gk.reset_metal_dispatches()
empty = gk.metal_dispatches()
gk.disable()
print(json.dumps({"errors": errors, "untouched": untouched, "backends": [cpu, metal, gk.backend()], "empty": empty}))
""")
    assert out["untouched"] == []
    assert [e.split(":")[0] for e in out["errors"]] == [
        "unknown backend 'mps-gpu'", "repack_weights holds weights in ggml-cpu's layout",
        "repack_weights holds weights in ggml-cpu's layout",
        "repack_weights must be one of (True, False, 'auto'), not 'sometimes'", "enabled with backend 'cpu'",
        "metal_dispatches() needs enable(backend='metal-emu' or 'mps-emu'), enabled",
    ]
    assert out["backends"] == ["cpu", "metal-emu", None] and out["empty"] == {}

"""`enable(backend="mps")`: the packages' darwin variants on torch's MPS device, on an Apple-silicon Mac.

What a Linux machine can check: the backend's row resolves the darwin variant folders of this
checkout (cross-built by `nox -s build-darwin`), under the name the darwin builders write and kernels
picks on a Mac; the layer kernels are mapped for the "mps" device from those folders; and off a Mac
enable() refuses in one sentence before anything is patched. The run itself is `nox -s mac`'s model
step (tools/mac.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ggml_kernels_integration import locate
from ggml_kernels_integration.patching import PatchSet

from tools.build import darwin, darwin_toolchain
from tools.testing import mps_builds
from tools.testing.kernel_testing import REPO, fresh_process

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MPS = locate.BACKENDS["mps"]


def _darwin_variants() -> list[Path]:
    return sorted((REPO / "packages").glob(f"*/build/{MPS.variant()}"))


def test_the_variant_name_is_the_one_the_darwin_builds_write():
    """The darwin builders (cross and native) and the mps test kind take the name from the
    integration's row (read from this checkout's file): the same for every torch of the matrix."""
    for version in ("2.13.0", "2.14.1", "2.15.0"):
        torch_mac = darwin_toolchain.TorchMac(version, Path("include"), Path("lib"))
        assert MPS.variant(version) == darwin.variant_name(torch_mac) == f"torch{torch_mac.tag}-metal-aarch64-darwin"
    assert MPS.variant() == mps_builds.darwin_variant()
    assert locate.MIN_MACOS == darwin_toolchain.MIN_MACOS


def test_kernels_picks_that_variant_on_an_apple_silicon_mac():
    """kernels 0.17's own resolution, given a Mac's facts: the darwin variant is accepted on macOS 26
    with Metal (torch with an MPS device), the Linux CPU variant beside it is not; on macOS 15 none is."""
    from kernels import backends, variants

    found = [variants.parse_variant(MPS.variant()), variants.parse_variant(locate.cpu_variant())]
    version = torch.__version__.split("+")[0].rsplit(".", 1)[0]

    def accepted(macos: str) -> list[str]:
        chosen, _ = variants._resolve_variant_for_system(
            variants=found, selected_backend=backends.Metal(), cpu="aarch64", os="darwin",
            torch_version=variants.Version(version), torch_cxx11_abi=None, tvm_ffi_version=None,
            macos_version=variants.Version(macos))
        return [v.variant_str for v in chosen]

    assert accepted(locate.MIN_MACOS) == [MPS.variant()]
    assert accepted("15.5") == []


def test_the_mps_row_resolves_the_darwin_variants_of_this_checkout():
    """builds("mps") names the package folders (kernels finds the variant under build/), and each
    variant folder it resolves is a Metal build."""
    assert len(_darwin_variants()) == len(locate.HUB_IDS), "cross-build the darwin variants first (nox -s build-darwin)"
    ours = locate.builds("mps")
    assert set(ours) == set(locate.HUB_IDS) and locate.required("mps") == locate.HUB_IDS
    assert ours == locate.builds("cpu")  # the same package folders: both kinds of variant live in build/
    for folder in ours.values():
        variant = locate.variant_dir(folder, "mps")
        assert variant == folder / "build" / MPS.variant()
        assert json.loads((variant / "metadata.json").read_text())["backend"]["type"] == "metal"
    assert (MPS.device, MPS.metal, MPS.emulated, MPS.folder) == ("mps", True, False, "build")


def test_a_missing_darwin_variant_is_not_a_build(tmp_path, monkeypatch):
    """A package folder with CPU variants only has no mps build; the message says how to make one."""
    package = REPO / "packages" / "ggml-norm"
    copy = tmp_path / "ggml-norm"
    (copy / "build" / locate.cpu_variant()).mkdir(parents=True)
    (copy / "build" / locate.cpu_variant() / "__init__.py").write_text("")
    (copy / "build.toml").write_text((package / "build.toml").read_text())
    monkeypatch.setenv(locate.BUILDS_ENV, str(copy))
    assert "ggml-org/ggml-norm" in locate.builds("cpu")
    with pytest.warns(UserWarning, match=f"holds no mps build for {MPS.variant()}: using {package}"):
        assert locate.builds("mps")["ggml-org/ggml-norm"] == package  # found further on, in this checkout
    monkeypatch.setattr(locate, "CHECKOUT_PACKAGES", tmp_path / "nothing")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    with pytest.warns(UserWarning, match="no other build was found"):
        assert "ggml-org/ggml-norm" not in locate.builds("mps")
    message = locate.not_found_message("mps", ("ggml-org/ggml-norm",))
    assert f"no mps build of ggml-org/ggml-norm for {MPS.variant()}" in message and "nox -s build-darwin" in message


@pytest.mark.parametrize(("system", "machine", "macos", "mps", "problem"), [
    ("Linux", "x86_64", "", False, "this machine is Linux x86_64, torch "),
    ("Darwin", "x86_64", "26.1", False, "this machine is macOS 26.1 x86_64"),
    ("Darwin", "arm64", "15.5", True, "this machine is macOS 15.5 arm64"),
    ("Darwin", "arm64", "26.1", False, "(MPS device available: False)"),
    ("Darwin", "arm64", "26.0", True, None),
    ("Darwin", "arm64", "27.0.1", True, None),
])
def test_the_host_check_of_the_mps_backend(monkeypatch, system, machine, macos, mps, problem):
    monkeypatch.setattr(locate.platform, "system", lambda: system)
    monkeypatch.setattr(locate.platform, "machine", lambda: machine)
    monkeypatch.setattr(locate.platform, "mac_ver", lambda: (macos, ("", "", ""), ""))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    found = locate.host_problem("mps")
    if problem is None:
        assert found is None
        locate.check_host("mps")
    else:
        assert found.startswith("the mps backend needs macOS 26.0 or later on Apple silicon with torch's MPS device")
        assert problem in found
        with pytest.raises(RuntimeError, match="the mps backend needs macOS"):
            locate.check_host("mps")
    assert [locate.host_problem(name) for name in ("cpu", "metal-emu", "mps-emu")] == [None, None, None]


def test_enable_mps_off_a_mac_refuses_before_patching_anything():
    """In a fresh interpreter: a RuntimeError in one sentence, every internal enable() may replace
    (`compat.INTERNALS`) the very same object afterwards, LOCAL_KERNELS as it was, nothing enabled."""
    proc = fresh_process("""
import json, os
import ggml_kernels_integration as gk
from ggml_kernels_integration import compat

def snapshot():
    return [compat.resolve(m, p) for m, p, _ in compat.INTERNALS], os.environ.get("LOCAL_KERNELS")

before = snapshot()
try:
    gk.enable(backend="mps")
    error = None
except RuntimeError as e:
    error = str(e)
after = snapshot()
untouched = all(a is b for a, b in zip(before[0], after[0])) and before[1] == after[1]
print(json.dumps({"error": error, "untouched": untouched, "enabled": gk.is_enabled(), "backend": gk.backend()}))
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"].startswith("the mps backend needs macOS 26.0 or later on Apple silicon with torch's MPS device; "
                                   "this machine is Linux")
    assert out == {"error": out["error"], "untouched": True, "enabled": False, "backend": None}


def test_the_layer_kernels_are_mapped_for_the_mps_device_from_the_darwin_variants():
    """transformers grafts layer kernels for the device the model is on (on a Mac its GGUF loader puts
    the weights on "mps"): the mps backend's entries are for "mps", from each darwin variant folder."""
    import ggml_kernels_integration as gk
    from kernels import Mode
    from transformers.integrations.gguf import kernels as gguf_kernels

    ours = locate.builds("mps")
    patches = PatchSet()
    try:
        gk._map_layer_kernels(patches, ours, "mps")
        mapping = gguf_kernels.get_ggml_layer_mapping()
    finally:
        patches.restore()
    for layer, (repo_id, layer_class) in gk.LAYER_KERNELS.items():
        assert list(mapping[layer]) == ["mps"], layer
        repo = mapping[layer]["mps"][Mode.INFERENCE]
        assert Path(repo._repo_path) == ours[repo_id] / "build" / MPS.variant() and repo.layer_name == layer_class

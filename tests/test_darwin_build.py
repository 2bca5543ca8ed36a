"""The darwin cross-build (tools/build/darwin.py, darwin_toolchain.py): our stubs of Apple's libraries
hold only symbols a shipped macOS binary imports from the same library, or noted ones; the stub
updater; the build's refusals (a missing device-layer file, a runtime without a function the extension
looks up by name); and the variants `nox -s build-darwin` made, where there are some. Tests that read
the toolchain are fast once it is in the cache and marked slow otherwise (they download it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tools import REPO
from tools.build import darwin, darwin_toolchain, macho, macho_check

needs_toolchain = pytest.mark.skipif(False, reason="cached") if darwin_toolchain.cached() else pytest.mark.slow


@pytest.fixture(scope="module")
def toolchain():
    return darwin_toolchain.toolchain()


def test_stubs_toml_is_as_the_updater_writes_it():
    assert darwin_toolchain.stubs_text(darwin_toolchain.load_stubs()) == darwin_toolchain.STUBS_TOML.read_text()


@pytest.mark.parametrize(("text", "expected"), [
    ('[M]\nsymbols = ["_a"]\n', r"\[M\] lacks \['install-name'\]"),
    ('[M]\ninstall-name = "/x"\nsymbols = ["_a"]\n[M.notes]\n_b = "why"\n', r"\[M.notes\] names symbols it does not list: \['_b'\]"),
])
def test_stubs_toml_refusals(tmp_path, monkeypatch, text, expected):
    monkeypatch.setattr(darwin_toolchain, "STUBS_TOML", tmp_path / "stubs.toml")
    (tmp_path / "stubs.toml").write_text(text)
    with pytest.raises(ValueError, match=expected):
        darwin_toolchain.load_stubs()


@needs_toolchain
def test_every_stub_symbol_is_imported_by_a_shipped_macos_binary_or_noted(toolchain):
    refs = darwin_toolchain.references(toolchain)
    for name, lib in darwin_toolchain.load_stubs().items():
        unproven = set(lib["symbols"]) - refs.get(lib["install-name"], set()) - set(lib.get("notes", {}))
        assert not unproven, f"{name}: no shipped macOS binary imports {sorted(unproven)} from {lib['install-name']}"


@needs_toolchain
def test_update_stubs_adds_what_a_shipped_binary_imports(toolchain, tmp_path, monkeypatch):
    stubs = tmp_path / "stubs.toml"
    stubs.write_text(darwin_toolchain.STUBS_TOML.read_text())
    monkeypatch.setattr(darwin_toolchain, "STUBS_TOML", stubs)
    # objc_autoreleasePoolPush: torch's libs import it from libobjc; gk_nowhere: nothing does
    (tmp_path / "a.c").write_text("void* objc_autoreleasePoolPush(void); void gk_nowhere(void);\n"
                                  "void* f(void) { gk_nowhere(); return objc_autoreleasePoolPush(); }\n")
    subprocess.run([str(toolchain.zig), "cc", "-target", darwin_toolchain.TARGET, "-c", str(tmp_path / "a.c"),
                    "-o", str(tmp_path / "a.o")], check=True, env=toolchain.env())
    added, unresolved = darwin_toolchain.update_stubs(toolchain, [tmp_path / "a.o"])
    assert added == ["libobjc: _objc_autoreleasePoolPush"] and unresolved == ["_gk_nowhere"]
    assert "_objc_autoreleasePoolPush" in darwin_toolchain.load_stubs()["libobjc"]["symbols"]
    assert darwin_toolchain.update_stubs(toolchain, [tmp_path / "a.o"]) == ([], ["_gk_nowhere"])


def test_a_missing_device_layer_file_is_a_build_error_naming_it(monkeypatch):
    monkeypatch.setattr(darwin, "DEVICE_LAYER", (*darwin.DEVICE_LAYER, "mps_missing_part.cpp"))
    monkeypatch.setattr(darwin_toolchain, "toolchain", lambda *a: pytest.fail("fetched the toolchain first"))
    with pytest.raises(RuntimeError, match="needs the MPS device layer; missing: common/metal/mps/mps_missing_part.cpp"):
        darwin.build_all(["ggml-norm"], ("2.13.0",))


def test_functions_the_extension_resolves_by_name():
    names = darwin.resolved_functions()
    assert {"ggml_init", "ggml_backend_metal_init", "gk_metal_last_error"} <= set(names)
    assert not {"ggml_cpu_init", "ggml_graph_compute"} & set(names)  # the CPU runtime's
    for src in darwin.EXTENSION_BACKEND:  # and what the backend passes to dlsym itself
        assert set(re.findall(r'dlsym\(\s*\w+\s*,\s*"(\w+)"', src.read_text())) <= set(names)


def test_a_runtime_missing_one_of_them_is_refused(tmp_path, monkeypatch):
    exports = {f"_{n}" for n in darwin.resolved_functions()}
    image = macho.MachO(tmp_path / "libggml-kernels-metal.dylib", "arm64", "dylib", exports=exports)
    monkeypatch.setattr(macho, "read", lambda path: image)
    darwin.check_runtime_exports(image.path)
    image.exports = exports - {"_ggml_backend_metal_init"}
    with pytest.raises(macho_check.LinkCheckError, match="does not export ggml_backend_metal_init, which the extension"):
        darwin.check_runtime_exports(image.path)


def test_torch_versions_are_the_matrix():
    matrix = re.search(r"^TORCH = \[(.*?)\]", (REPO / "noxfile.py").read_text(), re.M).group(1)
    assert darwin_toolchain.TORCH_VERSIONS == tuple(re.findall(r'"([^"]+)"', matrix))


@pytest.mark.parametrize(("name", "version"), [("torch213-metal-aarch64-darwin", "2.13.0"),
                                               ("torch215-metal-aarch64-darwin", "2.15.0"), ("torch212-metal-aarch64-darwin", None),
                                               ("torch213-cxx11-cpu-x86_64-linux", None)])
def test_variant_names(tmp_path, name, version):
    if version is None:
        with pytest.raises(ValueError, match="not a torch<XY>-metal-aarch64-darwin variant"):
            macho_check.torch_version_of(tmp_path / name)
    else:
        assert macho_check.torch_version_of(tmp_path / name) == version


def test_the_variant_name_is_read_without_torch():
    """`nox -s build-darwin` has no torch in its environment: the variant name (the integration's rule,
    read from its file) must come without importing it."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from tools.build import darwin\n"
        "print(darwin.variant_name(darwin.darwin_toolchain.TorchMac('2.14.1', None, None)))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch214-metal-aarch64-darwin"


BUILT = sorted(REPO.glob("packages/*/build/torch*-metal-aarch64-darwin"))


@needs_toolchain
@pytest.mark.skipif(not BUILT, reason="no darwin variant built (nox -s build-darwin)")
@pytest.mark.parametrize("variant", BUILT, ids=[f"{v.parent.parent.name}/{v.name}" for v in BUILT])
def test_built_darwin_variants(toolchain, variant):
    meta = json.loads((variant / "metadata.json").read_text())
    assert meta["name"] == variant.parent.parent.name and meta["backend"] == {"type": "metal"}
    assert meta["id"].startswith(f"_{variant.parent.parent.name.replace('-', '_')}_metal_")
    assert (variant / f"{meta['id']}.abi3.so").is_file() and (variant / darwin.LIBRARY).is_file()
    assert not [f.name for f in variant.iterdir() if "emu" in f.name]  # the emulator never goes in
    # the licences of what the binaries contain: ours, ggml's, metal-cpp's (Apache-2.0)
    assert {"LICENSE", "LICENSE.ggml", darwin.METAL_CPP_LICENSE} <= {f.name for f in variant.iterdir()}
    assert "Apache License" in (variant / darwin.METAL_CPP_LICENSE).read_text()
    assert f"from . import {meta['id']}" in (variant / "_ops.py").read_text()
    macho_check.check_variant(variant, macho_check.libraries(toolchain, macho_check.torch_version_of(variant)))

"""What a Hub user gets (tools/publish.py): the variants of build/ with kernels-data's metadata and
without the emulator's instrumentation; the publication's operations (--dry-run); and the repository
written into a Hugging Face cache (--to-cache), loaded offline by kernels.get_kernel(..., version=1)
in a virtualenv that holds only torch and kernels, its ops checked against the references."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tools import publish
from tools.build import mac_checked, metal_runtime
from tools.testing import fresh_venv
from tools.testing.kernel_testing import backend_kwargs, hub_ids, load_kernel, point_hub_ids_at_local_builds

PACKAGES = hub_ids()  # repo id -> package folder
EMULATOR_FILES = ("_metal_emu.py", metal_runtime.LIBRARY)


def variants(folder, darwin: bool = False):
    """A build folder's variants; the darwin ones (`nox -s build-darwin`: published only after a Mac
    check) only when asked for."""
    found = sorted(p for p in folder.glob("torch*") if p.is_dir() and (darwin or not p.name.endswith("-darwin")))
    assert found, f"no build in {folder}: run `nox -s build`"
    return found


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
@pytest.mark.parametrize("build", ["build", "build-metal-emu"])
def test_every_variant_has_kernels_data_metadata(repo_id, build):
    from kernels import Metadata

    pkg = PACKAGES[repo_id]
    for variant in variants(pkg / build, darwin=True):
        meta = json.loads((variant / "metadata.json").read_text())
        assert set(publish.METADATA_FIELDS) <= set(meta), variant
        assert meta["name"] == pkg.name and meta["version"] == 1 and meta["license"] == "MIT"
        backend = "metal" if variant.name.endswith("-darwin") else "cpu"
        assert meta["python-depends"] == [] and meta["backend"] == {"type": backend}, variant
        Metadata.read_from_file(variant / "metadata.json")


@pytest.mark.parametrize("repo_id", sorted(PACKAGES))
def test_instrumentation_only_in_emulated_builds(repo_id):
    pkg = PACKAGES[repo_id]
    for variant in variants(pkg / "build"):
        assert [f for f in EMULATOR_FILES if (variant / f).exists()] == [], variant
        assert "metal_dispatches" not in (variant / "_ggml_runtime.py").read_text()
    for variant in variants(pkg / "build-metal-emu"):
        assert all((variant / f).exists() for f in EMULATOR_FILES), variant


def test_dry_run_lists_the_operations(capsys, monkeypatch):
    monkeypatch.setattr(publish, "upload", lambda rel: pytest.fail("--dry-run uploaded"))
    assert publish.main(["--dry-run", "ggml-norm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    repo = "ggml-org/ggml-norm"
    assert lines[:2] == [f"create repo {repo} (repo_type='kernel', exist_ok=True)",
                         f"create branch v1 of {repo} from main (exist_ok=True)"]
    uploads = [line.split()[1] for line in lines if line.startswith("upload ") and f"-> {repo}@v1" in line]
    for variant in variants(PACKAGES[repo] / "build"):
        assert f"build/{variant.name}/metadata.json" in uploads and f"build/{variant.name}/__init__.py" in uploads
    assert "benchmarks/benchmark_norm.py" in uploads
    assert all(u.startswith(("build/torch", "benchmarks/")) and "__pycache__" not in u for u in uploads)
    assert any(line.startswith("delete, in the same commit, every file under build/ on v1") for line in lines)
    assert lines[-1].startswith("upload README.md") and lines[-1].endswith(f"-> {repo}@main")
    operations = [line for line in lines if not line.startswith("skip ")]
    assert not any("metal-emu" in line or "darwin" in line for line in operations)
    # a darwin variant (nox -s build-darwin) is named as skipped until a Mac has checked it
    for variant in set(variants(PACKAGES[repo] / "build", darwin=True)) - set(variants(PACKAGES[repo] / "build")):
        assert any(line.startswith(f"skip build/{variant.name} (darwin: not checked on a Mac") for line in lines)


def fake_package(root, variant_files: dict[str, list[str]]):
    pkg = root / "packages" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "build.toml").write_text('[general]\nname = "demo"\nversion = 2\n[general.hub]\nrepo-id = "org/demo"\n')
    (pkg / "CARD.md").write_text("# demo\n")
    for variant, files in variant_files.items():
        for f in files:
            (pkg / "build" / variant / f).parent.mkdir(parents=True, exist_ok=True)
            (pkg / "build" / variant / f).write_text("x")
    return pkg


def test_darwin_variants_are_skipped_and_emulated_ones_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "REPO", tmp_path)
    fake_package(tmp_path, {"torch213-cxx11-cpu-x86_64-linux": ["__init__.py", "__pycache__/x.pyc"],
                            "torch213-metal-aarch64-darwin": ["__init__.py"], ".ninja": ["build.ninja"]})
    rel = publish.release("demo")
    assert rel.branch == "v2" and rel.repo_id == "org/demo"
    assert [p for p, _ in rel.files] == ["build/torch213-cxx11-cpu-x86_64-linux/__init__.py"]
    assert rel.skipped == ("torch213-metal-aarch64-darwin (darwin: not checked on a Mac: no "
                           "torch213-metal-aarch64-darwin.mac-checked.json beside it (nothing of a darwin build runs on Linux))",)
    (tmp_path / "packages/demo/build/torch213-cxx11-cpu-x86_64-linux/_metal_emu.py").write_text("")
    with pytest.raises(ValueError, match="holds the Metal emulator"):
        publish.release("demo")


def test_a_darwin_variant_is_published_only_as_a_mac_checked_it(tmp_path, monkeypatch):
    """mac-checked.json beside the variant, saying passed, over its current files (tools/build/mac_checked.py)."""
    monkeypatch.setattr(publish, "REPO", tmp_path)
    pkg = fake_package(tmp_path, {"torch213-cxx11-cpu-x86_64-linux": ["__init__.py"],
                                  "torch213-metal-aarch64-darwin": ["__init__.py", "_demo_metal_1.abi3.so"]})
    darwin = pkg / "build" / "torch213-metal-aarch64-darwin"

    def published():
        rel = publish.release("demo")
        return [v.name for v in rel.variants], [s.split(" (")[0] for s in rel.skipped], rel

    mac_checked.write(darwin, passed=False, details={"macos": "26.1"})
    assert published()[:2] == (["torch213-cxx11-cpu-x86_64-linux"], ["torch213-metal-aarch64-darwin"])
    assert "does not say the Mac check passed" in published()[2].skipped[0]
    mac_checked.write(darwin, passed=True, details={"macos": "26.1"})
    names, skipped, rel = published()
    assert names == ["torch213-cxx11-cpu-x86_64-linux", "torch213-metal-aarch64-darwin"] and skipped == []
    assert "build/torch213-metal-aarch64-darwin/_demo_metal_1.abi3.so" in [p for p, _ in rel.files]
    assert not any(p.endswith(mac_checked.SUFFIX) for p, _ in rel.files)  # the proof stays here
    (darwin / "_demo_metal_1.abi3.so").write_text("rebuilt")  # a build after the check: unchecked again
    assert published()[1] == ["torch213-metal-aarch64-darwin"]
    assert "changed since the Mac check" in published()[2].skipped[0]
    mac_checked.marker(darwin).write_text("{not json")
    assert "not readable JSON" in published()[2].skipped[0]


def test_check_gives_darwin_variants_the_macos_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(publish, "REPO", tmp_path)
    pkg = fake_package(tmp_path, {"torch213-metal-aarch64-darwin": ["__init__.py"]})
    darwin = pkg / "build" / "torch213-metal-aarch64-darwin"
    (darwin / "metadata.json").write_text("{}")
    mac_checked.write(darwin, passed=True, details={})
    checked = []
    monkeypatch.setattr(publish, "check_binaries", lambda v, required: checked.append(("linux", v.name)))
    monkeypatch.setattr(publish, "check_macos_binaries", lambda v: checked.append(("macos", v.name)))
    with pytest.raises(ValueError, match="metadata.json: missing"):
        publish.check(publish.release("demo"))
    assert checked == [("macos", "torch213-metal-aarch64-darwin")]


def test_card_front_matter(tmp_path):
    card = tmp_path / "CARD.md"
    card.write_text("# x\n")
    assert publish.card_text(card) == "---\nlibrary_name: kernels\n---\n\n# x\n"
    card.write_text("---\nlicense: mit\nlibrary_name: other\n---\n# x\n")
    assert publish.card_text(card) == "---\nlibrary_name: kernels\nlicense: mit\n---\n# x\n"
    for pkg in PACKAGES.values():
        assert publish.card_text(pkg / "CARD.md") == (pkg / "CARD.md").read_text()  # already so


def test_to_cache_writes_the_hub_layout(tmp_path):
    """refs/v1 and refs/main name snapshots; a fresh process of this environment, offline and with no
    override pointing at the checkout, loads the package from there."""
    assert publish.main(["--to-cache", str(tmp_path), "ggml-norm"]) == 0
    folder = tmp_path / "kernels--ggml-org--ggml-norm"
    commit = (folder / "refs" / "v1").read_text()
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    snapshot = folder / "snapshots" / commit
    for variant in variants(PACKAGES["ggml-org/ggml-norm"] / "build"):
        meta = snapshot / "build" / variant.name / "metadata.json"
        assert meta.is_symlink() and meta.read_bytes() == (variant / "metadata.json").read_bytes()
    readme = folder / "snapshots" / (folder / "refs" / "main").read_text() / "README.md"
    assert readme.read_text().startswith("---\nlibrary_name: kernels\n")
    # a CUDA build of torch (2.14, 2.15 here) makes kernels want a cu* variant: ours are CPU builds
    code = (f"import json, kernels; k = kernels.get_kernel('ggml-org/ggml-norm', version=1, **{backend_kwargs()!r}); "
            "print('RESULT' + json.dumps(k.__file__))")
    env = fresh_venv.clean_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(snapshot) in proc.stdout


# ---- the round trip: every package from a cache folder, in a virtualenv with only torch and kernels ----

# repo id -> the call made on the downloaded kernel `k` and on the package's reference in this process
# (`k` is then the reference module), with the inputs `i`; and the tolerance, of the output's scale
# (the package tests' float32 bounds; Q8_0's dequantization is exact).
ROUND_TRIP = {
    "ggml-org/ggml-norm": ("k.rms_norm(i['x'], i['w'], eps=1e-6)", 1e-5),
    "ggml-org/ggml-quantization": ("k.dequantize(i['blocks'], 'Q8_0', 16, 256)", 0.0),
    "ggml-org/ggml-attn": ("k.flash_attn(i['q'], i['k'], i['v'], causal=True)", 2e-5),
    "ggml-org/ggml-gated-delta-net": ("k.gated_delta_net(i['q'], i['k'], i['v'], i['g'], i['beta'])", 2e-5),
    "transformers-community/topk": ("k.softmax_top_k(i['logits'], 4)", 1e-6),
}


def round_trip_inputs(repo_id: str, ref) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    if repo_id.endswith("ggml-norm"):
        return {"x": randn(3, 5, 64), "w": randn(64)}
    if repo_id.endswith("ggml-quantization"):
        return {"blocks": ref.quantize_reference(randn(16, 256), "Q8_0")}
    if repo_id.endswith("ggml-attn"):
        return {"q": randn(1, 4, 7, 64), "k": randn(1, 2, 9, 64), "v": randn(1, 2, 9, 64)}
    if repo_id.endswith("ggml-gated-delta-net"):
        q, k = randn(1, 6, 2, 32) / 32**0.5, torch.nn.functional.normalize(randn(1, 6, 2, 32), dim=-1)
        return {"q": q, "k": k, "v": randn(1, 6, 4, 32), "g": -torch.rand(1, 6, 4, generator=gen) * 0.5,
                "beta": torch.rand(1, 6, 4, generator=gen)}
    return {"logits": randn(9, 16)}


VENV_SCRIPT = """
import sys, torch, kernels
calls, folder = {calls!r}, sys.argv[1]
for n, (repo_id, call) in enumerate(calls.items()):
    k = kernels.get_kernel(repo_id, version=1, **({{"backend": "cpu"}} if torch.version.cuda else {{}}))
    i = torch.load(f"{{folder}}/in{{n}}.pt")
    torch.save(eval(call), f"{{folder}}/out{{n}}.pt")
    print(repo_id, k.__file__)
"""


def assert_matches(out, ref, tol: float, what: str) -> None:
    outs, refs = (list(x) if isinstance(x, (tuple, list)) else [x] for x in (out, ref))
    assert len(outs) == len(refs), what
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape, what
        if not r.is_floating_point():
            assert torch.equal(o, r.to(o.dtype)), what
            continue
        scale = r.double().abs().max().item() or 1.0
        err = (o.double() - r.double()).abs().max().item()
        assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} of the scale {scale:.3e}"


@pytest.mark.slow
def test_round_trip_from_a_cache_folder_in_a_fresh_virtualenv(tmp_path):
    """`python -m tools.publish --to-cache DIR` for every package; then, in a virtualenv holding only
    torch and kernels, HF_HUB_OFFLINE=1 HF_HUB_CACHE=DIR kernels.get_kernel(<repo id>, version=1) (no
    trust_remote_code: kernels skips the publisher check offline) and one op of each package, against
    its reference computed here."""
    python = fresh_venv.python()
    cache = tmp_path / "hub"
    assert publish.main(["--to-cache", str(cache)]) == 0
    point_hub_ids_at_local_builds()
    refs = {repo_id: load_kernel(repo_id).reference for repo_id in ROUND_TRIP}
    inputs = {repo_id: round_trip_inputs(repo_id, refs[repo_id]) for repo_id in ROUND_TRIP}
    for n, repo_id in enumerate(ROUND_TRIP):
        torch.save(inputs[repo_id], tmp_path / f"in{n}.pt")
    script = textwrap.dedent(VENV_SCRIPT.format(calls={r: call for r, (call, _) in ROUND_TRIP.items()}))
    env = fresh_venv.clean_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    proc = subprocess.run([str(python), "-c", script, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    for n, (repo_id, (call, tol)) in enumerate(ROUND_TRIP.items()):
        assert loaded[repo_id].startswith(str(cache)), loaded[repo_id]
        out = torch.load(tmp_path / f"out{n}.pt")
        ref = eval(call, {"k": refs[repo_id], "i": inputs[repo_id]})
        assert_matches(out, ref, tol, repo_id)

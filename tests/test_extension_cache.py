"""tools/build/extension_cache.py: a package's extension is reused across checkouts and virtualenvs
with the same recipe, and rebuilt when anything in it changes."""

from __future__ import annotations

import pytest

from tools.build import extension_cache, ninja_build


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A fake checkout (one package with a source, common/ with a header) and an empty cache."""
    repo = tmp_path / "repo"
    (repo / "packages" / "pkg" / "src").mkdir(parents=True)
    (repo / "common").mkdir()
    (repo / "packages" / "pkg" / "src" / "op.cpp").write_text("int op() { return 1; }\n")
    (repo / "common" / "glue.h").write_text("#pragma once\n")
    monkeypatch.setattr(extension_cache, "REPO", repo)
    monkeypatch.setenv("GGML_KERNELS_CACHE", str(tmp_path / "cache"))
    return repo


def recipe(repo, flags="-O2"):
    n = ninja_build.NinjaFile()
    n.rule("cxx", "g++ $flags -c $in -o $out", "CXX $out")
    n.build(repo / "out" / "op.o", "cxx", repo / "packages" / "pkg" / "src" / "op.cpp", variables={"flags": flags})
    return n


def test_the_key_names_no_path_of_the_checkout(checkout, tmp_path, monkeypatch):
    key = extension_cache.recipe_key(recipe(checkout), checkout / "packages" / "pkg")
    clone = tmp_path / "clone"
    checkout.rename(clone)
    monkeypatch.setattr(extension_cache, "REPO", clone)
    assert extension_cache.recipe_key(recipe(clone), clone / "packages" / "pkg") == key


@pytest.mark.parametrize("change", ["flags", "source", "common header", "new header"])
def test_the_key_changes_with_the_recipe(checkout, change):
    pkg = checkout / "packages" / "pkg"
    key = extension_cache.recipe_key(recipe(checkout), pkg)
    flags = "-O3" if change == "flags" else "-O2"
    if change == "source":
        (pkg / "src" / "op.cpp").write_text("int op() { return 2; }\n")
    elif change == "common header":
        (checkout / "common" / "glue.h").write_text("#pragma once\n#define X 1\n")
    elif change == "new header":
        (pkg / "src" / "extra.h").write_text("#pragma once\n")
    assert extension_cache.recipe_key(recipe(checkout, flags), pkg) != key


def test_a_hit_copies_the_library_without_running_ninja(checkout, monkeypatch):
    pkg = checkout / "packages" / "pkg"
    work = pkg / "build" / ".ninja" / "torch213-cxx11-cpu-x86_64-linux"
    work.mkdir(parents=True)
    so = work / "_pkg_cpu_abc1234.abi3.so"
    built = []

    def fake_ninja(folder, jobs):
        built.append(folder)
        so.write_bytes(b"library")

    monkeypatch.setattr(ninja_build, "run", fake_ninja)
    extension_cache.build(so, work, recipe(checkout), pkg, None)
    assert built == [work]
    so.unlink()
    extension_cache.build(so, work, recipe(checkout), pkg, None)
    assert built == [work] and so.read_bytes() == b"library"


def test_only_the_newest_libraries_of_a_kind_are_kept(checkout, monkeypatch):
    pkg = checkout / "packages" / "pkg"
    work = pkg / "build" / ".ninja" / "torch213-cxx11-cpu-x86_64-linux"
    work.mkdir(parents=True)
    monkeypatch.setattr(ninja_build, "run", lambda folder, jobs: None)
    other_kind = extension_cache.cache_dir(work.name) / "_pkg_metal_emu_0000000-key.so"
    other_kind.parent.mkdir(parents=True)
    other_kind.write_bytes(b"other")
    for i in range(extension_cache.KEEP + 2):
        so = work / "_pkg_cpu_abc1234.abi3.so"
        so.write_bytes(b"v%d" % i)
        extension_cache.build(so, work, recipe(checkout, f"-DV={i}"), pkg, None)
    kept = sorted(p.name for p in extension_cache.cache_dir(work.name).glob("_pkg_cpu_*.so"))
    assert len(kept) == extension_cache.KEEP and other_kind.exists()

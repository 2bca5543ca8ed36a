"""tools/build/extension_cache.py: a package's extension is reused across checkouts and virtualenvs
with the same recipe, and rebuilt when anything it is made of changes."""

from __future__ import annotations

import pytest

from tools.build import extension_cache, ninja_build

VARIANT = "torch213-cxx11-cpu-x86_64-linux"


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A fake checkout (a package source including a header of common/) and an empty cache."""
    repo = tmp_path / "repo"
    (repo / "packages" / "pkg" / "src").mkdir(parents=True)
    (repo / "common").mkdir()
    (repo / "packages" / "pkg" / "src" / "op.cpp").write_text('#include "glue.h"\nint op() { return GLUE; }\n')
    (repo / "common" / "glue.h").write_text("#pragma once\n#define GLUE 1\n")
    (repo / "common" / "other.h").write_text("#pragma once\n")
    monkeypatch.setattr(extension_cache, "REPO", repo)
    monkeypatch.setenv("GGML_KERNELS_CACHE", str(tmp_path / "cache"))
    return repo


def source(repo):
    return repo / "packages" / "pkg" / "src" / "op.cpp"


def recipe(repo, flags="-O2"):
    """A real one: compiles op.cpp into a shared library, recording its headers."""
    work = repo / "packages" / "pkg" / "build" / ".ninja" / VARIANT
    n = ninja_build.NinjaFile()
    n.rule("cxx", "g++ -MMD -MF $out.d $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("link", "g++ -shared -o $out $in", "LINK $out")
    n.build(work / "op.o", "cxx", source(repo), variables={"flags": f"{flags} -fPIC -I{repo / 'common'}"})
    n.build(work / "_pkg_cpu_abc1234.abi3.so", "link", work / "op.o")
    n.write(work / "build.ninja")
    return n, work, work / "_pkg_cpu_abc1234.abi3.so"


def test_the_key_names_no_path_of_the_checkout(checkout, tmp_path, monkeypatch):
    key = extension_cache.recipe_key(recipe(checkout)[0], [source(checkout)], extension_cache.running_torch())
    clone = tmp_path / "clone"
    checkout.rename(clone)
    monkeypatch.setattr(extension_cache, "REPO", clone)
    assert extension_cache.recipe_key(recipe(clone)[0], [source(clone)], extension_cache.running_torch()) == key


def test_the_headers_read_are_those_of_the_checkout(checkout):
    n, work, so = recipe(checkout)
    ninja_build.run(work)
    assert extension_cache.checkout_headers(work, [source(checkout)], extension_cache.running_torch()) == ["common/glue.h"]


def build_counting(checkout, monkeypatch, flags="-O2"):
    """Builds through the cache; returns whether ninja ran."""
    ran = []
    real = ninja_build.run
    monkeypatch.setattr(ninja_build, "run", lambda work, jobs=None: (ran.append(work), real(work, jobs)))
    n, work, so = recipe(checkout, flags)
    if so.exists():
        so.unlink()
    extension_cache.build(so, work, n, [source(checkout)], None)
    assert so.exists()
    return bool(ran)


@pytest.mark.parametrize("change, rebuilt", [("nothing", False), ("flags", True), ("source", True),
                                             ("included header", True), ("header not included", False)])
def test_a_build_is_reused_until_what_it_is_made_of_changes(checkout, monkeypatch, change, rebuilt):
    assert build_counting(checkout, monkeypatch)
    flags = "-O1" if change == "flags" else "-O2"
    if change == "source":
        source(checkout).write_text('#include "glue.h"\nint op() { return GLUE + 1; }\n')
    elif change == "included header":
        (checkout / "common" / "glue.h").write_text("#pragma once\n#define GLUE 2\n")
    elif change == "header not included":
        (checkout / "common" / "other.h").write_text("#pragma once\n#define OTHER 1\n")
    assert build_counting(checkout, monkeypatch, flags) == rebuilt


def test_only_the_newest_libraries_of_a_kind_are_kept(checkout, monkeypatch):
    other_kind = extension_cache.cache_dir(VARIANT) / "_pkg_metal_emu-0-0.so"
    other_kind.parent.mkdir(parents=True)
    other_kind.write_bytes(b"other")
    for i in range(extension_cache.KEEP + 2):
        build_counting(checkout, monkeypatch, f"-DV={i}")
    kept = list(extension_cache.cache_dir(VARIANT).glob("_pkg_cpu-*.so"))
    assert len(kept) == extension_cache.KEEP and other_kind.exists()

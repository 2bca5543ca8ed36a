"""Build, test and benchmark every package against every torch in the matrix.

    nox -s build                      # every package for every torch
    nox -s build-darwin               # every package's macOS Metal variant, cross-built and link-checked
    nox -s tests                      # the test matrix: every test once, the fast tier on every torch
    nox -s "tests(torch='2.13.0')" -- packages/ggml-quantization   # one cell (see MATRIX)
    nox -s tests --install-only       # install and build every cell, run no test (.ci/run, first)
    nox -s lint                       # ruff and clang-format, checking only (-- --fix rewrites the files)
    nox -s sanitize                   # the fast tier on AddressSanitizer + UBSan builds (-- pytest args)
    nox -s bench                      # per-kernel benchmark tables (-- --quick for a short run)
    nox -s bench -- --check           # ours against ggml's own op: non-zero below 0.95x on a product or norm
    nox -s demo                       # the main job (README)
    nox -s bench-e2e                  # whole models: ours vs transformers vs llama.cpp (-- --quick)
    nox -s upstream-ops               # llama.cpp's test-backend-ops on the emulated Metal device and the MPS twin
    nox -s mac                        # on an Apple-silicon Mac (macOS 26): what only a Mac can check (tools/mac.py)

Virtualenvs are reused between runs; the ggml runtime and the llama.cpp oracle wheel are cached in
~/.cache/ggml-kernels (GGML_KERNELS_CACHE), so nothing already built is built again.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

import nox

REPO = Path(__file__).resolve().parent

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"


def _project(pyproject: str) -> dict:
    with open(REPO / pyproject, "rb") as f:
        return tomllib.load(f)["project"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]


# Each dependency is stated once: what the integration needs to run (transformers, kernels, gguf, ...,
# pinned) in integration/pyproject.toml, what building and testing need beside it in pyproject.toml.
INTEGRATION_DEPS = _project("integration/pyproject.toml")["dependencies"]
EXTRAS = _project("pyproject.toml")["optional-dependencies"]
TORCH = ["2.13.0", "2.14.1", "2.15.0"]
SUPPORTED_TRANSFORMERS = next(d for d in INTEGRATION_DEPS if _name(d) == "transformers").split("==")[1]
TRANSFORMERS = [SUPPORTED_TRANSFORMERS, "5.23.0"]  # supported, and the newest on the index
BUILD_DEPS = EXTRAS["build"]
# torch and transformers: each session pins its own
TEST_DEPS = EXTRAS["test"] + [d for d in INTEGRATION_DEPS if _name(d) not in ("torch", "transformers")]
# llama-cpp-python's own runtime needs (installed without its heavier optional extras).
LLAMA_CPP_DEPS = ["numpy", "typing-extensions", "diskcache", "jinja2"]


def _env(session: nox.Session) -> dict:
    cache = os.environ.get("GGML_KERNELS_CACHE", str(Path.home() / ".cache" / "ggml-kernels"))
    return {"GGML_KERNELS_CACHE": cache, "PYTHONUNBUFFERED": "1"}


def _install(session: nox.Session, torch: str, *extra: str) -> None:
    # PIP_CONSTRAINT: some machines cap pip at the torch releases they hold on disk (a pip.conf
    # constraint file); an explicit pin here must win over that cap
    session.install(f"torch=={torch}", *BUILD_DEPS, *extra, env={"PIP_CONSTRAINT": os.devnull})


def _build(session: nox.Session) -> None:
    """An install step (run_install): `nox --install-only` builds too."""
    session.run_install("python", "-m", "tools.build", env=_env(session))


def _install_llama_cpp(session: nox.Session) -> None:
    """The independent oracle: llama.cpp b11312 via llama-cpp-python, built once and cached."""
    wheel = session.run_install("python", "-m", "tools.build.llama_cpp_wheel", silent=True, env=_env(session))
    if wheel is None:  # `nox -R` on an installed virtualenv runs no install step
        return
    wheel = wheel.strip().splitlines()[-1]
    session.install("--no-deps", wheel)
    session.install(*LLAMA_CPP_DEPS)


def _install_integration(session: nox.Session) -> None:
    """integration/ (ggml_kernels_integration), editable: it finds the builds in this checkout."""
    session.install("--no-deps", "-e", "integration")


@nox.session
@nox.parametrize("torch", TORCH)
def build(session: nox.Session, torch: str) -> None:
    """Build every package for this torch (incremental: seconds when nothing changed)."""
    _install(session, torch)
    _build(session)


# The test matrix: (torch, transformers, tier). The slow tier (tests marked `slow`: fresh processes,
# whole models, the bench tools) runs on the first cell only; every torch runs the fast tier, which
# holds every kernel and ABI test; the newest transformers runs the tests that touch transformers.
MATRIX = [
    ("2.13.0", "5.22.2", "all"),
    ("2.14.1", "5.22.2", "fast"),
    ("2.15.0", "5.22.2", "fast"),
    ("2.13.0", "5.23.0", "transformers"),
]
TIERS = {
    "all": [],
    "fast": ["-m", "not slow"],
    # the integration (enable(), the GGUF loader, the CLI) without the emulated-Metal whole models,
    # which add minutes and no transformers code that the CPU runs do not reach
    "transformers": ["integration/tests", "--ignore=integration/tests/test_integration_metal.py", "tests/test_gguf_models.py"],
}
SLOW_TIER_TORCH = MATRIX[0][0]


def _cell_id(torch: str, transformers: str, tier: str) -> str:
    """`torch='2.13.0'`, with the transformers version where it is not the supported one."""
    return f"torch={torch!r}" + (f", transformers={transformers!r}" if transformers != TRANSFORMERS[0] else "")
SHARED_MODELS = "from tools.models import make_gguf, smollm2; make_gguf.generate('tiny'); smollm2.gguf_path()"


@nox.session
@nox.parametrize(("torch", "transformers", "tier"), MATRIX, ids=[_cell_id(*cell) for cell in MATRIX])
def tests(session: nox.Session, torch: str, transformers: str, tier: str) -> None:
    """Build, then run this cell's tests (or the paths given after --): see MATRIX and TIERS."""
    _install(session, torch, *TEST_DEPS, f"transformers=={transformers}")
    _install_llama_cpp(session)
    _install_integration(session)
    _build(session)
    # the model files the tests share, made before any test runs (.ci/run runs the cells side by side)
    session.run_install("python", "-c", SHARED_MODELS, env=_env(session))
    selection = [] if session.posargs and tier == "transformers" else TIERS[tier]
    session.run("python", "-m", "pytest", "--durations=10", *selection, *session.posargs, env=_env(session))


@nox.session
def sanitize(session: nox.Session) -> None:
    """The fast tier on AddressSanitizer + UBSan builds of our C++ and ggml's CPU backend, made in a
    copy of this checkout (.nox/sanitize-tree) so they never replace the ordinary builds
    (tools/build/sanitize.py; needs gcc's libasan). Arguments after -- go to pytest instead."""
    _install(session, TORCH[0], *TEST_DEPS, f"transformers=={TRANSFORMERS[0]}")
    _install_llama_cpp(session)
    session.run("python", "-m", "tools.build.sanitize", *session.posargs, env=_env(session))


@nox.session(name="build-darwin")
def build_darwin(session: nox.Session) -> None:
    """Cross-build every package's Metal variant for macOS arm64, packages/<name>/build/
    torch<XY>-metal-aarch64-darwin/ for every torch of TORCH, and link-check it (tools/build/darwin.py;
    zig, the macOS torch wheels and metal-cpp come from the package index into the cache). Nothing of
    it runs here: `nox -s publish` uploads a darwin variant only once a Mac has passed it.
    -- [PACKAGE ...] [--torch X.Y.Z] [--update-stubs]"""
    session.install(*BUILD_DEPS)
    session.run("python", "-m", "tools.build.darwin", *session.posargs, env=_env(session))


@nox.session
def publish(session: nox.Session) -> None:
    """Check the packages' build/ variants (kernel-abi-check, metadata) and upload them to the Hub
    (tools/publish.py; run `nox -s build` first): -- [PACKAGE ...] [--dry-run | --to-cache DIR]."""
    session.install(*BUILD_DEPS, *[d for d in TEST_DEPS if d.startswith("kernels==")])
    session.run("python", "-m", "tools.publish", *session.posargs, env=_env(session))


LINT_DEPS = ["ruff==0.17.6", "clang-format==23.1.5"]


def _cxx_sources() -> list[str]:
    """Our C/C++ sources (ggml's own are fetched into the cache, never here)."""
    found = [p for pattern in ("common/*", "common/*/*", "common/*/*/*", "packages/*/*/*") for p in REPO.glob(pattern)]
    return sorted(str(p.relative_to(REPO)) for p in found if p.suffix in (".c", ".cpp", ".h") and "build" not in p.parts)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the Python (pyproject.toml's [tool.ruff]), clang-format over the C/C++
    (.clang-format), both checking only; `-- --fix` rewrites the files instead."""
    session.install(*LINT_DEPS)
    fix = "--fix" in session.posargs
    checks = {
        "ruff": ["ruff", "check", *(["--fix"] if fix else []), "."],
        "clang-format": ["clang-format", "-i" if fix else "--dry-run", "--Werror", *_cxx_sources()],
    }
    failed = []
    for name, command in checks.items():  # each runs, whatever the other found
        try:
            session.run(*command)
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"{' and '.join(failed)} found problems (above)")


def _install_model_runs(session: nox.Session, *extra: str) -> None:
    """For whole-model runs: torch + the test dependencies, llama.cpp, every package built, and
    ggml_kernels_integration. torch 2.13.0, the one torch on the index with a CPU-only wheel
    (2.13.0+cpu): 2.14.1 and 2.15.0 come as CUDA builds, whose import alone adds ~300 MiB of resident
    memory to every process (527 against 219 MiB after `import torch`), which the memory columns
    would carry. The compiled row exports and stores its step and prompt packages in the first demo
    (not timed) and loads them in later ones."""
    _install(session, TORCH[0], *TEST_DEPS, f"transformers=={TRANSFORMERS[0]}", *extra)
    _install_llama_cpp(session)
    _install_integration(session)
    _build(session)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: GGUF models in transformers on our kernels, vs transformers alone and llama.cpp."""
    _install_model_runs(session)
    session.run("python", "-m", "tools.bench.demo", *session.posargs, env=_env(session))


@nox.session(name="bench-e2e")
def bench_e2e(session: nox.Session) -> None:
    """Whole models on every backend (ours, transformers f32/bf16, llama.cpp): bench-results/e2e.*"""
    _install_model_runs(session, "matplotlib")
    session.run("python", "-m", "tools.bench.bench_e2e", *session.posargs, env=_env(session))


@nox.session
def bench(session: nox.Session) -> None:
    """Every package's benchmarks/ under kernels' own runner (`kernels benchmark <package folder>`): ours
    against ggml's own op, transformers and the reference, checked against the reference as they run.
    Writes bench-results/<package>.json (the runner's) and .md (tools/bench/kernels_table.py).
    Then ours against ggml's own op, same process, alternating rounds (tools/bench/versus_ggml.py):
    bench-results/versus-ggml.md. Also bench-results/metal-emu.md: ops on the emulated Metal device
    (tools/bench/metal_emu.py).
    -- --quick: fewer workloads and calls; -- <package> ... (or metal-emu): only those; -- --threads N;
    -- --only REGEX: the ours-vs-ggml rounds' workloads whose `<Op>.<workload>` it matches;
    -- --controls: those rounds also time each side against a second instance of itself (A/A).
    -- --check: only the ours-vs-ggml rounds, exiting non-zero where a product (ggml-quantization) or
    norm (ggml-norm) workload is below 0.95x ggml on this machine (a verdict to run on a new CPU)."""
    _install(session, TORCH[0], *TEST_DEPS, f"transformers=={TRANSFORMERS[0]}")
    _install_llama_cpp(session)
    _build(session)
    quick, check = "--quick" in session.posargs, "--check" in session.posargs
    options = [a for a in session.posargs if a in ("--quick", "--check", "--controls")]
    wanted = [a for a in session.posargs if a not in options]
    for flag in ("--threads", "--only"):  # the ours-vs-ggml rounds' options with a value
        if flag in wanted:
            at = wanted.index(flag)
            options += wanted[at:at + 2]
            del wanted[at:at + 2]
    packages = [p.parent.name for p in sorted((REPO / "packages").glob("*/benchmarks"))]
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    # PYTHONPATH: the scripts find the llama.cpp ggml oracle for their ggml columns in tools/testing
    env = {**_env(session), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    calls = ["--iterations", "5", "--warmup", "2"] if quick else []
    if quick:
        env["GGML_KERNELS_BENCH_QUICK"] = "1"
    versus = ["python", "-m", "tools.bench.versus_ggml", *options, *[p for p in wanted if p != "metal-emu"],
              "--output", str(out / "versus-ggml.md")]
    if check:  # the verdict alone: session.run fails the session on its non-zero exit
        session.run(*versus, "--command", "nox -s bench -- " + " ".join(session.posargs), env=env)
        return
    if not wanted or "metal-emu" in wanted:  # the emulated Metal device's ops (tools/bench/metal_emu.py)
        table = session.run("python", "-m", "tools.bench.metal_emu", *(["--calls", "2"] if quick else []),
                            silent=True, env=env)
        (out / "metal-emu.md").write_text(table)
        print(table)
    for package in [p for p in (wanted or packages) if p != "metal-emu"]:
        result = out / f"{package}.json"
        command = ["kernels", "benchmark", f"./packages/{package}", *calls]
        session.run(*command, "--output", str(result), env=env)
        table = session.run("python", "-m", "tools.bench.kernels_table", str(result), "--command", " ".join(command),
                            silent=True, env=env)
        (out / f"{package}.md").write_text(table)
        print(table)
    if [p for p in (wanted or packages) if p != "metal-emu"]:
        session.run(*versus, "--command", "nox -s bench -- " + " ".join(session.posargs), env=env)


@nox.session(name="upstream-ops")
def upstream_ops(session: nox.Session) -> None:
    """llama.cpp's own op suite, test-backend-ops from the pinned sources, on the emulated Metal device
    and on the MPS twin (tools/build/upstream_ops.py, docs/metal.md): the CI filter set, a summary per
    op and one verdict line per device, failing on any failure. -- --full: every case (hours);
    -- -o OPS -p REGEX: a selection; --device metal-emu|mps-emu: one device library."""
    _install(session, TORCH[0])
    session.run("python", "-m", "tools.build.upstream_ops", *session.posargs, env=_env(session))


def _take_option(args: list[str], option: str, default: str) -> tuple[str, list[str]]:
    """(the value of `option VALUE` in args or default, the other args)."""
    if option not in args:
        return default, args
    at = args.index(option)
    if at + 1 == len(args):
        raise ValueError(f"{option} needs a value")
    return args[at + 1], args[:at] + args[at + 2:]


ON_A_MAC = sys.platform == "darwin"


@nox.session(venv_backend="venv" if ON_A_MAC else "none")
def mac(session: nox.Session) -> None:
    """On an Apple-silicon Mac with macOS 26: builds every package's darwin variant natively, runs
    the package tests on MPS tensors, enable() on "mps" with the tiny Qwen3.5 GGUF and a per-kernel
    timing table, and on success writes each variant's mac-checked.json (tools/mac.py; not run on a
    Mac yet). Elsewhere it refuses at once, with no virtualenv made.
    -- [PACKAGE ...] [--torch X.Y.Z] [--prebuilt] [--skip-tests] [--skip-model] [--model GGUF] [--calls N]"""
    if not ON_A_MAC:  # tools.mac says why, in one line, and exits non-zero
        session.run(sys.executable, "-m", "tools.mac", external=True)
        return
    try:
        torch, args = _take_option(session.posargs, "--torch", TORCH[0])
    except ValueError as e:
        session.error(str(e))
    if torch not in TORCH:
        session.error(f"--torch {torch}: one of {', '.join(TORCH)}")
    _install(session, torch, *TEST_DEPS, f"transformers=={TRANSFORMERS[0]}")
    _install_integration(session)
    session.run("python", "-m", "tools.mac", *args, env=_env(session))

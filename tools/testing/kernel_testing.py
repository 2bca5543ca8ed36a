"""Helpers for tests: load our builds through `kernels.get_kernel(<hub id>)`, as transformers does,
with LOCAL_KERNELS pointing each Hub id at packages/<name> (kernels then looks in build/)."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import sys
import tomllib
from pathlib import Path

from tools import REPO
from tools.build import ggml_runtime


def hub_ids() -> dict[str, Path]:
    """Hub repo id -> package folder, from each package's build.toml."""
    out = {}
    for toml in sorted((REPO / "packages").glob("*/build.toml")):
        with open(toml, "rb") as f:
            out[tomllib.load(f)["general"]["hub"]["repo-id"]] = toml.parent
    return out


def local_kernels_env() -> str:
    return ":".join(f"{repo}={path}" for repo, path in hub_ids().items())


def point_hub_ids_at_local_builds() -> None:
    os.environ["LOCAL_KERNELS"] = local_kernels_env()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@functools.cache
def integration_locate():
    """The integration's `locate` module, read from this checkout's file (tests need not install the
    integration for it): the one source of the rule below and of the CPU variant name for users."""
    path = REPO / "integration" / "ggml_kernels_integration" / "locate.py"
    spec = importlib.util.spec_from_file_location("_ggml_kernels_integration_locate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


def backend_kwargs() -> dict:
    """Our builds are CPU builds; on a CUDA build of torch, kernels must be told to take them (the
    integration's rule, `locate.backend_kwargs`)."""
    return integration_locate().backend_kwargs()


def load_kernel(repo_id: str):
    import kernels
    import pytest

    if (sys.platform, platform.machine()) != ("linux", "x86_64"):  # on a Mac, tests compare with the references
        pytest.skip("no CPU build on this machine: the CPU builds are x86-64 Linux only")
    path = hub_ids()[repo_id]
    if not any((path / "build").glob("torch*-cpu-*")):
        raise RuntimeError(f"{repo_id} is not built: run `nox -s build` or `python -m tools.build {path.name}`")
    return kernels.get_kernel(repo_id, version=1, **backend_kwargs())


def variant_dir(package: str) -> Path:
    """packages/<package>/build/<variant> for the running torch: what LocalLayerRepository must be
    given. A package folder makes kernels pick the variant by torch's backend, which on a CUDA build
    of torch is a cu* variant we do not build (and kernelize's repositories take no backend)."""

    from tools.build.build import torch_variant

    path = REPO / "packages" / package / "build" / torch_variant()
    if not (path / "metadata.json").exists():
        raise RuntimeError(f"{package} is not built for this torch: run `python -m tools.build {package}`")
    return path


CPU_LEVELS = tuple(ggml_runtime.CPU_LEVELS)  # x64 (baseline), haswell, skylakex, zen4


def cpu_has_level(level: str) -> bool:
    """Whether this CPU can run the ggml runtime built for `level` (tools/build/ggml_runtime.py)."""
    if level == "x64":
        return True
    with open("/proc/cpuinfo") as f:
        return ggml_runtime.CPUINFO_FLAG[level] in f.read()


def fresh_process(code: str, env: dict | None = None):
    """Runs Python `code` in a new interpreter with this environment (+ env, offline Hub), the
    repository root on its path (so it can `from tools.testing.kernel_testing import load_kernel`)."""
    import subprocess
    import sys

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=path, **(env or {}))
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=600)


RESULT_MARK = "RESULT"


def fresh_result(code: str, env: dict | None = None) -> dict:
    """`fresh_process(code, env)`, which must exit 0 and print one line `RESULT<json>`: that JSON."""
    import json

    proc = fresh_process(code, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)), None)
    assert line is not None, f"no {RESULT_MARK} line in the output: {proc.stdout[-2000:]}"
    return json.loads(line[len(RESULT_MARK):])


def run_fresh(repo_id: str, body: str, *, via: str = "get_kernel", level: str | None = None) -> dict:
    """Loads `repo_id`'s build in a new interpreter as `k` the way users do, runs `body` (which sets
    `res` to something JSON can hold) and returns `res`.

    via: "get_kernel" (kernels.get_kernel with LOCAL_KERNELS) or "get_local_kernel" (the package
    folder). level: force a ggml CPU level (GGML_KERNELS_CPU_VARIANT); pytest skips a level this CPU
    lacks or this build does not carry (GGML_KERNELS_CPU_VARIANTS, the sanitized build)."""
    import json
    import textwrap

    import pytest

    if level is not None and not cpu_has_level(level):
        pytest.skip(f"this CPU has no {ggml_runtime.CPUINFO_FLAG[level]}")
    path = hub_ids()[repo_id]
    if level is not None and not (variant_dir(path.name) / f"{ggml_runtime.LIB_PREFIX}{level}.so").exists():
        pytest.skip(f"this build carries no {level} runtime (GGML_KERNELS_CPU_VARIANTS)")
    load = {
        "get_kernel": f"k = kernels.get_kernel({repo_id!r}, version=1, **{backend_kwargs()!r})",
        "get_local_kernel": f"k = kernels.get_local_kernel(Path({str(path)!r}), **{backend_kwargs()!r})",
    }[via]
    code = "\n".join(["import json", "from pathlib import Path", "import kernels", load,
                      textwrap.dedent(body), 'print("RESULT" + json.dumps(res))'])
    env = {"LOCAL_KERNELS": local_kernels_env()} if via == "get_kernel" else {}
    if level is not None:
        env["GGML_KERNELS_CPU_VARIANT"] = level
    proc = fresh_process(code, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(row for row in proc.stdout.splitlines() if row.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def on_meta(x):
    """x as a meta tensor with its strides (`.to("meta")` makes a strided tensor contiguous), a list
    of tensors as a list of those (a Tensor[] argument); anything else as it is."""
    import torch

    if isinstance(x, list):
        return [on_meta(t) for t in x]
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def assert_fake_refuses_as_cpu(fn, *args) -> None:
    """fn(*args) on CPU tensors raises, and on the same arguments as meta tensors (the op's fake
    implementation) raises the same exception type with the same first line of message."""

    def refusal(call_args):
        try:
            fn(*call_args)
        except (TypeError, ValueError, IndexError, RuntimeError) as e:
            return type(e), str(e).splitlines()[0]
        return None

    cpu, meta = refusal(args), refusal([on_meta(a) for a in args])
    assert cpu is not None, "the CPU op accepted it"
    assert meta == cpu

"""What only a Mac can check, run on one: `nox -s mac` (an Apple-silicon Mac with macOS 26 or later).

**Not run on a Mac yet** (none has been available): every step below is written and what can run
on Linux is tested (tests/test_mac_session.py); the steps themselves wait for a Mac.

    python -m tools.mac [PACKAGE ...] [--prebuilt] [--skip-tests] [--skip-model] [--calls N] [-j N]

For the running torch (the session's virtualenv: torch's macOS wheel):
1. build: every package's darwin variant, packages/<name>/build/torch<XY>-metal-aarch64-darwin/,
   natively with Apple clang, the SDK's Metal framework and this torch (tools/build/darwin_native.py);
   `--prebuilt` checks the variants already there instead (cross-built on Linux by
   `nox -s build-darwin` and copied over: whether dyld loads what Linux built);
2. tests: each package's tests with the "mps" build kind (GGML_KERNELS_TEST_BUILDS=mps,
   tools/testing/mps_builds.py): its ops on MPS tensors against the references;
3. model: `enable(backend="mps")` with the tiny Qwen3.5 GGUF (tools/models/make_gguf.py) on the
   "mps" device: logits against transformers alone in float32 on the CPU, 16 greedy tokens;
4. timing: a per-kernel table, median ms per call of the packages' ops on MPS tensors
   (tools/bench/metal_emu.py's workloads);
5. on success of every step run: `<variant>.mac-checked.json` beside each variant checked
   (tools/build/mac_checked.py), what `nox -s publish` asks for before uploading a darwin variant.
   A failure writes the marker with passed false.

Elsewhere it refuses at once, in one line, with exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tools import REPO
from tools.build import darwin_native, mac_checked

TINY_MODEL = ("qwen35-tiny", "Q4_K_M")  # tools/models/make_gguf.py's config and mix
# Metal against float32 transformers: integration/tests/test_integration_metal.py's bound for this
# model on the emulated device (mean KL over the positions), and the share of positions with the
# same top-1; a real GPU runs the same kernels, whose float32 / half arithmetic it must match
MAX_MEAN_KL = 0.012
MIN_TOP1 = 0.9
GREEDY_TOKENS = 16
MPS_TESTS = "mps and not emu"  # pytest -k: tests whose build-kind id is "mps"


@dataclass
class Step:
    name: str
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class Report:
    steps: list[Step] = field(default_factory=list)
    timings: list[tuple[str, str, float]] = field(default_factory=list)  # (package, op, median ms)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.ok for s in self.steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.mac", description=__doc__.split("\n\n")[0],
                                 epilog="See docs/metal.md, 'What only a Mac can check'.")
    ap.add_argument("packages", nargs="*", help="package folder names (default: every package with a metal kernel)")
    ap.add_argument("--prebuilt", action="store_true",
                    help="check the darwin variants already in build/ (e.g. cross-built on Linux), build nothing")
    ap.add_argument("--skip-tests", action="store_true", help="no package tests (the marker then says passed: false)")
    ap.add_argument("--skip-model", action="store_true", help="no whole-model run (the marker then says passed: false)")
    ap.add_argument("--model", type=Path, help="the tiny Qwen3.5 GGUF (default: make_gguf's file in the model cache)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per op (default 20)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls must be at least 1")
    if args.jobs is not None and args.jobs < 1:
        ap.error("-j must be at least 1")
    known = metal_packages()
    unknown = [p for p in args.packages if p not in known]
    if unknown:
        ap.error(f"not a package with a metal kernel: {', '.join(unknown)} (known: {', '.join(known)})")
    args.packages = args.packages or known
    return args


def metal_packages() -> list[str]:
    from tools.build import package_spec

    return [p.parent.name for p in sorted((REPO / "packages").glob("*/build.toml"))
            if package_spec.load(p.parent).kernels_of("metal")]


# ---- the steps ----------------------------------------------------------------------------------

def _timed(name: str, fn: Callable[[], str]) -> Step:
    """A step: fn's text is its detail; an exception fails it with the exception as detail."""
    start = time.monotonic()
    try:
        detail, ok = fn(), True
    except Exception as e:  # noqa: BLE001 - every failure of a step is reported, the next steps still run
        detail, ok = f"{type(e).__name__}: {e}", False
    step = Step(name, ok, time.monotonic() - start, detail)
    print(f"[mac] {name}: {'ok' if ok else 'FAILED'} ({step.seconds:.0f} s) {detail}", file=sys.stderr, flush=True)
    return step


def variants(packages: list[str]) -> list[Path]:
    from tools.testing import mps_builds

    return [REPO / "packages" / p / "build" / mps_builds.darwin_variant() for p in packages]


def build_step(packages: list[str], prebuilt: bool, jobs: int | None) -> str:
    if prebuilt:
        missing = [str(v.relative_to(REPO)) for v in variants(packages) if not (v / "metadata.json").is_file()]
        if missing:
            raise RuntimeError(f"--prebuilt, but no variant at {', '.join(missing)}")
        return "prebuilt variants"
    built = darwin_native.build(packages, jobs)
    return f"{len(built)} variants built natively"


def tests_step(package: str) -> str:
    """The package's tests with the mps build kind, in a process of their own."""
    from tools.testing import mps_builds

    env = {**os.environ, mps_builds.BUILDS_ENV: mps_builds.KIND, "HF_HUB_OFFLINE": "1"}
    # the tests parametrized over build kinds, on this one only (ids "mps", not "mps-emu")
    cmd = [sys.executable, "-m", "pytest", f"packages/{package}/tests", "-q", "-m", "not slow", "-k", MPS_TESTS,
           "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    tail = res.stdout.strip().splitlines()[-1:] or ["(no output)"]
    if res.returncode == 5:
        raise RuntimeError(f"no test ran with the {mps_builds.KIND} build kind: {tail[0]}")
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-6000:] + res.stderr[-3000:])
        raise RuntimeError(tail[0])
    return tail[0]


MODEL_CODE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, backend, device, n_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if backend != "none":
    import ggml_kernels_integration as gk
    gk.enable(backend=backend)
tok = AutoTokenizer.from_pretrained(path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1])
# loaded on the device: transformers grafts the layer kernels for the device the model is on at load
model = AutoModelForCausalLM.from_pretrained(path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1],
                                             dtype=torch.float32, device_map=device).eval()
x = torch.tensor([tok("The quick brown fox jumps over the lazy dog. Once upon a time")["input_ids"][:12]], device=device)
with torch.inference_mode():
    logits = model(x).logits[0].float().cpu()
    out = model.generate(x, max_new_tokens=n_new, do_sample=False)
print("RESULT" + json.dumps({"logits": logits.tolist(), "gen": out[0, x.shape[1]:].tolist()}))
"""


def tiny_model(path: Path | None) -> Path:
    from tools.models import make_gguf

    path = path or make_gguf.default_dir() / make_gguf.file_name(*TINY_MODEL)
    if not path.is_file():
        raise RuntimeError(f"no {path}: make it on Linux (`python -m tools.models.make_gguf --config {TINY_MODEL[0]} "
                           f"--mix {TINY_MODEL[1]}`, which quantizes with the CPU build) and copy it here, or pass --model")
    return path


def _model_run(path: Path, backend: str, device: str) -> dict:
    res = subprocess.run([sys.executable, "-c", MODEL_CODE, str(path), backend, device, str(GREEDY_TOKENS)],
                         cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    found = [line for line in res.stdout.splitlines() if line.startswith("RESULT")]
    if res.returncode != 0 or not found:
        raise RuntimeError(f"the {backend} run on {device} failed: {res.stderr.strip()[-2000:]}")
    return json.loads(found[-1][6:])


def compare_logits(ours: list, reference: list) -> tuple[float, float]:
    """(mean KL of the reference's distribution to ours over the positions, share of same top-1)."""
    import torch

    a = torch.tensor(reference, dtype=torch.float64).log_softmax(-1)
    b = torch.tensor(ours, dtype=torch.float64).log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1)
    return kl.mean().item(), (a.argmax(-1) == b.argmax(-1)).double().mean().item()


def model_step(path: Path | None) -> str:
    model = tiny_model(path)
    reference = _model_run(model, "none", "cpu")
    ours = _model_run(model, "mps", "mps")
    kl, top1 = compare_logits(ours["logits"], reference["logits"])
    summary = f"{model.name}: mean KL {kl:.4g}, top-1 {top1:.0%}, {len(ours['gen'])} greedy tokens"
    if kl > MAX_MEAN_KL or top1 < MIN_TOP1 or len(ours["gen"]) != GREEDY_TOKENS:
        raise AssertionError(f"{summary} (bounds: KL <= {MAX_MEAN_KL}, top-1 >= {MIN_TOP1:.0%}, {GREEDY_TOKENS} tokens)")
    return summary


def zero_blocks(x, ggml_type: int):
    """Blocks of zeros in the storage of `ggml_type` for x's shape: a valid weight of every type (its
    scales 0), as fast on a GPU as any. There is no CPU build on a Mac to quantize with, and
    gguf-py quantizes no K-type."""
    import gguf
    import torch

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return torch.zeros(x.shape[0], x.shape[1] // block * size, dtype=torch.uint8)


def time_calls(call: Callable[[], object], calls: int, synchronize: Callable[[], None]) -> float:
    """Median seconds per call, each timed to the device's completion, after one warm-up call."""
    call()
    synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing_step(packages: list[str], calls: int, report: Report) -> str:
    import torch

    from tools.bench import metal_emu
    from tools.testing import mps_builds

    order = ("ggml-quantization", "ggml-norm", "topk", "ggml-gated-delta-net", "ggml-attn")  # workloads()'s
    missing = [p for p in order if p not in packages]
    if missing:
        return f"skipped: the workloads need every package ({', '.join(missing)} not checked)"
    modules = [mps_builds.load_mps(p)._module for p in order]
    by_module = {id(m): p for m, p in zip(modules, order, strict=True)}
    for name, (module, call) in metal_emu.workloads(*modules, device="mps", quantize=zero_blocks).items():
        report.timings.append((by_module[id(module)], name, time_calls(call, calls, torch.mps.synchronize) * 1e3))
    return f"{len(report.timings)} ops timed"


# ---- the report ---------------------------------------------------------------------------------

def timing_table(timings: list[tuple[str, str, float]], calls: int, machine: str) -> str:
    """The per-kernel table, markdown."""
    head = (f"{machine}; median ms per call over {calls} calls after a warm-up, each to the GPU's completion "
            "(torch.mps.synchronize), inputs on the device; quantized weights are zero blocks (`python -m tools.mac`)\n\n"
            "| package | op | ms |\n|---|---|---:|")
    return "\n".join([head, *(f"| {pkg} | {op} | {ms:.3f} |" for pkg, op, ms in timings)])


def machine_description() -> str:
    mac = platform.mac_ver()[0]
    return f"{datetime.date.today()}, macOS {mac or platform.system()} {platform.machine()}, torch {_torch_version()}"


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "(none)"
    return torch.__version__


def details(report: Report, args: argparse.Namespace, machine: str) -> dict:
    """What the marker records besides passed and the files' digests."""
    return {
        "machine": machine,
        "built": "prebuilt" if args.prebuilt else "natively",
        "steps": {s.name: {"ok": s.ok, "seconds": round(s.seconds, 1), "detail": s.detail} for s in report.steps},
        "timings_ms": {f"{pkg}: {op}": round(ms, 4) for pkg, op, ms in report.timings},
    }


def write_markers(checked: list[Path], report: Report, args: argparse.Namespace, machine: str) -> list[Path]:
    """<variant>.mac-checked.json beside every variant that exists: passed only when every step ran
    and passed (a skipped step is no pass)."""
    passed = report.ok and not (args.skip_tests or args.skip_model)
    return [mac_checked.write(v, passed, details(report, args, machine)) for v in checked if v.is_dir()]


def run(args: argparse.Namespace) -> Report:
    report = Report()
    report.steps.append(_timed("build", lambda: build_step(args.packages, args.prebuilt, args.jobs)))
    if not report.ok:
        return report
    if not args.skip_tests:
        for package in args.packages:
            report.steps.append(_timed(f"tests {package}", lambda p=package: tests_step(p)))
    if not args.skip_model:
        report.steps.append(_timed("model", lambda: model_step(args.model)))
    report.steps.append(_timed("timing", lambda: timing_step(args.packages, args.calls, report)))
    return report


def main(argv: list[str] | None = None) -> int:
    problem = darwin_native.host_problem()
    if problem:
        print(f"nox -s mac: {problem}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    report = run(args)
    machine = machine_description()
    if report.timings:
        print(timing_table(report.timings, args.calls, machine))
    markers = write_markers(variants(args.packages), report, args, machine)
    for step in report.steps:
        print(f"{'ok' if step.ok else 'FAILED'} {step.name} ({step.seconds:.0f} s): {step.detail}")
    verdict = "passed" if report.ok else "FAILED"
    print(f"mac check {verdict}; {len(markers)} markers written ({', '.join(m.name for m in markers) or 'none'})")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

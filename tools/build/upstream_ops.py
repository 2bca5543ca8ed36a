"""llama.cpp's own op suite, `test-backend-ops`, against an emulated Metal device.

test-backend-ops (tests/test-backend-ops.cpp of the pinned llama.cpp, compiled unchanged) runs each
of its cases on a backend and on ggml-cpu's reference path and compares the outputs. Here it is
linked to a device library of the runtime cache (ggml-base and upstream's Metal backend over our
device layer: `libggml-kernels-metal-emu.so`) and to ggml-cpu compiled into the executable, with
upstream's `ggml-backend-reg.cpp` built with GGML_USE_CPU and GGML_USE_METAL: one ggml-base in the
process, the device library's. Built with ninja into <runtime>/upstream-ops/, so a second run
compiles nothing.

    python -m tools.build.upstream_ops                    # the CI filter set (CI_FILTERS) on every device
    python -m tools.build.upstream_ops --device mps-emu   # on one device (DEVICES)
    python -m tools.build.upstream_ops --full             # every case of the suite (hours)
    python -m tools.build.upstream_ops -o MUL_MAT -p 'type_a=q4_K'   # one selection
    python -m tools.build.upstream_ops --list             # the CI filter set, nothing run

Prints per op the cases passed / failed / not supported, then one verdict line per device, and exits
1 on any failure, crash or output it does not understand. The devices (DEVICES): `metal-emu`, the
emulated device's own runtime, and `mps-emu`, the MPS twin's runtime (the MPS device layer over
metal-cpp and the fake Metal framework, executing on the same emulated device).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import resource
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from . import ggml_runtime, metal_runtime, mps_runtime, sanitize, upstream
from . import ninja_build as ninja

TEST_SOURCE = "tests/test-backend-ops.cpp"  # inside llama.cpp's tree
EXECUTABLE = "test-backend-ops"
# ggml-cpu's reference for the comparison: the baseline level runs on every x86-64 CI machine
# (the suite asks ggml-cpu for its reference path anyway)
CPU_LEVEL = "x64"


@dataclasses.dataclass(frozen=True)
class Device:
    """A device library of the runtime cache that upstream's backend registry can link to."""

    name: str
    library: str | None  # file name in the runtime folder; None: not built yet
    backend: str  # the device name test-backend-ops' -b takes
    defines: tuple[str, ...]  # ggml-backend-reg.cpp's GGML_USE_* for it (GGML_USE_CPU is always on)
    build: Callable[[], Path] | None = None  # builds the library, returns its folder
    missing: str = ""  # why it cannot run yet


def _twin_runtime_folder() -> Path:
    return mps_runtime.twin_runtime().parent


DEVICES = {
    "metal-emu": Device("metal-emu", metal_runtime.LIBRARY, "MTL0", ("GGML_USE_METAL",), build=ggml_runtime.build),
    # the MPS twin: ggml-base and upstream's host code over the MPS device layer on the fake Metal
    # framework (tools/build/mps_runtime.py), which runs each dispatch on the emulated device
    "mps-emu": Device("mps-emu", mps_runtime.TWIN_RUNTIME, "MTL0", ("GGML_USE_METAL",), build=_twin_runtime_folder),
}
DEFAULT_DEVICES = ("metal-emu", "mps-emu")


def device(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {sorted(DEVICES)}")
    found = DEVICES[name]
    if found.library is None or found.build is None:
        raise NotImplementedError(f"device {name!r} cannot run test-backend-ops: {found.missing}")
    return found


# ---- the filters ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Filter:
    """One run of test-backend-ops: -o (op names or regexes, comma separated) and -p (a regex over
    the case's parameters); None runs every case. Where -o selects FLASH_ATTN_EXT, upstream adds a
    sweep of its own that forces each vec-kernel variant (240 cases up to 4097 keys and head dim 576,
    which -p does not reach): fa_vec_slice=False switches it off (LLAMA_TEST_FA_VEC_DISABLE)."""

    ops: str | None
    params: str | None = None
    fa_vec_slice: bool = True

    def args(self) -> list[str]:
        return (["-o", self.ops] if self.ops else []) + (["-p", self.params] if self.params else [])


# Every op family our packages run on Metal, at sizes a CI machine (2 cores) gets through in a couple
# of minutes; --full runs the rest (the largest cases, long-KV attention and 500k-column top-k, take
# minutes each on the emulated device). The types that want an importance matrix (IQ1_*, IQ2_*) cost
# ggml's quantizer ~17 s of CPU setting up their grids in every process: only mul_mat has them.
# Measured in docs/metal.md.
NO_IMATRIX_TYPES = r"(?!iq1_|iq2_)"
CI_FILTERS: dict[str, Filter] = {
    # every storage type at 1 row (mat-vec), 2 and 5 (mat-vec-ext) and 9 (tiled mat-mat)
    "mul_mat": Filter("MUL_MAT", r"type_b=f32,m=16,n=(1|2|5|9),k=256,bs=\[1,1\],nr=\[1,1\],per=\[0,1,2,3\],k_v=0,"),
    # the vec path (1 token) and the mapped tiles (32 tokens)
    "mul_mat_id": Filter("MUL_MAT_ID", rf"type_a={NO_IMATRIX_TYPES}\w+,type_b=f32,n_mats=4,n_used=2,b=0,m=512,n=(1|32),k=256,"),
    # the packages' head dims, GQA 1 / 4, vec (1 query) and tiled (32), a padded last key block, float K/V
    "flash_attn_ext": Filter("FLASH_ATTN_EXT", r"hsk=(64|96|128|256),hsv=(64|96|128|256),nh=4,nr23=\[(1,1|4,1)\],"
                             r"kv=113,nb=(1|32),.*type_K=(f32|f16|bf16),", fa_vec_slice=False),
    "get_rows": Filter("GET_ROWS", rf"type={NO_IMATRIX_TYPES}\w+,n=256,m=5,r=4,be1=(1|7),be2=1,v=0,vs0=0,"),
    "set_rows": Filter("SET_ROWS"),
    # the 1025-wide fused cases take seconds each
    "norms": Filter("RMS_NORM,RMS_NORM_MUL_ADD,ADD_RMS_NORM,L2_NORM,NORM", r"ne=\[(?!1025,)"),
    "ssm_conv": Filter("SSM_CONV"),
    "gated_delta_net": Filter("GATED_DELTA_NET"),
    # rows of up to 2048 (topk's expert counts), not ggml's 500k-column ones
    "top_k": Filter("TOP_K,ARGSORT", r"ne=\[(\d{1,3}|1\d{3}|20[0-4]\d),\d{1,2},"),
    # the softmax gatings (topk's), unscaled
    "topk_moe": Filter("TOPK_MOE", r"gating_func=(0|2),scale_w=0\.0"),
    "soft_max": Filter("SOFT_MAX", r"ne=\[\d{1,2},"),
    # not the 16M-element broadcasts
    "element_wise": Filter("ADD,SUB,MUL,DIV,SCALE,SILU,SIGMOID,SOFTPLUS,EXP,NEG,CLAMP,SWIGLU,CONCAT,SUM_ROWS",
                           r"^type=f32,(?!ne=\[(64,262144|1,1,65536),)"),
}
FULL = {"everything": Filter(None)}


# ---- the build ----------------------------------------------------------------------------------

def test_source() -> Path:
    """tests/test-backend-ops.cpp of the pinned llama.cpp, extracted once beside the ggml tree."""
    tree_root = upstream.ggml_tree().parent
    dest = tree_root / TEST_SOURCE
    if dest.exists():
        return dest
    member = upstream.pin()["sdist"]["ggml_subdir"].rstrip("/").rsplit("/", 1)[0] + "/" + TEST_SOURCE
    with tarfile.open(upstream.sdist_path()) as tar:
        data = tar.extractfile(member).read()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


def build_dir(runtime: Path | None = None) -> Path:
    """One folder for every device (ggml-cpu and the test compiled once), each device's executable in
    a folder of its own."""
    return (runtime or ggml_runtime.runtime_dir()) / "upstream-ops"


def _compile_flags(tree: Path) -> list[str]:
    src = tree / "src"
    defines = [f"-D{d}" for d in ggml_runtime.DEFINES]
    # under GGML_KERNELS_SANITIZE the runtime (and so this build folder) is the ASan + UBSan one
    return (ggml_runtime.COMMON_FLAGS + defines + sanitize.compile_flags()
            + [f"-I{tree / 'include'}", f"-I{src}", f"-I{src / 'ggml-cpu'}"])


def write_ninja(out: Path, runtime: Path, tree: Path, test_cpp: Path, dev: Device) -> Path:
    """build.ninja for test-backend-ops of one device; returns the executable's path."""
    src = tree / "src"
    flags = _compile_flags(tree)
    n = ninja.NinjaFile()
    n.rule("cc", "gcc -MMD -MF $out.d -std=gnu11 $flags -c $in -o $out", "CC $out", depfile=True)
    n.rule("cxx", "g++ -MMD -MF $out.d -std=gnu++17 $flags -c $in -o $out", "CXX $out", depfile=True)
    n.rule("link", "g++ -o $out $in $ldflags", "LINK $out")
    level_flags, level_defines = ggml_runtime.CPU_LEVELS[CPU_LEVEL]
    cpu_flags = flags + level_flags + [f"-D{d}" for d in level_defines]
    objs = []
    for s in ggml_runtime.CPU_SOURCES:
        obj = out / "obj" / "cpu" / (s.replace("/", "_") + ".o")
        n.build(obj, "cc" if s.endswith(".c") else "cxx", src / s, variables={"flags": ninja.quote(cpu_flags)})
        objs.append(obj)
    test_obj = out / "obj" / "test-backend-ops.cpp.o"
    n.build(test_obj, "cxx", test_cpp, variables={"flags": ninja.quote(flags)})
    # libggml's own two files (the registry and its dlopen helpers), which ggml-base leaves out
    dl_obj = out / "obj" / "ggml-backend-dl.cpp.o"
    n.build(dl_obj, "cxx", src / "ggml-backend-dl.cpp", variables={"flags": ninja.quote(flags)})
    reg_obj = out / "obj" / dev.name / "ggml-backend-reg.cpp.o"
    reg_flags = flags + ["-DGGML_USE_CPU"] + [f"-D{d}" for d in dev.defines]
    n.build(reg_obj, "cxx", src / "ggml-backend-reg.cpp", variables={"flags": ninja.quote(reg_flags)})
    library = runtime / dev.library
    exe = out / dev.name / EXECUTABLE
    # the device library by its soname, found relative to the executable wherever the cache lies
    # (`$$` is ninja's `$`, kept from the shell by quote()'s single quotes); -rpath-link: where the
    # linker finds a device library's own libraries (a fake Metal framework)
    ldflags = ninja.quote([library, f"-Wl,-rpath,$ORIGIN/{os.path.relpath(runtime, exe.parent)}",
                           f"-Wl,-rpath-link,{runtime}", "-pthread", "-lm", "-ldl", *sanitize.link_flags()]
                          ).replace("$", "$$")
    n.build(exe, "link", [test_obj, reg_obj, dl_obj, *objs], implicit=[library], variables={"ldflags": ldflags})
    n.write(out / "build.ninja")
    return exe


def build(device_name: str = "metal-emu", jobs: int | None = None) -> Path:
    """Builds the device library (the runtime) and test-backend-ops linked to it; returns the executable."""
    dev = device(device_name)
    runtime = dev.build()
    out = build_dir()
    exe = write_ninja(out, runtime, upstream.ggml_tree(), test_source(), dev)
    ninja.run(out, jobs or os.cpu_count())
    return exe


# ---- the output ---------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# a case's line: "  OP(params): OK | FAIL | not supported [BACKENDS]"; a failing case's reason
# ("[OP] ERR = ... > ... ") is printed in front of it, on the same line
CASE = re.compile(r"  (?P<op>[^\s(\[\]]+)\((?P<params>.*)\): (?P<status>OK|FAIL|not supported \[[^\]]*\])\s*$")
TOTALS = re.compile(r"^  (?P<passed>\d+)/(?P<run>\d+) tests passed\s*$")
FA_SLICE = re.compile(r"^  fa_vec \(Q,NE\) slice: (?P<run>\d+) cases run, (?P<failed>\d+) failed\s*$")
FA_SLICE_OP = "FLASH_ATTN_EXT (vec slice)"
# after the totals, every failing case by name: "  OP(params)"
FAILING_HEADER = "Failing tests:"
FAILING_ENTRY = re.compile(r"^  (?P<op>[^\s(\[\]]+)\((?P<params>.*)\)\s*$")


@dataclasses.dataclass
class OpCount:
    passed: int = 0
    failed: int = 0
    unsupported: int = 0


@dataclasses.dataclass
class Summary:
    ops: dict[str, OpCount] = dataclasses.field(default_factory=lambda: collections.defaultdict(OpCount))
    failures: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)  # a crash, output not understood
    seconds: float = 0.0  # wall clock of the processes
    cpu_seconds: float = 0.0  # their CPU time: what a loaded machine does not inflate

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems

    def count(self, field: str) -> int:
        return sum(getattr(c, field) for c in self.ops.values())

    def merge(self, other: Summary) -> None:
        for op, c in other.ops.items():
            mine = self.ops[op]
            mine.passed, mine.failed, mine.unsupported = (mine.passed + c.passed, mine.failed + c.failed,
                                                          mine.unsupported + c.unsupported)
        self.failures += other.failures
        self.problems += other.problems
        self.seconds += other.seconds
        self.cpu_seconds += other.cpu_seconds


def parse(output: str, returncode: int = 0, label: str = "run") -> Summary:
    """test-backend-ops' console output (test mode) as counts per op; the totals it prints must agree."""
    summary = Summary()
    totals, listed_failing = [], collections.Counter()
    last_output, in_failing_list = None, False
    for line in (ANSI.sub("", raw) for raw in output.splitlines()):
        in_failing_list = (in_failing_list and bool(FAILING_ENTRY.match(line))) or line == FAILING_HEADER
        if in_failing_list and (m := FAILING_ENTRY.match(line)):
            listed_failing[(m["op"], m["params"])] += 1
        elif m := CASE.search(line):
            _count_case(summary, m["op"], m["params"], m["status"])
        elif m := TOTALS.match(line):
            totals.append((int(m["passed"]), int(m["run"])))
        elif m := FA_SLICE.match(line):
            count = summary.ops[FA_SLICE_OP]
            count.failed += int(m["failed"])
            count.passed += int(m["run"]) - int(m["failed"])
        elif line.startswith("  FAIL fa_vec slice: "):
            summary.failures.append(line.strip())
        elif line.startswith("  ") and "(" in line:
            last_output = line.strip()
    # a case that failed before its result line (e.g. "failed to allocate tensors") is only listed
    printed_failing = collections.Counter(tuple(f.split("(", 1)) for f in summary.failures if "(" in f)
    for (op, params), n in listed_failing.items():
        for _ in range(n - printed_failing[(op, params + ")")]):
            _count_case(summary, op, params, "FAIL")
    _check_totals(summary, totals, returncode, label, last_output)
    return summary


def _count_case(summary: Summary, op: str, params: str, status: str) -> None:
    count = summary.ops[op]
    if status == "OK":
        count.passed += 1
    elif status == "FAIL":
        count.failed += 1
        summary.failures.append(f"{op}({params})")
    else:
        count.unsupported += 1


def _check_totals(summary: Summary, totals: list, returncode: int, label: str, last_output: str | None) -> None:
    """What the output does not account for is a problem: a crash, missing or disagreeing totals."""
    cases = [c for op, c in summary.ops.items() if op != FA_SLICE_OP]
    passed, run = sum(c.passed for c in cases), sum(c.passed + c.failed for c in cases)
    if returncode < 0 or returncode > 1:
        how = f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"ended with status {returncode}"
        where = f" (last output: {last_output})" if last_output else ""
        summary.problems.append(f"{label}: test-backend-ops {how}{where}")
    elif not totals:
        summary.problems.append(f"{label}: no 'N/M tests passed' line in test-backend-ops' output")
    elif totals != [(passed, run)]:
        summary.problems.append(f"{label}: test-backend-ops counted {totals}, the case lines {passed}/{run}")
    elif returncode == 1 and summary.ok:
        summary.problems.append(f"{label}: test-backend-ops failed (status 1) with no failing case in its output")


def verdict(device_name: str, summary: Summary) -> str:
    """The one line .ci/run shows for a device's run."""
    return (f"upstream-ops {device_name}: {'passed' if summary.ok else 'failed'} ({summary.count('passed')} passed, "
            f"{summary.count('failed')} failed, {summary.count('unsupported')} not supported, {len(summary.problems)} "
            f"errors; {summary.seconds:.0f} s, {summary.cpu_seconds:.0f} s of CPU)")


def format_summary(summary: Summary) -> str:
    rows = [f"| {op} | {c.passed} | {c.failed} | {c.unsupported} |" for op, c in sorted(summary.ops.items())]
    total = (f"| **total** | {summary.count('passed')} | {summary.count('failed')} | "
             f"{summary.count('unsupported')} |")
    lines = ["| op | passed | failed | not supported |", "|---|---:|---:|---:|", *rows, total]
    lines += [f"FAILED {f}" for f in summary.failures] + [f"ERROR {p}" for p in summary.problems]
    took = f" in {summary.seconds:.0f} s ({summary.cpu_seconds:.0f} s of CPU)"
    lines.append(("OK" if summary.ok else "FAILED") + took)
    return "\n".join(lines)


# ---- running ------------------------------------------------------------------------------------

def run_filter(exe: Path, backend: str, name: str, flt: Filter, workers: int = 1, env: dict | None = None,
               echo: bool = False) -> Summary:
    """One test-backend-ops process; its stdout parsed, its stderr passed through."""
    cmd = [str(exe), "test", "-b", backend, *flt.args(), "-j", str(workers)]
    if echo:
        print("$", ninja.quote(cmd), file=sys.stderr, flush=True)
    wall, cpu = time.monotonic(), _children_cpu()
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, errors="replace", env=env)
    summary = parse(res.stdout, res.returncode, label=name)
    summary.seconds, summary.cpu_seconds = time.monotonic() - wall, _children_cpu() - cpu
    return summary


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(exe: Path, backend: str, filters: dict[str, Filter], workers: int = 1, fa_vec_slice: bool = True,
        verbose: bool = True) -> Summary:
    """Each filter in a process of its own; fa_vec_slice=False switches upstream's sweep off in all."""
    total = Summary()
    for name, flt in filters.items():
        env = dict(os.environ)
        if not (fa_vec_slice and flt.fa_vec_slice):
            env["LLAMA_TEST_FA_VEC_DISABLE"] = "1"
        got = run_filter(exe, backend, name, flt, workers, env, echo=verbose)
        if verbose:
            print(f"[upstream-ops] {name}: {got.count('passed')} passed, {got.count('failed')} failed, "
                  f"{got.count('unsupported')} not supported ({got.seconds:.0f} s, {got.cpu_seconds:.0f} s of CPU)",
                  file=sys.stderr, flush=True)
        total.merge(got)
    return total


def select(full: bool, ops: str | None, params: str | None) -> dict[str, Filter]:
    if (ops or params) and full:
        raise ValueError("--full runs every case: give it no -o / -p")
    if ops or params:
        _check_regex("-p", params)  # (an -o entry that is no regex matches nothing: upstream's choice)
        return {"selection": Filter(ops, params)}
    return FULL if full else CI_FILTERS


def _check_regex(flag: str, pattern: str | None) -> None:
    """test-backend-ops aborts on a -p it cannot compile (a std::regex_error): say so first. Python's
    syntax is close enough to C++'s ECMAScript regexes to catch what a typo breaks."""
    if pattern is None:
        return
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{flag} {pattern!r} is not a regular expression: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", dest="devices", action="append", choices=sorted(DEVICES),
                    help=f"a device library, repeatable (default: {', '.join(DEFAULT_DEVICES)})")
    ap.add_argument("--full", action="store_true", help="every case of the suite (hours on the emulator)")
    ap.add_argument("-o", dest="ops", help="test-backend-ops' -o: op names or regexes, comma separated")
    ap.add_argument("-p", dest="params", help="test-backend-ops' -p: a regex over the cases' parameters")
    ap.add_argument("-j", dest="workers", type=int, default=os.cpu_count() or 1,
                    help="test-backend-ops' parallel workers (default: the CPU count)")
    ap.add_argument("--no-fa-vec-slice", action="store_true",
                    help="skip upstream's forced flash-attention vec sweep (--full and -o FLASH_ATTN_EXT run it)")
    ap.add_argument("--list", action="store_true", help="print the runs' arguments, run nothing")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("-j must be at least 1")
    names = list(dict.fromkeys(args.devices or DEFAULT_DEVICES))
    try:
        filters = select(args.full, args.ops, args.params)
        devices = [device(name) for name in names]
    except (ValueError, NotImplementedError) as e:
        ap.error(str(e))
    if args.list:
        for name, flt in filters.items():
            print(name, ninja.quote(flt.args()))
        return 0
    verdicts = []
    for dev in devices:
        print(f"[upstream-ops] device {dev.name}", file=sys.stderr, flush=True)
        summary = run(build(dev.name), dev.backend, filters, args.workers, fa_vec_slice=not args.no_fa_vec_slice)
        print(f"### {dev.name}\n\n{format_summary(summary)}\n", flush=True)
        verdicts.append((verdict(dev.name, summary), summary.ok))
    print("\n".join(line for line, _ in verdicts))
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

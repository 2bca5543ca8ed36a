"""`nox -s mac` (tools/mac.py, tools/build/darwin_native.py, tools/testing/mps_builds.py): what of it
runs on Linux. Its refusal here (one line, non-zero, nothing installed); the host check for a Mac;
argument parsing; the timing table and its timer; the workloads' inputs on the device; the
mac-checked markers in the form publish accepts, passed only when every step ran and passed; the
native build's toolchain description; and the "mps" build kind's proxy, which runs ops written
for CPU tensors on a device (here the CPU itself, through copies)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
import torch

from tools import REPO, mac
from tools.bench import metal_emu
from tools.build import darwin, darwin_native, mac_checked
from tools.testing import mps_builds

NOT_A_MAC = "not a Mac: `nox -s mac` needs an Apple-silicon Mac with macOS 26.0 or later"
off_a_mac = pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal, which a Mac does not give")


@off_a_mac
def test_refuses_at_once_on_linux_in_one_line():
    res = subprocess.run([sys.executable, "-m", "tools.mac", "ggml-norm"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and NOT_A_MAC in res.stderr, res.stderr


@off_a_mac
@pytest.mark.skipif(shutil.which("nox") is None, reason="nox is not on PATH")
def test_nox_session_refuses_without_a_virtualenv():
    res = subprocess.run(["nox", "-s", "mac"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and NOT_A_MAC in res.stderr + res.stdout
    assert "pip install" not in res.stderr + res.stdout  # nothing installed before it refuses


@pytest.mark.parametrize(("system", "machine", "macos", "expected"), [
    ("Darwin", "arm64", "26.0", None),
    ("Darwin", "arm64", "26.1.2", None),
    ("Darwin", "arm64", "15.6", "runs macOS 15.6; the Metal variants need macOS 26.0"),
    ("Darwin", "arm64", "", "runs macOS unknown"),
    ("Darwin", "x86_64", "26.0", "is x86_64, not Apple silicon"),
    ("Linux", "aarch64", "", "this is Linux aarch64, not a Mac"),
])
def test_host_problem(system, machine, macos, expected):
    found = darwin_native.host_problem(system, machine, macos)
    assert found is None if expected is None else expected in found


def test_arguments():
    args = mac.parse_args([])
    assert args.packages == mac.metal_packages() and "ggml-norm" in args.packages
    assert (args.prebuilt, args.skip_tests, args.skip_model, args.calls) == (False, False, False, 20)
    assert mac.parse_args(["topk", "--prebuilt", "--calls", "3", "-j", "2"]).packages == ["topk"]


@pytest.mark.parametrize(("argv", "message"), [
    (["ggml-nothing"], "not a package with a metal kernel: ggml-nothing"),
    (["--calls", "0"], "--calls must be at least 1"),
    (["-j", "0"], "-j must be at least 1"),
    (["--calls", "many"], "invalid int value"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        mac.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_timing_table():
    table = mac.timing_table([("ggml-norm", "rms_norm 1024 x 32, weight", 0.01234), ("topk", "MoE routing", 1.5)],
                             20, "2026-12-03, macOS 26.1 arm64, torch 2.13.0")
    lines = table.splitlines()
    assert lines[0].startswith("2026-12-03, macOS 26.1 arm64, torch 2.13.0; median ms per call over 20 calls")
    assert lines[2:] == ["| package | op | ms |", "|---|---|---:|", "| ggml-norm | rms_norm 1024 x 32, weight | 0.012 |",
                         "| topk | MoE routing | 1.500 |"]


def test_time_calls_is_the_median_after_a_warm_up(monkeypatch):
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # calls of 1, 3 and 2 s
    monkeypatch.setattr(mac.time, "perf_counter", lambda: next(ticks))
    calls, syncs = [], []
    assert mac.time_calls(lambda: calls.append(1), 3, lambda: syncs.append(1)) == 2.0
    assert len(calls) == 4 and len(syncs) == 4  # the warm-up, then each timed call to completion


def test_zero_blocks_have_the_storage_of_their_type():
    x = torch.zeros(3, 1024)
    assert mac.zero_blocks(x, metal_emu.Q4_K).shape == (3, 4 * 144)
    assert mac.zero_blocks(x, metal_emu.Q8_0).shape == (3, 32 * 34)
    assert mac.zero_blocks(x, metal_emu.Q6_K).dtype == torch.uint8


class Recorder:
    """A package module whose every function records the devices of the tensors it is given."""

    def __init__(self):
        self.devices = set()

    def __getattr__(self, name):
        def op(*args, **kwargs):
            flat = [a for v in (*args, *kwargs.values()) for a in (v if isinstance(v, (list, tuple)) else [v])]
            self.devices |= {a.device.type for a in flat if isinstance(a, torch.Tensor)}
        return op


def test_workloads_put_every_input_on_the_device():
    modules = [Recorder() for _ in range(5)]
    found = metal_emu.workloads(*modules, device="meta", quantize=mac.zero_blocks)
    for _, call in found.values():
        call()
    assert len(found) == 16 and {d for m in modules for d in m.devices} == {"meta"}


def test_compare_logits():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    assert mac.compare_logits(logits.tolist(), logits.tolist()) == (0.0, 1.0)
    kl, top1 = mac.compare_logits((-logits).tolist(), logits.tolist())
    assert kl > 0.1 and top1 == 0.0


def _variant(tmp_path):
    variant = tmp_path / "packages" / "demo" / "build" / "torch213-metal-aarch64-darwin"
    variant.mkdir(parents=True)
    (variant / "__init__.py").write_text("")
    (variant / "_demo_metal_1.abi3.so").write_bytes(b"\xcf\xfa\xed\xfe")
    return variant


def _args(**overrides):
    return argparse.Namespace(**{"prebuilt": False, "skip_tests": False, "skip_model": False, **overrides})


def test_markers_are_what_publish_accepts(tmp_path):
    variant = _variant(tmp_path)
    report = mac.Report([mac.Step("build", True, 1.0, "1 variants built natively"), mac.Step("model", True, 2.0, "KL")],
                        [("ggml-norm", "l2_norm", 0.5)])
    [marker] = mac.write_markers([variant, tmp_path / "absent"], report, _args(), "a Mac")
    assert marker == mac_checked.marker(variant) and mac_checked.problem(variant) is None
    record = json.loads(marker.read_text())
    assert record["passed"] is True and record["built"] == "natively" and record["machine"] == "a Mac"
    assert set(record["files"]) == {"__init__.py", "_demo_metal_1.abi3.so"}
    assert record["steps"]["build"] == {"ok": True, "seconds": 1.0, "detail": "1 variants built natively"}
    assert record["timings_ms"] == {"ggml-norm: l2_norm": 0.5}


@pytest.mark.parametrize(("steps", "args"), [
    ([mac.Step("build", True, 1.0), mac.Step("tests topk", False, 1.0, "1 failed")], _args()),
    ([mac.Step("build", True, 1.0)], _args(skip_model=True)),  # a skipped step is no pass
    ([], _args()),
])
def test_markers_of_a_failed_or_partial_check_say_not_passed(tmp_path, steps, args):
    variant = _variant(tmp_path)
    mac.write_markers([variant], mac.Report(steps), args, "a Mac")
    assert "does not say the Mac check passed" in mac_checked.problem(variant)


def test_a_failed_build_stops_the_run(monkeypatch):
    monkeypatch.setattr(mac, "build_step", lambda *a: (_ for _ in ()).throw(RuntimeError("no xcrun")))
    monkeypatch.setattr(mac, "tests_step", lambda *a: pytest.fail("ran the tests without a build"))
    report = mac.run(_args(packages=["topk"], jobs=None, model=None, calls=1))
    assert not report.ok and [(s.name, s.ok, s.detail) for s in report.steps] == [("build", False, "RuntimeError: no xcrun")]


def test_every_step_runs_and_reports(monkeypatch):
    monkeypatch.setattr(mac, "build_step", lambda *a: "built")
    monkeypatch.setattr(mac, "tests_step", lambda p: (_ for _ in ()).throw(AssertionError("2 failed")) if p == "topk" else "9 passed")
    monkeypatch.setattr(mac, "model_step", lambda path: "KL 0.001")
    monkeypatch.setattr(mac, "timing_step", lambda *a: "16 ops timed")
    report = mac.run(_args(packages=["ggml-norm", "topk"], jobs=None, model=None, calls=1))
    assert [(s.name, s.ok) for s in report.steps] == [("build", True), ("tests ggml-norm", True), ("tests topk", False),
                                                      ("model", True), ("timing", True)]
    assert not report.ok


def test_the_tiny_model_missing_says_how_to_make_it(tmp_path):
    with pytest.raises(RuntimeError, match="make it on Linux .*--config qwen35-tiny --mix Q4_K_M.* or pass --model"):
        mac.tiny_model(tmp_path / "absent.gguf")


@off_a_mac
def test_native_compilers(monkeypatch, tmp_path):
    with pytest.raises(RuntimeError, match="not a Mac"):
        darwin_native.compilers()
    monkeypatch.setattr(darwin_native, "host_problem", lambda: None)
    monkeypatch.setattr(darwin_native, "_clang_identity", lambda: "Apple clang version 17.0.0")
    monkeypatch.setattr(darwin_native.mps_runtime, "metal_cpp", lambda: tmp_path / "metal_cpp")
    c = darwin_native.compilers()
    torch_mac = darwin_native.running_torch()
    assert list(c.torch) == [torch_mac.version] and c.allowed is None and c.includes == ()
    assert c.cxx == "xcrun clang++ -arch arm64 -mmacosx-version-min=26.0" and c.link.endswith(" -shared")
    inputs = c.link_inputs(torch_mac)
    assert inputs[:3] == [f"-L{torch_mac.libs}", "-lc10", "-ltorch_cpu"] and "Metal" in inputs and "-lobjc" in inputs
    assert c.runtime_dir.name == "runtime-darwin-native" and c.runtime_dir != darwin.runtime_dir()
    with pytest.raises(ValueError, match="for the running torch"):
        darwin_native.compilers(("0.0.1",))


# ---- the "mps" build kind ----------------------------------------------------------------------

@pytest.mark.parametrize(("env", "expected"), [
    (None, ("metal-emu", "mps-emu")),
    ("", ("metal-emu", "mps-emu")),
    ("mps", ("mps",)),
    (" mps-emu , metal-emu ", ("mps-emu", "metal-emu")),
])
def test_selected_kinds(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(mps_builds.BUILDS_ENV, raising=False)
    else:
        monkeypatch.setenv(mps_builds.BUILDS_ENV, env)
    assert mps_builds.selected_kinds(("metal-emu", "mps-emu")) == expected


def test_selected_kinds_refuses_an_unknown_kind(monkeypatch):
    monkeypatch.setenv(mps_builds.BUILDS_ENV, "metal-emu,mpss")
    with pytest.raises(ValueError, match=r"unknown build kinds \['mpss'\]: known are metal-emu, mps-emu, mps"):
        mps_builds.selected_kinds(("metal-emu", "mps-emu"))


def test_load_mps_refuses_without_the_variant(monkeypatch):
    monkeypatch.setattr(mps_builds, "darwin_variant", lambda: "torch0-metal-aarch64-darwin")
    with pytest.raises(RuntimeError, match="ggml-norm has no torch0-metal-aarch64-darwin variant: run `nox -s mac`"):
        mps_builds.load_mps("ggml-norm")


class Demo:
    """A package module: an op writing into its argument and returning a view's sum, a constant."""

    LIMIT = 7
    seen: list = []

    def add_into(self, out, x, scale=1.0):
        self.seen.append((out.untyped_storage().data_ptr(), x.untyped_storage().data_ptr(), out.stride(),
                          out.storage_offset()))
        out += x * scale
        return out.sum(), [x * 2]

    def info(self):
        return {"backend": "metal"}


def test_on_device_runs_ops_on_copies_and_copies_back():
    base = torch.zeros(4, 6)
    out = base[1:, ::2]  # a strided view at an offset
    x = torch.ones(3, 3)
    module = mps_builds.OnDevice(Demo(), "cpu")
    total, [doubled] = module.add_into(out, x, scale=2.0)
    (out_ptr, x_ptr, stride, offset) = Demo.seen[-1]
    assert out_ptr != base.untyped_storage().data_ptr() and x_ptr != x.untyped_storage().data_ptr()  # copies
    assert (stride, offset) == ((6, 2), 6)
    assert torch.equal(base[1:, ::2], torch.full((3, 3), 2.0)) and base[0].abs().sum() == 0 and base[1:, 1::2].abs().sum() == 0
    assert total.item() == 18.0 and torch.equal(doubled, torch.full((3, 3), 2.0))
    assert module.LIMIT == 7 and module.info() == {"backend": "metal"}


def test_on_device_keeps_shared_storages_shared():
    a = torch.zeros(8)
    Demo.seen.clear()
    mps_builds.OnDevice(Demo(), "cpu").add_into(a[:4], a[4:] + 1)
    mps_builds.OnDevice(Demo(), "cpu").add_into(a[:4], a[4:])  # both views of one storage: one copy
    assert Demo.seen[-1][0] == Demo.seen[-1][1] and Demo.seen[0][0] != Demo.seen[0][1]
    assert torch.equal(a, torch.tensor([1.0] * 4 + [0.0] * 4))


@pytest.mark.parametrize(("returncode", "stdout", "error"), [
    (0, "....\n4 passed in 1.0s\n", None),
    (1, "F.\n1 failed, 1 passed in 1.0s\n", "1 failed, 1 passed"),
    (5, "\n12 deselected in 0.1s\n", "no test ran with the mps build kind: 12 deselected"),
])
def test_tests_step_runs_the_mps_kind_only(monkeypatch, returncode, stdout, error):
    ran = []

    def fake_run(cmd, **kwargs):
        ran.append((cmd, kwargs["env"]))
        return subprocess.CompletedProcess(cmd, returncode, stdout, "")

    monkeypatch.setattr(mac.subprocess, "run", fake_run)
    if error is None:
        assert mac.tests_step("topk") == "4 passed in 1.0s"
    else:
        with pytest.raises(RuntimeError, match=error):
            mac.tests_step("topk")
    [(cmd, env)] = ran
    assert cmd[1:4] == ["-m", "pytest", "packages/topk/tests"] and cmd[cmd.index("-k") + 1] == mac.MPS_TESTS
    assert env[mps_builds.BUILDS_ENV] == "mps"


def test_the_mps_selection_takes_the_mps_kind_and_not_the_twin(tmp_path):
    (tmp_path / "test_kinds.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('kind', ['cpu', 'metal-emu', 'mps-emu', 'mps'], ids=str)\n"
        "def test_op(kind):\n    assert kind == 'mps'\n\ndef test_without_kinds():\n    pass\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", mac.MPS_TESTS,
                          str(tmp_path / "test_kinds.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0 and "1 passed, 4 deselected" in res.stdout, res.stdout + res.stderr

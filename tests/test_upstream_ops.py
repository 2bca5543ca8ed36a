"""tools/build/upstream_ops.py: llama.cpp's test-backend-ops against the emulated Metal device and
the MPS twin.

The fast tests hold its pure parts (filters, devices, the ninja file, reading the suite's output,
the verdict per device, the exit status) against canned output and a stand-in executable; the slow
ones build the real executables and run one op family of the CI filter set on each device."""

from __future__ import annotations

import os
import stat
import textwrap

import pytest

from tools.build import metal_runtime, mps_runtime, sanitize, upstream_ops

GREEN_OK = "\x1b[1;32mOK\x1b[0m"
RED_FAIL = "\x1b[1;31mFAIL\x1b[0m"
CANNED = textwrap.dedent(f"""\
    Testing 2 devices

    Backend 1/2: MTL0
      Device description: ggml-kernels emulated Metal device (Apple7+ features)
      Device memory: 65536 MB (65536 MB free)

      GET_ROWS(type=q4_K,n=256,m=5,r=4,be1=1,be2=1,v=0,vs0=0,offset_cols=0): {GREEN_OK}
      GET_ROWS(type=tq1_0,n=256,m=5,r=4,be1=1,be2=1,v=0,vs0=0,offset_cols=0): not supported [MTL0] 
    [MUL_MAT] ERR = 0.012345678 > 0.000500000   MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256,bs=[1,1]): {RED_FAIL}
      MUL_MAT(type_a=f16,type_b=f32,m=16,n=1,k=256,bs=[1,1]): {GREEN_OK}
      2/3 tests passed

    Failing tests:
      MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256,bs=[1,1])
      Backend MTL0: {RED_FAIL}
    Backend 2/2: CPU
      Skipping
    1/2 backends passed
    {RED_FAIL}
    """)
# the same run, passing: no failing case, no closing list
PASSING = (CANNED.replace(RED_FAIL, GREEN_OK).replace("2/3 tests passed", "3/3 tests passed")
           .replace("\nFailing tests:\n  MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256,bs=[1,1])\n", "\n"))


def test_output_is_counted_per_op():
    summary = upstream_ops.parse(CANNED, returncode=1)
    assert {op: (c.passed, c.failed, c.unsupported) for op, c in summary.ops.items()} == {
        "GET_ROWS": (1, 0, 1), "MUL_MAT": (1, 1, 0)}
    assert summary.failures == ["MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256,bs=[1,1])"]
    assert summary.problems == [] and not summary.ok
    summary.seconds, summary.cpu_seconds = 3.2, 2.9
    table = upstream_ops.format_summary(summary)
    assert "| MUL_MAT | 1 | 1 | 0 |" in table and "| **total** | 2 | 1 | 1 |" in table
    assert table.endswith("FAILED in 3 s (3 s of CPU)")


def test_a_passing_run_is_ok():
    summary = upstream_ops.parse(PASSING, returncode=0)
    assert summary.ok and summary.count("passed") == 3 and summary.count("unsupported") == 1
    assert upstream_ops.format_summary(summary).endswith("OK in 0 s (0 s of CPU)")


def test_a_failure_without_its_result_line_is_counted_from_the_failing_list():
    """An allocation failure prints no result line of its own; upstream's closing list names it."""
    out = (CANNED.replace("  MUL_MAT(type_a=f16", "failed to allocate tensors [MTL0]   MUL_MAT(type_a=f16")
           .replace("2/3 tests passed", "2/4 tests passed")
           .replace("  MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256,bs=[1,1])\n",
                    "  MUL_MAT(type_a=q4_0,type_b=f32,m=16,n=1,k=256,bs=[1,1])\n  SET_ROWS(type=f16,ne=[1,2])\n"))
    summary = upstream_ops.parse(out, returncode=1)
    assert summary.problems == []
    assert summary.ops["SET_ROWS"].failed == 1 and summary.ops["MUL_MAT"].failed == 1
    assert summary.failures[-1] == "SET_ROWS(type=f16,ne=[1,2])"


def test_flash_attention_vec_slice_is_counted():
    out = CANNED.replace("  2/3 tests passed", "  2/3 tests passed\nRunning FA vec slice tests (env ...)\n"
                         "  FAIL fa_vec slice: dk=128 dv=128 Q=1 ne=1 type=f16 ne01=1 ne11=512 sinks=0\n"
                         "  fa_vec (Q,NE) slice: 96 cases run, 1 failed")
    summary = upstream_ops.parse(out, returncode=1)
    assert summary.ops[upstream_ops.FA_SLICE_OP].passed == 95
    assert summary.ops[upstream_ops.FA_SLICE_OP].failed == 1
    assert "FAIL fa_vec slice: dk=128 dv=128 Q=1 ne=1 type=f16 ne01=1 ne11=512 sinks=0" in summary.failures


@pytest.mark.parametrize(("edit", "returncode", "message"), [
    (lambda o: o.split("  MUL_MAT(type_a=f16")[0] + "  MUL_MAT(type_a=f16,type_b=f32): ", -11,
     "was killed by SIGSEGV (last output: MUL_MAT(type_a=f16,type_b=f32):"),
    (lambda o: o.replace("  2/3 tests passed\n", ""), 1, "no 'N/M tests passed' line"),
    (lambda o: o.replace("2/3 tests passed", "5/6 tests passed"), 1, "counted [(5, 6)], the case lines 2/3"),
    (lambda o: PASSING, 1, "failed (status 1) with no failing case"),
], ids=["crash", "no-totals", "totals-disagree", "status-without-failure"])
def test_output_not_understood_is_an_error(edit, returncode, message):
    summary = upstream_ops.parse(edit(CANNED), returncode, label="mul_mat")
    assert not summary.ok
    assert len(summary.problems) == 1 and summary.problems[0].startswith("mul_mat: ")
    assert message in summary.problems[0]


def test_filters_ci_full_and_selection():
    assert upstream_ops.select(False, None, None) is upstream_ops.CI_FILTERS
    assert upstream_ops.select(True, None, None) == {"everything": upstream_ops.Filter(None)}
    assert upstream_ops.select(False, "MUL_MAT", "type_a=q4_0") == {
        "selection": upstream_ops.Filter("MUL_MAT", "type_a=q4_0")}
    assert upstream_ops.Filter("MUL_MAT", "n=1").args() == ["-o", "MUL_MAT", "-p", "n=1"]
    assert upstream_ops.Filter(None).args() == []
    with pytest.raises(ValueError, match="--full runs every case"):
        upstream_ops.select(True, "MUL_MAT", None)
    with pytest.raises(ValueError, match=r"-p 'type=\(' is not a regular expression"):
        upstream_ops.select(False, "MUL_MAT", "type=(")
    # a full case name in -o (commas inside its parentheses) is matched exactly, not as a regex
    assert upstream_ops.select(False, "ADD(type=f16,ne=[1,1,1,1]),MUL_MAT", None)


def test_ci_filters_cover_the_op_families_the_packages_run_on_metal():
    ops = {op for f in upstream_ops.CI_FILTERS.values() for op in f.ops.split(",")}
    assert {"MUL_MAT", "MUL_MAT_ID", "FLASH_ATTN_EXT", "GET_ROWS", "SET_ROWS", "RMS_NORM", "L2_NORM", "SSM_CONV",
            "GATED_DELTA_NET", "TOP_K", "ARGSORT", "TOPK_MOE", "SOFT_MAX", "ADD", "MUL", "CONCAT"} <= ops
    assert all(f.params is None or f.params.strip() for f in upstream_ops.CI_FILTERS.values())


def test_devices(monkeypatch):
    assert upstream_ops.device("metal-emu").library == metal_runtime.LIBRARY
    assert upstream_ops.device("mps-emu").library == mps_runtime.TWIN_RUNTIME
    assert upstream_ops.DEFAULT_DEVICES == ("metal-emu", "mps-emu")
    with pytest.raises(ValueError, match="unknown device 'cuda'"):
        upstream_ops.device("cuda")
    unbuilt = upstream_ops.Device("later", None, "MTL0", (), missing="its library does not exist yet")
    monkeypatch.setitem(upstream_ops.DEVICES, "later", unbuilt)
    with pytest.raises(NotImplementedError, match="device 'later' cannot run test-backend-ops: its library does not"):
        upstream_ops.device("later")


def test_ninja_file_links_the_device_library_and_no_second_ggml_base(tmp_path):
    runtime, tree = tmp_path / "runtime", tmp_path / "ggml"
    dev = upstream_ops.device("metal-emu")
    exe = upstream_ops.write_ninja(upstream_ops.build_dir(runtime), runtime, tree, tmp_path / "t.cpp", dev)
    assert exe == runtime / "upstream-ops" / "metal-emu" / "test-backend-ops"
    text = (runtime / "upstream-ops" / "build.ninja").read_text()
    assert "-DGGML_USE_CPU -DGGML_USE_METAL" in text
    assert f"{runtime / metal_runtime.LIBRARY} '-Wl,-rpath,$$ORIGIN/../..'" in text
    compiled = [line.split(": ", 1)[1].split()[1] for line in text.splitlines() if line.startswith("build ")
                and line.split(": ", 1)[1].split()[0] in ("cc", "cxx")]
    assert sorted(os.path.basename(p) for p in compiled if "ggml-cpu" not in p) == [
        "ggml-backend-dl.cpp", "ggml-backend-reg.cpp", "t.cpp"]  # no ggml.c, ggml-backend.cpp, ...


def test_ninja_file_under_the_sanitizers(tmp_path, monkeypatch):
    monkeypatch.setenv(sanitize.ENV, "1")
    runtime = tmp_path / "runtime"
    upstream_ops.write_ninja(upstream_ops.build_dir(runtime), runtime, tmp_path / "ggml", tmp_path / "t.cpp",
                             upstream_ops.device("metal-emu"))
    text = (runtime / "upstream-ops" / "build.ninja").read_text()
    assert all(f in text for f in sanitize.COMPILE_FLAGS + sanitize.LINK_FLAGS)


def fake_suite(tmp_path, output: str, returncode: int):
    """A stand-in for test-backend-ops: prints `output`, records its arguments and environment."""
    (tmp_path / "out.txt").write_text(output)
    exe = tmp_path / "fake-test-backend-ops"
    exe.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho \"$LLAMA_TEST_FA_VEC_DISABLE\" > {tmp_path}/env\n"
                   f"cat {tmp_path}/out.txt\nexit {returncode}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_run_passes_filters_and_merges(tmp_path):
    exe = fake_suite(tmp_path, CANNED, 1)
    filters = {"a": upstream_ops.Filter("MUL_MAT", "n=1"), "b": upstream_ops.Filter("GET_ROWS")}
    summary = upstream_ops.run(exe, "MTL0", filters, workers=2, fa_vec_slice=False, verbose=False)
    assert (tmp_path / "args").read_text().split() == ["test", "-b", "MTL0", "-o", "GET_ROWS", "-j", "2"]
    assert (tmp_path / "env").read_text().strip() == "1"
    assert summary.ops["MUL_MAT"].failed == 2 and summary.ops["GET_ROWS"].passed == 2 and not summary.ok
    assert summary.seconds > 0


@pytest.mark.parametrize(("fa_vec_slice", "filter_slice", "disabled"), [
    (True, True, ""), (True, False, "1"), (False, True, "1")])
def test_flash_attention_vec_sweep_switch(tmp_path, monkeypatch, fa_vec_slice, filter_slice, disabled):
    """upstream's sweep runs unless the run or the filter (the CI set's) switches it off."""
    monkeypatch.delenv("LLAMA_TEST_FA_VEC_DISABLE", raising=False)
    exe = fake_suite(tmp_path, CANNED, 1)
    flt = upstream_ops.Filter("FLASH_ATTN_EXT", fa_vec_slice=filter_slice)
    upstream_ops.run(exe, "MTL0", {"fa": flt}, fa_vec_slice=fa_vec_slice, verbose=False)
    assert (tmp_path / "env").read_text().strip() == disabled
    assert upstream_ops.CI_FILTERS["flash_attn_ext"].fa_vec_slice is False


@pytest.mark.parametrize(("returncode", "exit_status"), [(0, 0), (1, 1)])
def test_main_exits_non_zero_on_failure(tmp_path, monkeypatch, capsys, returncode, exit_status):
    out = CANNED if returncode else PASSING
    exe = fake_suite(tmp_path, out, returncode)
    monkeypatch.setattr(upstream_ops, "build", lambda name: exe)
    assert upstream_ops.main(["-o", "MUL_MAT", "-j", "1", "--device", "metal-emu"]) == exit_status
    printed = capsys.readouterr().out
    assert "| op | passed | failed | not supported |" in printed
    assert ("FAILED MUL_MAT(" in printed) == bool(returncode)
    assert printed.strip().splitlines()[-1].startswith(f"upstream-ops metal-emu: {'failed' if returncode else 'passed'} (")


def test_main_runs_every_device_with_a_verdict_line_each(tmp_path, monkeypatch, capsys):
    """Every device runs, a failing one first: one verdict line each, in order, last; exit 1."""
    failing, passing = tmp_path / "a", tmp_path / "b"
    failing.mkdir(), passing.mkdir()
    exes = {"metal-emu": fake_suite(failing, CANNED, 1), "mps-emu": fake_suite(passing, PASSING, 0)}
    built = []
    monkeypatch.setattr(upstream_ops, "build", lambda name: built.append(name) or exes[name])
    assert upstream_ops.main(["-o", "MUL_MAT", "-j", "1"]) == 1
    assert built == ["metal-emu", "mps-emu"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert "### metal-emu" in lines and "### mps-emu" in lines
    assert lines[-2].startswith("upstream-ops metal-emu: failed (") and lines[-1].startswith("upstream-ops mps-emu: passed (")


def test_verdict_line():
    summary = upstream_ops.parse(PASSING)
    summary.seconds, summary.cpu_seconds = 61.4, 20.2
    passed, unsupported = summary.count("passed"), summary.count("unsupported")
    assert upstream_ops.verdict("mps-emu", summary) == (f"upstream-ops mps-emu: passed ({passed} passed, 0 failed, "
                                                        f"{unsupported} not supported, 0 errors; 61 s, 20 s of CPU)")
    crashed = upstream_ops.parse("", returncode=-6, label="mul_mat")
    assert upstream_ops.verdict("mps-emu", crashed).startswith("upstream-ops mps-emu: failed (0 passed, 0 failed, "
                                                                "0 not supported, 1 errors;")


@pytest.mark.parametrize(("argv", "message"), [
    (["--full", "-o", "MUL_MAT"], "--full runs every case"),
    (["--device", "cuda"], "invalid choice"),
    (["-j", "0"], "-j must be at least 1"),
    (["-p", "ne=[1"], "is not a regular expression"),
])
def test_main_refuses_bad_arguments(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(upstream_ops, "build", lambda name: pytest.fail("built"))
    with pytest.raises(SystemExit) as e:
        upstream_ops.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_main_lists_the_ci_filters(capsys, monkeypatch):
    monkeypatch.setattr(upstream_ops, "build", lambda name: pytest.fail("built"))
    assert upstream_ops.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(upstream_ops.CI_FILTERS)


@pytest.mark.slow
def test_one_ci_family_end_to_end_on_the_emulated_device():
    """Builds test-backend-ops (a second build compiles nothing) and runs the CI set's SSM_CONV family."""
    exe = upstream_ops.build("metal-emu")
    built = exe.stat().st_mtime_ns
    assert upstream_ops.build("metal-emu") == exe and exe.stat().st_mtime_ns == built
    summary = upstream_ops.run(exe, "MTL0", {"ssm_conv": upstream_ops.CI_FILTERS["ssm_conv"]}, workers=1, verbose=False)
    assert summary.ok, upstream_ops.format_summary(summary)
    assert set(summary.ops) == {"SSM_CONV"} and summary.ops["SSM_CONV"].passed >= 10


@pytest.mark.slow
def test_one_ci_family_end_to_end_on_the_mps_twin():
    """test-backend-ops over the twin's runtime (the MPS device layer on the fake Metal framework),
    two workers: backends on two host threads share the one MPS stream."""
    exe = upstream_ops.build("mps-emu")
    assert exe.parent.name == "mps-emu" and exe.parent.parent == upstream_ops.build_dir()
    summary = upstream_ops.run(exe, "MTL0", {"ssm_conv": upstream_ops.CI_FILTERS["ssm_conv"]}, workers=2, verbose=False)
    assert summary.ok, upstream_ops.format_summary(summary)
    assert set(summary.ops) == {"SSM_CONV"} and summary.ops["SSM_CONV"].passed >= 10

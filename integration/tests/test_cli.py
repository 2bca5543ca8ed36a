"""The command line (`python -m ggml_kernels_integration`): generate streams text and ends with its
summary line, with and without our kernels; bench prints one JSON result; a bad file is one clear
error line and exit status 2, before anything is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ggml_kernels_integration  # noqa: F401, E402  (installed by nox: missing, these tests fail, not skip)
import pytest
from ggml_kernels_integration import packaged_steps

from tools.models import make_gguf

pytestmark = pytest.mark.slow  # a fresh process per command, whole models


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "ggml_kernels_integration", *args], capture_output=True, text=True,
                          env=env, timeout=600)


# the decode step's package alone: the prompts' packages (test_integration_compiled_decode.py) would
# double each compiling run's time
DECODE_STEPS_ONLY = {packaged_steps.PROMPTS_ENV: "0"}


@pytest.fixture(scope="module")
def tiny():
    return str(make_gguf.ensure("qwen35-tiny", "Q4_K_M", log=lambda message: None))


@pytest.mark.parametrize("kernels", [True, False])
def test_generate(tiny, kernels):
    proc = cli("generate", "--gguf", tiny, "--prompt", "Once upon a time", "--max-new-tokens", "6",
               *(() if kernels else ("--no-kernels",)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()  # the streamed text (random weights: gibberish, but some)
    summary = proc.stderr.strip().splitlines()[-1]
    assert "prefill" in summary and "decode" in summary and "peak RSS" in summary
    assert summary.endswith("kernels: on" if kernels else "kernels: off")
    assert "loading the model" in proc.stderr  # the progress stages


def test_generate_compiles_its_decode_step_for_later_runs(tiny, tmp_path):
    """--compile-decode on compiles the decode step and stores it; a later run under the
    default "auto" then decodes on the stored step without compiling; every run streams the same text
    (compiled steps equal eager ones on the tiny model)."""
    from ggml_kernels_integration import stored_steps

    env = {stored_steps.ENV: str(tmp_path / "steps"), **DECODE_STEPS_ONLY}
    command = ("generate", "--gguf", tiny, "--prompt", "Once upon a time", "--max-new-tokens", "6")
    on, auto, off = (cli(*command, "--compile-decode", mode, env=env) for mode in ("on", "auto", "off"))
    for proc in (on, auto, off):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert on.stdout == auto.stdout == off.stdout and on.stdout.strip()
    assert "compiled decode steps (batch 1 x 256 positions" in on.stderr, on.stderr[-3000:]
    # the compile is not a slow decode: the summary's rates leave it out, and say so
    assert "the compile is left out of the rates below" in on.stderr, on.stderr[-3000:]
    assert "left out of the rates" not in auto.stderr + off.stderr
    if packaged_steps.enabled():
        assert "1 loaded from" in auto.stderr and "compiled" in auto.stderr, auto.stderr[-3000:]
    else:
        assert "compiled decode steps" not in auto.stderr, auto.stderr[-3000:]
    assert "compiled decode steps" not in off.stderr
    # "auto" with nothing stored decodes eagerly and says how to store a step (where steps are packaged)
    unstored = cli(*command, env={stored_steps.ENV: str(tmp_path / "empty"), **DECODE_STEPS_ONLY})
    assert unstored.returncode == 0 and unstored.stdout == off.stdout, unstored.stderr[-3000:]
    hint = "store its steps once with `python -m ggml_kernels_integration store --gguf"
    assert (hint in unstored.stderr) == packaged_steps.enabled(), unstored.stderr
    assert hint not in auto.stderr + off.stderr
    refused = cli(*command, "--no-kernels", "--compile-decode", "on")
    assert refused.returncode == 2 and "drop --no-kernels" in refused.stderr, refused.stderr[-3000:]


def test_store_exports_what_auto_then_loads(tiny, tmp_path):
    """`store` exports the decode step of a 256-position cache and the prompt packages for every
    prompt up to 128 tokens (a Qwen3.5 file: its first prompt runs eagerly, then each range's package
    is exported); a second `store` finds them all stored; `generate` under "auto" then loads the step."""
    from ggml_kernels_integration import packaged_steps, stored_steps

    env = {stored_steps.ENV: str(tmp_path / "steps")}
    first, again = (cli("store", "--gguf", tiny, env=env) for _ in range(2))
    if not packaged_steps.enabled():
        assert first.returncode == 2 and "step packages are off here" in first.stderr, first.stderr[-3000:]
        return
    for proc in (first, again):
        assert proc.returncode == 0, proc.stderr[-3000:]
    line = first.stdout.strip().splitlines()[-1]
    assert line.startswith("batch 1 x 256 positions: decode step exported in "), first.stdout
    spans = line.split("prompt packages for ")[1].split(" tokens")[0].split(", ")
    assert spans[0].startswith("2-") and spans[-1].endswith("-128"), line  # every length from 2 to 128
    assert again.stdout.strip().splitlines()[-1].startswith(
        f"batch 1 x 256 positions: decode step stored already; prompt packages for {', '.join(spans)} tokens"), again
    auto = cli("generate", "--gguf", tiny, "--prompt", "Once upon a time", "--max-new-tokens", "6", env=env)
    # (a Qwen3.5 model's first prompt in a process runs eagerly: its prompt packages serve later ones)
    assert auto.returncode == 0 and "1 loaded from" in auto.stderr, auto.stderr[-3000:]


def test_bench_json(tiny):
    proc = cli("bench", "--gguf", tiny, "--backend", "kernels", "--prompt-tokens", "9", "--decode-tokens", "3",
               "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["backend"] == "kernels" and res["decode_tok_s"] > 0 and res["prefill_tok_s"]["9"] > 0
    assert res["kernel_calls"].get("ggml_quantization::mul_mat_vec", 0) > 0


def test_bench_compiled_decode_reports_its_compile(tiny, tmp_path):
    """kernels-compiled: the runner's decode steps and generate() share one compile (both on a static
    cache of compiled_decode.MIN_CACHE_POSITIONS), reported, not timed; where steps are stored (step
    packages on), the next process reports its step loaded."""
    from ggml_kernels_integration import bench, stored_steps

    command = ("bench", "--gguf", tiny, "--backend", "kernels-compiled", "--prompt-tokens", "9", "--decode-tokens",
               "3", "--repeats", "1", "--json")
    env = {stored_steps.ENV: str(tmp_path / "steps"), **DECODE_STEPS_ONLY}
    runs = [cli(*command, env=env)] + ([cli(*command, env=env)] if stored_steps.enabled() else [])
    for i, proc in enumerate(runs):
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(proc.stdout)
        assert res["decode_tok_s"] > 0 and res["generate_tok_s"] > 0 and res["compile_failure"] is None, res
        assert list(res["compile_s"]) == ["1 x 256"] and res["compile_s"]["1 x 256"] > 0, res["compile_s"]
        assert res["loaded"] == (["1 x 256"] if i else []), res
        assert ("loaded from the stored steps" in bench.describe_compiles(res)) == bool(i)


def test_bad_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    proc = cli("generate", "--gguf", str(bad), "--prompt", "x")
    assert proc.returncode == 2
    assert "not a GGUF file" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("generate", "--threads", "-2"), "argument --threads: -2 is out of range: it must be 1 to 512"),
        (("generate", "--threads", "two"), "argument --threads: 'two' is not a whole number"),
        (("bench", "--backend", "kernels", "--threads", "0"), "argument --threads: 0 is out of range: it must be 1 to 512"),
        (("generate", "--prompt", ""), "argument --prompt: the prompt is empty"),
        (("generate", "--max-new-tokens", "0"), "argument --max-new-tokens: 0 is out of range"),
        (("bench", "--backend", "kernels", "--prompt-tokens", "100000000"),
         "argument --prompt-tokens: 100000000 is out of range: it must be 1 to 16,777,216"),
        (("bench", "--backend", "kernels", "--prompt-tokens", "64", "5000"),
         "--prompt-tokens 64 5000 (and --decode-tokens 128 after the shortest) needs 5,000 positions; "),
        (("bench", "--backend", "kernels", "--prompt-tokens", "4000", "--decode-tokens", "200"),
         "needs 4,200 positions; "),
        (("bench", "--backend", "kernels", "--repeats", "0"), "argument --repeats: 0 is out of range: it must be 1 to 1,000"),
        (("generate", "--max-new-tokens", "5000"), "--max-new-tokens 5000 needs 5,000 positions; "),
        (("generate", "--compile-decode", "maybe"), "argument --compile-decode: invalid choice: 'maybe'"),
        (("store", "--positions", "256", "300"), "--positions: 300 is not a cache length a compiled generate() takes"),
        (("store", "--positions", "8192"), "--positions 8192 needs 8,192 positions; "),
    ],
)
def test_arguments_out_of_bounds_are_usage_errors(tiny, args, message):
    """Each ended in a traceback (torch.set_num_threads(-2), an empty prompt's empty tensor) or a 100 GB
    allocation (a 10^8-token prompt): now argparse's usage error, exit status 2, before anything loads."""
    command, *rest = args
    if command == "generate" and "--prompt" not in rest:
        rest += ["--prompt", "x"]
    proc = cli(command, "--gguf", tiny, *rest)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "usage: ggml-kernels" in proc.stderr and message in proc.stderr, proc.stderr[-3000:]
    if " positions; " in message:
        assert "holds 4,096 (qwen35.context_length)" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr


def test_text_that_is_not_utf8_names_the_file_and_the_key(tmp_path, tiny):
    data = bytearray(open(tiny, "rb").read())
    old = b"\x14\x00\x00\x00\x00\x00\x00\x00tokenizer.ggml.model\x08\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00gpt2"
    assert data.count(old) == 1
    at = data.index(old) + len(old) - 2
    data[at] = 0xFF  # "gpt2" -> b"gp\xff2"
    bad = tmp_path / "model.gguf"
    bad.write_bytes(bytes(data))
    proc = cli("generate", "--gguf", str(bad), "--prompt", "x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{bad}: corrupt GGUF file: metadata 'tokenizer.ggml.model' is not valid UTF-8" in proc.stderr

"""tools/bench/versus_ggml.py (`nox -s bench`'s ours-vs-ggml rounds, `-- --check`'s verdict) and the
ggml graphs it times (tools/testing/ggml_ctypes.py).

The pairing, the alternating rounds (on a fake clock), the ratio, the verdict and --check's exit codes
run on fake classes and synthetic results: no timing is ever asserted. Each ggml layer-op graph is
checked against its package's pure-PyTorch reference (loaded from the package's source, no build
needed) on a tiny input; those tests skip when llama-cpp-python's libggml is not installed."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from kernels.benchmark import Benchmark

from tools import REPO
from tools.bench import versus_ggml as vg
from tools.testing import ggml_ctypes

# ---- pairing ---------------------------------------------------------------------------------


def _fake(name: str, *names: str, base: type = Benchmark) -> type:
    return type(name, (base,), {f"benchmark_{w}": lambda self: None for w in names})


def test_pairs_each_op_with_its_ggml_class_on_shared_workloads():
    classes = [_fake("Norm", "a", "b", "only_ours"), _fake("Norm_ggml", "b", "a", "only_ggml"),
               _fake("Norm_reference", "a", "b"), _fake("Conv", "x"), _fake("Orphan_ggml", "x")]
    pairs = vg.pair_classes(classes)
    assert [(p.op, p.ours.__name__, p.ggml.__name__, p.workloads) for p in pairs] == [
        ("Norm", "Norm", "Norm_ggml", ["a", "b"])]


def test_inherited_workloads_count_and_disjoint_ones_make_no_pair():
    ours = _fake("MulMat", "q4_0_m64")
    ggml = _fake("MulMat_ggml", base=ours)  # workloads set on the base class, as the scripts' _add does
    assert vg.pair_classes([ours, ggml])[0].workloads == ["q4_0_m64"]
    assert vg.pair_classes([_fake("A", "x"), _fake("A_ggml", "y")]) == []


# ---- rounds and ratio ------------------------------------------------------------------------


class _Clock:
    """A clock that only moves when a fake op runs."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def op(self, name: str, seconds: float):
        def run():
            self.calls.append(name)
            self.now += seconds

        return run


def test_rounds_alternate_and_time_k_calls_per_side():
    clock = _Clock()
    timing = vg.alternate(clock.op("ours", 0.001), clock.op("ggml", 0.002), rounds=4, calls=3, clock=clock)
    blocks = clock.calls[::3]  # each block is 3 calls of one side
    assert all(len(set(clock.calls[i:i + 3])) == 1 for i in range(0, len(clock.calls), 3))
    assert blocks == ["ours", "ggml", "ggml", "ours", "ours", "ggml", "ggml", "ours"]
    assert len(clock.calls) == 4 * 2 * 3
    assert timing.ours_ms == pytest.approx([1.0] * 4) and timing.ggml_ms == pytest.approx([2.0] * 4)
    assert timing.ratio == pytest.approx(2.0)


def test_between_runs_after_every_block_untimed():
    clock = _Clock()
    timing = vg.alternate(clock.op("ours", 0.001), clock.op("ggml", 0.002), rounds=3, calls=2, clock=clock,
                          between=clock.op("between", 1.0))
    assert clock.calls == ["ours", "ours", "between", "ggml", "ggml", "between",
                           "ggml", "ggml", "between", "ours", "ours", "between",
                           "ours", "ours", "between", "ggml", "ggml", "between"]
    assert timing.ours_ms == pytest.approx([1.0] * 3) and timing.ggml_ms == pytest.approx([2.0] * 3)


@pytest.mark.skipif(not ggml_ctypes.available(), reason="llama-cpp-python's ggml is not installed")
def test_paused_ggml_threadpool_computes_the_same_when_called_again():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    graph = ggml_ctypes.MulMat(ggml_ctypes.quantize(w, 8), 8, cols=256, m=4, n_threads=2)  # Q8_0
    first = graph(x)
    vg.idle_ggml_threads()  # its workers asleep; the next compute wakes them
    np.testing.assert_array_equal(graph(x), first)
    vg.idle_ggml_threads()
    graph.close()


@pytest.mark.skipif(not ggml_ctypes.available(), reason="llama-cpp-python's ggml is not installed")
def test_mul_mat_on_a_borrowed_weight_reads_it_in_place():
    rng = np.random.default_rng(1)
    blocks = torch.from_numpy(ggml_ctypes.quantize(rng.standard_normal((32, 256)).astype(np.float32), 8))  # Q8_0
    blocks = blocks.clone().numpy()  # torch's memory: 64-byte aligned
    x = rng.standard_normal((2, 256)).astype(np.float32)
    copied = ggml_ctypes.MulMat(blocks, 8, cols=256, m=2)
    borrowed = ggml_ctypes.MulMat(blocks, 8, cols=256, m=2, borrow=True)
    assert borrowed._data(borrowed.w) == blocks.ctypes.data
    np.testing.assert_array_equal(borrowed(x), copied(x))
    blocks[:] = ggml_ctypes.quantize(rng.standard_normal((32, 256)).astype(np.float32), 8)
    np.testing.assert_array_equal(borrowed(x), ggml_ctypes.MulMat(blocks, 8, cols=256, m=2)(x))
    borrowed.close()
    copied.close()
    with pytest.raises(ValueError, match="32-byte aligned"):
        ggml_ctypes.MulMat(np.frombuffer(bytes(blocks.nbytes + 1), np.uint8)[1:].reshape(blocks.shape), 8,
                           cols=256, m=2, borrow=True)


def test_mul_mat_id_on_borrowed_experts_reads_them_in_place():
    rng = np.random.default_rng(2)
    experts = ggml_ctypes.quantize(rng.standard_normal((4 * 32, 256)).astype(np.float32), 8).reshape(4, 32, -1)
    experts = torch.from_numpy(experts).clone().numpy()  # torch's memory: 64-byte aligned
    x, ids = rng.standard_normal((3, 256)).astype(np.float32), np.array([[0, 3], [2, 1], [3, 3]], np.int32)
    copied = ggml_ctypes.MulMatId(experts, 8, cols=256, tokens=3, n_ids=2)
    borrowed = ggml_ctypes.MulMatId(experts, 8, cols=256, tokens=3, n_ids=2, borrow=True)
    assert borrowed._data(borrowed.w) == experts.ctypes.data
    np.testing.assert_array_equal(borrowed(x, ids), copied(x, ids))
    experts[:] = ggml_ctypes.quantize(rng.standard_normal((4 * 32, 256)).astype(np.float32), 8).reshape(4, 32, -1)
    np.testing.assert_array_equal(borrowed(x, ids), ggml_ctypes.MulMatId(experts, 8, 256, 3, 2)(x, ids))
    borrowed.close()
    copied.close()


@pytest.mark.skipif(not ggml_ctypes.available(), reason="llama-cpp-python's ggml is not installed")
def test_benchmark_products_read_the_same_weight_copies_as_ggml():
    """ours and ggml's graph of one workload read the very same pages of its weight copies (where
    copies lie moves a one-row product by up to ~10 %); the dense implementations keep their own."""
    from tools.testing.kernel_testing import load_kernel

    kernel = load_kernel("ggml-org/ggml-quantization")
    script = REPO / "packages" / "ggml-quantization" / "benchmarks" / "benchmark_mul_mat.py"
    classes = {cls.__name__: cls for cls in vg.load_script(script)}
    made = {}
    for name in ("MulMatVec", "MulMatVec_ggml", "MulMatVec_tf_f32"):
        made[name] = classes[name]()
        made[name].kernel = kernel
        made[name]._setup("Q4_0", 64, 256, 1)
    ours, ggml, dense = made["MulMatVec"].weights, made["MulMatVec_ggml"].weights, made["MulMatVec_tf_f32"].weights
    assert len(ours) > 1 and [w.data_ptr() for w in ours] == [g._data(g.w) for g in ggml]
    assert dense[0].dtype == torch.float32
    # the experts of mul_mat_id's workloads too, and both sides give the reference's products
    for name in ("MulMatId", "MulMatId_ggml"):
        made[name] = classes[name]()
        made[name].kernel = kernel
        made[name]._setup("down", 1)
        made[name]._run()
        torch.testing.assert_close(made[name].out, made[name]._verify(), atol=1e-2, rtol=0)
    ours, ggml = made["MulMatId"].weights, made["MulMatId_ggml"].weights
    assert len(ours) > 1 and [w.data_ptr() for w in ours] == [g._data(g.w) for g in ggml]


def test_ratio_is_the_median_of_per_round_ratios():
    timing = vg.Timing(ours_ms=[1.0, 2.0, 1.0, 10.0, 1.0], ggml_ms=[0.9, 2.0, 1.2, 1.0, 0.5])
    assert timing.ratio == pytest.approx(0.9)  # ratios 0.9, 1.0, 1.2, 0.1, 0.5
    assert timing.ours_median == 1.0 and timing.ggml_median == 1.0


@pytest.mark.parametrize(("ms", "calls"), [(0.001, 2000), (0.01, 2000), (1.0, 20), (7.0, 3), (50.0, 1), (0.0, 2000)])
def test_calls_per_block(ms, calls):
    assert vg.calls_per_block(ms, vg.Settings(block_ms=20.0, max_calls=2000)) == calls


# ---- verdict and --check ---------------------------------------------------------------------


def _row(package: str, ratio: float, workload: str = "w") -> vg.Row:
    return vg.Row(package, "Op", workload, 1.0, ratio, ratio)


def test_only_products_and_norms_are_judged():
    rows = [_row("ggml-quantization", 0.94), _row("ggml-norm", 0.95), _row("ggml-attn", 0.5), _row("topk", 0.1)]
    assert [r.verdict() for r in rows] == ["BELOW 0.95x", "ok", "-", "-"]
    assert vg.below(rows) == rows[:1]
    assert vg.exit_code(rows) == 1
    assert vg.exit_code(rows[1:]) == 0
    assert vg.exit_code(rows, threshold=0.9) == 0


@pytest.fixture
def synthetic(monkeypatch, tmp_path):
    """main() on made-up rows: run_package returns what the test sets, nothing is timed."""
    results: dict[str, list[vg.Row]] = {}
    monkeypatch.setattr(vg, "run_package", lambda package, settings, log=None, only=None: results.get(package, []))
    monkeypatch.setattr(ggml_ctypes, "available", lambda: True)
    monkeypatch.setenv(vg.QUICK_ENV, "0")  # restored (unset) afterwards, though main() sets it
    return results


def test_check_exits_1_below_the_threshold(synthetic, tmp_path, capsys):
    synthetic["ggml-norm"] = [_row("ggml-norm", 1.1, "a"), _row("ggml-norm", 0.8, "b")]
    synthetic["ggml-quantization"] = [_row("ggml-quantization", 1.0)]
    out = tmp_path / "versus.md"
    assert vg.main(["ggml-norm", "ggml-quantization", "--check", "--output", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "BELOW: ggml-norm Op.b 0.80x" in printed and "| Op | b | 1.000 | 0.800 | 0.80x | BELOW 0.95x |" in printed
    assert out.read_text().startswith(printed.split("\n\n")[0])


def test_check_exits_0_when_only_unjudged_ops_are_slow(synthetic):
    synthetic["ggml-norm"] = [_row("ggml-norm", 0.96)]
    synthetic["ggml-attn"] = [_row("ggml-attn", 0.2)]
    assert vg.main(["ggml-norm", "ggml-attn", "--check"]) == 0


def test_without_check_a_slow_row_is_reported_not_failed(synthetic):
    synthetic["ggml-norm"] = [_row("ggml-norm", 0.5)]
    assert vg.main(["ggml-norm"]) == 0


def test_check_refuses_a_judged_package_with_nothing_to_judge(synthetic, capsys):
    assert vg.main(["ggml-norm", "--check"]) == 2
    assert "nothing to judge in ggml-norm" in capsys.readouterr().err


def test_check_refuses_without_ggml(synthetic, monkeypatch):
    monkeypatch.setattr(ggml_ctypes, "available", lambda: False)
    assert vg.main(["ggml-quantization", "--check"]) == 2


def test_bad_arguments_are_usage_errors(synthetic):
    for argv in (["no-such-package"], ["--threads", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as e:
            vg.main(argv)
        assert e.value.code == 2


def test_threads_option_sets_torchs_threads(synthetic):
    before = torch.get_num_threads()
    try:
        vg.main(["ggml-attn", "--threads", "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_quick_sets_the_scripts_quick_mode(synthetic, monkeypatch):
    seen = {}
    monkeypatch.setattr(vg, "run_package", lambda package, settings, log=None, only=None: seen.setdefault("s", settings) and [])
    vg.main(["ggml-attn", "--quick"])
    assert seen["s"] == vg.QUICK
    assert os.environ[vg.QUICK_ENV] == "1"


def test_only_times_the_workloads_it_matches(synthetic, monkeypatch):
    pair = vg.Pair("MulMatVec", object, object, ["q4_k_9216x2560_m1", "q4_k_9216x2560_m16", "q8_0_1024x1024_m8"])
    assert vg.selected(pair, None) == pair.workloads
    assert vg.selected(pair, vg._pattern(r"MulMatVec\.q4_k_.*_m(1|8)$")) == ["q4_k_9216x2560_m1"]
    seen = {}
    monkeypatch.setattr(vg, "run_package", lambda package, settings, log=None, only=None: seen.setdefault("only", only) and [])
    vg.main(["ggml-attn", "--only", "_m8$"])
    assert seen["only"].pattern == "_m8$"
    with pytest.raises(SystemExit) as e:
        vg.main(["ggml-attn", "--only", "(unclosed"])
    assert e.value.code == 2


def test_markdown_names_the_machine():
    info = {"cpu": "AMD EPYC", "cores": "2", "cpus": "2", "threads": "2", "torch": "2.13.0", "date": "2026-12-03",
            "load": "1.0"}
    text = vg.markdown([_row("ggml-norm", 1.0), _row("topk", 2.0)], info, "nox -s bench -- --check")
    assert text.startswith("2026-12-03, AMD EPYC (2 cores, 2 logical CPUs), 2 threads for both, torch 2.13.0")
    assert "**ggml-norm** (norms judged)" in text and "**topk** (reported, not judged)" in text
    assert "| Op | w | 1.000 | 2.000 | 2.00x | - |" in text


def test_machine_reads_this_cpu():
    info = vg.machine()
    assert info["cpu"] and int(info["cores"]) >= 1 and int(info["threads"]) == torch.get_num_threads()


# ---- a wrong output fails loudly -------------------------------------------------------------


class _Op(Benchmark):
    seed = 0

    def setup_w(self):
        self.x = torch.ones(4)

    def benchmark_w(self):
        self.out = self.x * 2

    def verify_w(self):
        return self.x * 2


class _Op_ggml(_Op):
    def benchmark_w(self):
        self.out = self.x * 3  # a wrong graph


def test_measure_checks_both_outputs_before_timing():
    pair = vg.Pair("_Op", _Op, _Op_ggml, ["w"])
    with pytest.raises(RuntimeError, match=r"_Op_ggml\.w: output differs from verify_w"):
        vg.measure(pair, None, "w", vg.Settings(rounds=1, warmup=1, block_ms=0.01))
    row = vg.measure(vg.Pair("_Op", _Op, _Op, ["w"]), None, "w", vg.Settings(rounds=3, warmup=1, block_ms=0.01))
    assert (row.op, row.workload, row.rounds) == ("_Op", "w", 3) and row.ratio > 0


def test_controls_time_each_side_against_itself():
    settings = vg.Settings(rounds=3, warmup=1, block_ms=0.01, controls=True)
    row = vg.measure(vg.Pair("_Op", _Op, _Op, ["w"]), None, "w", settings)
    assert row.ours_aa > 0 and row.ggml_aa > 0
    plain = vg.measure(vg.Pair("_Op", _Op, _Op, ["w"]), None, "w", vg.Settings(rounds=1, warmup=1, block_ms=0.01))
    assert plain.ours_aa is None and plain.ggml_aa is None


def test_markdown_shows_the_controls_where_measured():
    info = {"cpu": "CPU", "cores": "2", "cpus": "2", "threads": "2", "torch": "2.13.0", "date": "2026-12-07", "load": "0.1"}
    row = _row("ggml-quantization", 0.97)
    row.ours_aa, row.ggml_aa = 1.01, 0.99
    text = vg.markdown([row], info, "cmd")
    assert "| ggml / ours | verdict | ours A/A | ggml A/A |" in text
    assert "| Op | w | 1.000 | 0.970 | 0.97x | ok | 1.01x | 0.99x |" in text
    assert "A/A" not in vg.markdown([_row("ggml-quantization", 0.97)], info, "cmd")


def test_controls_option_reaches_the_settings(synthetic, monkeypatch):
    seen = {}
    monkeypatch.setattr(vg, "run_package", lambda package, settings, log=None, only=None: seen.setdefault("s", settings) and [])
    vg.main(["ggml-attn", "--controls", "--rounds", "4"])
    assert seen["s"].controls and seen["s"].rounds == 4


def test_every_judged_package_has_ggml_pairs():
    """The scripts of the judged packages define <Op>_ggml classes (import only, nothing runs)."""
    if not ggml_ctypes.available():
        pytest.skip(ggml_ctypes.unavailable_reason())
    for package in vg.JUDGED:
        ops = {p.op for script in vg.scripts(package) for p in vg.pair_classes(vg.load_script(script))}
        assert ops, package


# ---- the ggml graphs against the packages' references ----------------------------------------

needs_ggml = pytest.mark.skipif(not ggml_ctypes.available(), reason=str(ggml_ctypes.unavailable_reason()))


def _reference(package: str, module: str):
    path = REPO / "packages" / package / "torch-ext" / module / "reference.py"
    spec = importlib.util.spec_from_file_location(f"_reference_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def norm_ref():
    return _reference("ggml-norm", "ggml_norm")


def _close(actual: np.ndarray, expected: torch.Tensor, atol: float) -> None:
    np.testing.assert_allclose(actual, expected.float().numpy(), rtol=0, atol=atol)


# float32: a few ulps of values below 2 (ggml sums squares in double, torch in float)
F32_ATOL = 1e-5


@needs_ggml
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_graph(norm_ref, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(3, 64, generator=gen) * 2 - 1).to(dtype)
    w = (torch.randn(64, generator=gen) * 0.1).to(dtype)
    name = "f32" if dtype == torch.float32 else "bf16"
    # zero-centred: the same graph given 1 + w
    y = ggml_ctypes.RMSNorm(3, 64, 1e-6, name, 2)(x, 1.0 + w.float())
    # bfloat16: one rounding of the same float32 value on both sides; a tie may round apart (1 ulp)
    _close(y, norm_ref.rms_norm(x, w, 1e-6, True), F32_ATOL if dtype == torch.float32 else 2**-7)


@needs_ggml
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_graph(norm_ref, dtype):
    gen = torch.Generator().manual_seed(2)
    x, z = ((torch.rand(4, 32, generator=gen) * 2 - 1).to(dtype) for _ in range(2))
    w = (1 + torch.randn(32, generator=gen) * 0.05).to(dtype)
    name = "f32" if dtype == torch.float32 else "bf16"
    y = ggml_ctypes.RMSNormGated(4, 32, 1e-6, name, 1)(x, z, w.float())
    # bfloat16: the reference rounds twice more (norm, norm * w) than ggml's float32 graph: ~3 ulps of < 2
    _close(y, norm_ref.rms_norm_gated(x, z, w, 1e-6), F32_ATOL if dtype == torch.float32 else 3 * 2**-7)


@needs_ggml
def test_l2_norm_graph(norm_ref):
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(3))
    _close(ggml_ctypes.L2Norm(5, 48, 1e-6, 2)(x), norm_ref.l2_norm(x, 1e-6, "clamp"), 1e-6)


@needs_ggml
@pytest.mark.parametrize(("sq", "skv", "kv_dtype"), [(1, 33, "f32"), (6, 17, "f32"), (5, 9, "f16")])
def test_flash_attn_graph(sq, skv, kv_dtype):
    ref = _reference("ggml-attn", "ggml_attn")
    gen = torch.Generator().manual_seed(sq + skv)
    q, k, v = torch.randn(1, 4, sq, 32, generator=gen), torch.randn(1, 2, skv, 32, generator=gen), \
        torch.randn(1, 2, skv, 32, generator=gen)
    if kv_dtype == "f16":  # the same half-precision cache on both sides
        k, v = k.half().float(), v.half().float()
    y = ggml_ctypes.FlashAttn(4, 2, 32, sq, skv, None, kv_dtype, 2)(q[0], k[0], v[0])
    expected = ref.flash_attn(q, k, v, causal=True).transpose(1, 2)[0]
    # f16 K/V: ggml rounds q to f16 for the K dot products and accumulates V in f16 (~1e-3 of O(1))
    _close(y, expected, 1e-5 if kv_dtype == "f32" else 5e-3)


@needs_ggml
@pytest.mark.parametrize(("tokens", "hk", "hv"), [(1, 2, 4), (5, 2, 6), (3, 3, 3)])
def test_gated_delta_net_graph(tokens, hk, hv):
    ref = _reference("ggml-gated-delta-net", "ggml_gated_delta_net")
    gen = torch.Generator().manual_seed(tokens * 10 + hv)
    d = 16
    q, k = torch.randn(1, tokens, hk, d, generator=gen), torch.randn(1, tokens, hk, d, generator=gen)
    v = torch.randn(1, tokens, hv, d, generator=gen)
    g, beta = -torch.rand(1, tokens, hv, generator=gen), torch.rand(1, tokens, hv, generator=gen)
    state = torch.randn(1, hv, d, d, generator=gen) * 0.1
    out, new_state = ref.gated_delta_net(q, k, v, g, beta, state, l2_normalize_qk=True)
    net = ggml_ctypes.GatedDeltaNet(hk, hv, d, tokens, 1e-6, 2)
    _close(net(q[0], k[0], v[0], g[0], beta[0], state[0]), out[0], 1e-5)
    _close(net.state(), new_state[0], 1e-5)


@needs_ggml
@pytest.mark.parametrize("tokens", [1, 7])
def test_causal_conv_graph(tokens):
    ref = _reference("ggml-gated-delta-net", "ggml_gated_delta_net")
    gen = torch.Generator().manual_seed(tokens)
    channels, kernel = 12, 4
    x = torch.randn(1, tokens, channels, generator=gen).transpose(1, 2)  # (1, C, T) over (T, C) memory
    w, state = torch.randn(channels, 1, kernel, generator=gen), torch.randn(1, channels, kernel, generator=gen)
    y, new_state = ref.causal_conv1d(x, w, state, "silu")
    conv = ggml_ctypes.CausalConv1d(channels, kernel, tokens, 2)
    _close(conv(x[0].T, w[:, 0], state[0, :, 1:]).T, y[0], 1e-5)
    _close(conv.state(), new_state[0, :, 1:], 0)


@needs_ggml
def test_graph_inputs_are_checked():
    with pytest.raises(ValueError, match="must be"):
        ggml_ctypes.RMSNorm(2, 8)(np.zeros((3, 8), np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="bfloat16"):
        ggml_ctypes.RMSNorm(2, 8, dtype="bf16").set_input(np.zeros((2, 8), np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="dtype"):
        ggml_ctypes.RMSNorm(2, 8, dtype="q4_0")
    with pytest.raises(ValueError, match="f32 or f16"):
        ggml_ctypes.FlashAttn(2, 2, 8, 1, 4, kv_dtype="bf16")
    with pytest.raises(ValueError, match="multiple"):
        ggml_ctypes.FlashAttn(3, 2, 8, 1, 4)
    with pytest.raises(ValueError, match="multiple"):
        ggml_ctypes.GatedDeltaNet(3, 4, 8, 1)
    with pytest.raises(ValueError, match=">= 1"):
        ggml_ctypes.CausalConv1d(0, 4, 1)
    with pytest.raises(ValueError, match="kernel"):
        ggml_ctypes.CausalConv1d(4, 1, 1)

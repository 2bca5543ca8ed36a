"""A/B of one integration feature on whole-model prefill and decode, alternating inside one process.

Separate runs minutes apart disagree by 10-20 % on a shared machine; switching the feature on and
off between rounds of the same process does not. Loads a GGUF file with `enable()`, then times
`--rounds` rounds of (prefill of `--prompt-tokens`, `--decode-tokens` greedy steps) with the feature
off, then on, and prints the median prefill tokens/s and decode ms per token of each.

    python -m tools.bench.ab_decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --feature rotary
    python -m tools.bench.ab_decode --gguf qwen35-0.8b.Q4_K_M.gguf --feature kv-cache --prompt-tokens 1024
    python -m tools.bench.ab_decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --feature dense-prefill --prompt-tokens 512
    python -m tools.bench.ab_decode --gguf qwen35-0.8b.Q4_K_M.gguf --feature repack-weights --prompt-tokens 4
    python -m tools.bench.ab_decode --gguf qwen35-0.8b.Q4_K_M.gguf --feature huge-pages

Features:
    kv-cache  ggml_kernels_integration.kv_cache (in-place growing cache) vs transformers' torch.cat
    rotary    ggml-attn's RotaryPosEmb vs transformers' apply_rotary_pos_emb (Llama-family files)
    linear    ggml_kernels_integration.projection_groups' GgufLinear.forward (sibling projections in
              one mul_mat_group call, other decode linears on the op directly) and gated MLPs vs
              transformers' own
    gated-mlp the gated MLPs' fused decode path (projection_groups.GatedMLP) vs the MLP's forward
              over the (grouped) linears
    dense-prefill
              ggml_kernels_integration.dense_prefill (block-32 weights: ggml's dequantize + a
              bfloat16 GEMM for 32-64+ rows) vs ggml-quantization's mul_mat for every prefill matmul
    compiled-decode
              ggml_kernels_integration.compiled_decode (`enable(compile_decode=True)`: a static cache
              and the model's forward compiled by torch.compile) vs eager steps on transformers'
              dynamic cache; the compile (once, before the rounds) is reported, not timed
    compile-guards
              compiled decode steps with `compiled_decode.keep_guard` (dynamo's guards on module
              attributes left out) vs the same graph with all of dynamo's guards
    compile-cpp-wrapper
              compiled decode steps with inductor's Python wrapper (ours) vs its C++ wrapper
    compile-stored-guards
              stored compiled steps (torch >= 2.15) with their guards checked once per generation
              (`stored_steps.one_generation`) vs on every step
    compile-graph-pass
              compiled decode steps with `decode_graph.inductor_options` (sibling products as one
              mul_mat_group call, no size assert per op output) vs inductor's defaults
    compile-packaged
              compiled decode steps as AOTInductor packages (torch >= 2.15, `packaged_steps`) vs stored
              dynamo steps (`stored_steps`); both exported / compiled or loaded before the rounds
The compile-* features but compile-packaged compare dynamo-compiled steps: they switch the packages
off (GGML_KERNELS_PACKAGED_STEPS=0) for the whole process.
    repack-weights
              ggml_kernels_integration.repacking (`enable(repack_weights=True)`: Q4_0 / Q4_K / IQ4_NL /
              MXFP4 linears in ggml-cpu's repacked layout) vs the GGUF layout
    huge-pages
              the packed weights on transparent huge pages (`enable(huge_pages=True)`, the default:
              ggml-quantization's `huge_pages`) vs copies of them in torch's memory (4 KiB pages)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from pathlib import Path


def _switch_kv_cache(model):
    import ggml_kernels_integration as gk
    from transformers.cache_utils import DynamicLayer

    ours, theirs = DynamicLayer.update, gk.original(DynamicLayer, "update")

    def use(on: bool) -> None:
        DynamicLayer.update = ours if on else theirs

    return use


def _switch_rotary(model):
    import transformers.models.llama.modeling_llama as llama

    rope = llama.apply_rotary_pos_emb
    ours, theirs = rope.forward, types.MethodType(type(rope).forward, rope)
    if "RotaryPosEmb" not in getattr(ours, "__qualname__", ""):
        raise SystemExit("the rotary kernel is not installed on this model (a Llama-family file is needed)")

    def use(on: bool) -> None:
        rope.forward = ours if on else theirs

    return use


def _switch_gated_mlp(model):
    from ggml_kernels_integration import projection_groups

    fused = {m: m.__dict__[projection_groups.MLP_ATTR] for m in model.modules() if projection_groups.MLP_ATTR in m.__dict__}
    if not fused:
        raise SystemExit("no gated MLP fast paths were installed on this model")

    def use(on: bool) -> None:
        for module, path in fused.items():
            if on:
                module.__dict__[projection_groups.MLP_ATTR] = path
            else:
                module.__dict__.pop(projection_groups.MLP_ATTR, None)

    return use


def _switch_linear(model):
    import ggml_kernels_integration as gk
    from ggml_kernels_integration import projection_groups
    from transformers.integrations.gguf.utils import GgufLinear

    ours, theirs = GgufLinear.forward, gk.original(GgufLinear, "forward")
    if not any(projection_groups.GROUP_ATTR in m.__dict__ for m in model.modules()):
        raise SystemExit("no projection groups were installed on this model")
    mlps = _switch_gated_mlp(model) if any(projection_groups.MLP_ATTR in m.__dict__ for m in model.modules()) else None

    def use(on: bool) -> None:
        GgufLinear.forward = ours if on else theirs
        if mlps is not None:
            mlps(on)

    return use


def _switch_dense_prefill(model):
    from ggml_kernels_integration import dense_prefill

    if not dense_prefill.native_bf16():
        raise SystemExit("this CPU has no bfloat16 dot products: dense_prefill never applies here")

    def use(on: bool) -> None:
        dense_prefill._state["enabled"] = on

    return use


def _switch_repack_weights(model):
    import kernels
    from ggml_kernels_integration import locate, repacking

    quant = kernels.get_kernel(locate.QUANTIZATION, version=1, **locate.backend_kwargs())

    def use(on: bool) -> None:  # the weights change layout between rounds (not timed)
        if on:
            repacking.install(model, quant)
        else:
            repacking.unpack_all(quant)

    return use


def _switch_huge_pages(model):
    import ggml_kernels_integration as gk
    import torch

    params = gk.packed_parameters(model)
    placed = [p.data for p in params]  # where enable() put them
    plain = [t.clone() for t in placed]  # torch's allocator: 4 KiB pages, unless the system's THP is "always"
    huge = sum(int(line.split()[1]) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
               if line.startswith("AnonHugePages:")) / 1024
    print(f"packed weights {sum(t.nbytes for t in placed) / 2**20:.0f} MiB; the process's anonymous memory on "
          f"huge pages {huge:.0f} MiB")

    def use(on: bool) -> None:
        with torch.no_grad():
            for p, data in zip(params, placed if on else plain, strict=True):
                p.data = data

    return use


def _switch_compiled_decode(model, positions: int):
    """`use(on)` returns the runner of the round: the static, compiled one when on (compiled here,
    before any round: the first step of each shape compiles)."""
    import torch
    from ggml_kernels_integration import bench, compiled_decode

    compiled, eager = bench.StaticCompiledRunner(model, positions), bench.TransformersRunner(model)
    with torch.inference_mode():
        compiled.decode(*compiled.prefill([1, 2, 3]), 2)
    print(f"compiled decode: {compiled_decode.record(model).describe()}, torch threads {torch.get_num_threads()}")

    def use(on: bool):
        return compiled if on else eager

    return use


def _against_compiled(model, positions: int, **other):
    """`use(on)`: compiled steps as `compiled_decode` makes them (on) against the same model compiled by
    `compiled_decode.compile_model` with `other` in place of the same arguments (off): two isolated
    compiles, before any round."""
    import torch
    from ggml_kernels_integration import bench, compiled_decode

    ours, theirs = bench.StaticCompiledRunner(model, positions), bench.StaticCompiledRunner(model, positions)
    arguments = {"inductor": compiled_decode.inductor_options(), **other}
    theirs.step = compiled_decode.guarded(model, compiled_decode.compile_model(model, compiled_decode.COMPILE_CONFIG, **arguments),
                                          model.__call__)
    with torch.inference_mode():
        for name, runner in (("on", ours), ("off", theirs)):
            cache, token = runner.prefill([1, 2, 3])
            start = time.perf_counter()
            runner.decode(cache, token, 2)  # the first step compiles
            print(f"compiled decode ({name}): first two steps {time.perf_counter() - start:.1f} s")

    def use(on: bool):
        return ours if on else theirs

    return use


def _switch_compile_guards(model, positions: int):
    """Compiled steps with `compiled_decode.keep_guard` (on) against all of dynamo's guards (off)."""
    return _against_compiled(model, positions, guard_filter=None)


def _switch_compile_cpp_wrapper(model, positions: int):
    """Compiled steps with inductor's Python wrapper (`compiled_decode`'s, on) against its C++ wrapper
    (`cpp_wrapper`, off: the graph's calls of our ops and its kernels made from C++)."""
    return _against_compiled(model, positions, inductor={"cpp_wrapper": True})


def _switch_compile_graph_pass(model, positions: int):
    """Compiled steps with `decode_graph`'s pass and options (on) against inductor's defaults (off)."""
    return _against_compiled(model, positions, inductor={})


def _switch_compile_packaged(model, positions: int):
    """Compiled steps as packages (on, `compiled_decode`'s own) against stored dynamo steps (off: a
    `stored_steps.StoredSteps` over the same torch.compile fallback), each loaded or made before the
    rounds."""
    import torch
    from ggml_kernels_integration import bench, compiled_decode, packaged_steps, stored_steps

    if not (packaged_steps.enabled() and stored_steps.enabled()):
        raise SystemExit("compile-packaged: steps are packaged and stored from torch 2.15 on (and not with "
                         f"{packaged_steps.ENV}=0 or {stored_steps.ENV}=0)")
    ours, theirs = bench.StaticCompiledRunner(model, positions), bench.StaticCompiledRunner(model, positions)
    options = compiled_decode.inductor_options()
    fallback = compiled_decode.compile_model(model, compiled_decode.COMPILE_CONFIG, inductor=options)
    stored = stored_steps.StoredSteps(model, fallback, compiled_decode._shape, compiled_decode.keep_guard, options)
    theirs.step = compiled_decode.guarded(model, stored, model.__call__)
    with torch.inference_mode():
        for name, runner in (("on", ours), ("off", theirs)):
            start = time.perf_counter()
            runner.decode(*runner.prefill([1, 2, 3]), 2)  # the first step exports / compiles or loads
            print(f"compiled decode ({name}): prefill and first two steps {time.perf_counter() - start:.1f} s")
    rec = compiled_decode.record(model)
    print(f"packaged: loaded {rec.packaged.loaded}, exported {rec.packaged.exported}; stored: loaded {stored.loaded}")

    def use(on: bool):
        return ours if on else theirs

    return use


def _switch_compile_stored_guards(model, positions: int):
    """Stored steps with their guards checked once per generation (on) against on every step (off):
    one runner, `stored_steps.one_generation` swapped for a context that marks no generation."""
    import contextlib

    import torch
    from ggml_kernels_integration import bench, compiled_decode, stored_steps

    if not stored_steps.enabled():
        raise SystemExit("compile-stored-guards: steps are stored from torch 2.15 on (and not with "
                         f"{stored_steps.ENV}=0)")
    runner = bench.StaticCompiledRunner(model, positions)
    with torch.inference_mode():
        runner.decode(*runner.prefill([1, 2, 3]), 2)  # the first step compiles or loads
    print(f"compiled decode: {compiled_decode.record(model).describe()}")
    once = stored_steps.one_generation

    def use(on: bool):
        stored_steps.one_generation = once if on else contextlib.nullcontext
        return runner

    return use


FEATURES = {"kv-cache": _switch_kv_cache, "rotary": _switch_rotary, "linear": _switch_linear, "gated-mlp": _switch_gated_mlp,
            "dense-prefill": _switch_dense_prefill, "repack-weights": _switch_repack_weights,
            "huge-pages": _switch_huge_pages, "compiled-decode": _switch_compiled_decode,
            "compile-guards": _switch_compile_guards, "compile-cpp-wrapper": _switch_compile_cpp_wrapper,
            "compile-graph-pass": _switch_compile_graph_pass, "compile-stored-guards": _switch_compile_stored_guards,
            "compile-packaged": _switch_compile_packaged}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--feature", choices=list(FEATURES), required=True)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compile-backend", default=None,
                    help="compiled-decode: torch.compile's backend instead of compiled_decode's (e.g. aot_eager)")
    args = ap.parse_args()

    import torch
    from ggml_kernels_integration import bench, packaged_steps

    if args.feature.startswith("compile-") and args.feature != "compile-packaged":
        os.environ[packaged_steps.ENV] = "0"  # they compare dynamo-compiled steps
    bench.setup_transformers(kernels_on=True)
    model, _ = bench.load_transformers_model(args.gguf, "float32")
    if args.feature == "compiled-decode":
        if args.compile_backend:
            from ggml_kernels_integration import compiled_decode

            compiled_decode.COMPILE_CONFIG["backend"] = args.compile_backend
        use = _switch_compiled_decode(model, args.prompt_tokens + args.decode_tokens + 16)
    elif args.feature.startswith("compile-"):
        use = FEATURES[args.feature](model, args.prompt_tokens + args.decode_tokens + 16)
    else:
        use = FEATURES[args.feature](model)
    vocab = model.config.get_text_config().vocab_size
    default_runner = bench.TransformersRunner(model)
    ids = bench.prompt_ids(args.prompt_tokens, vocab)
    times = {False: [], True: []}
    prefill = {False: [], True: []}
    tokens = {}
    with torch.inference_mode():
        default_runner.decode(*default_runner.prefill(ids), 8)  # warm-up
        for _ in range(args.rounds):
            for on in (False, True):
                runner = use(on) or default_runner  # a switch may bring its own runner
                start = time.perf_counter()
                cache, token = runner.prefill(ids)
                prefill[on].append(args.prompt_tokens / (time.perf_counter() - start))
                start = time.perf_counter()
                _, token = runner.decode(cache, token, args.decode_tokens)
                times[on].append((time.perf_counter() - start) / args.decode_tokens * 1e3)
                tokens[on] = int(token)
    use(True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    p_off, p_on = statistics.median(prefill[False]), statistics.median(prefill[True])
    print(f"{args.gguf.name}, {args.feature}, prompt {args.prompt_tokens}, {args.decode_tokens} decode steps, "
          f"median of {args.rounds} alternating rounds: prefill off {p_off:.1f} tok/s, on {p_on:.1f} tok/s "
          f"({p_on / p_off:.3f}x); decode off {off:.2f} ms/token, on {on:.2f} ms/token "
          f"({off / on:.3f}x); last greedy token off {tokens[False]}, on {tokens[True]}")
    # each round's pair: how far the rounds spread says how much of the median ratio is noise
    print("  decode ms/token by round (off/on): " + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(times[False], times[True], strict=True)))


if __name__ == "__main__":
    main()

"""Run or measure a GGUF model with transformers on ggml-kernels (`ggml-kernels`, `python -m ggml_kernels_integration`).

    python -m ggml_kernels_integration generate --gguf FILE --prompt TEXT [--max-new-tokens N]
        [--chat] [--no-kernels] [--dtype float32|bfloat16] [--threads N] [--compile-decode auto|on|off]
    python -m ggml_kernels_integration bench --gguf FILE --backend kernels|transformers-f32|transformers-bf16|llama.cpp
        [--prompt-tokens 64 512] [--decode-tokens 128] [--repeats N] [--threads N] [--json]
    python -m ggml_kernels_integration store --gguf FILE [--positions 256 512] [--threads N]

generate: loads the file with transformers on our kernels (or, with --no-kernels, transformers alone,
which dequantizes every weight), streams the greedy continuation to stdout as it comes and ends
with one summary line on stderr (prompt tokens, prefill and decode tokens/s, load time, peak RSS).
Progress messages go to stderr too, so stdout holds only the generated text. --compile-decode is
`enable(compile_decode=...)`: "auto" (the default) decodes compiled where that costs nothing (a step
stored by an earlier run) or repays itself; "on" compiles (and stores) the step, so
that later runs of the same model decode compiled under "auto"; "off" never.

bench: measures one backend on one file in this process (see `ggml_kernels_integration.bench`);
--json prints the result as one JSON object on stdout.

store: exports and stores the file's decode step for each static cache length of --positions and
the prompt packages for every prompt up to 128 tokens (`store_steps`), which later runs under
"auto" load instead of decoding eagerly: once per model, threads and software, 25-70 s a package.

Arguments out of bounds are usage errors (exit status 2) before anything is loaded: a thread count
of 1 to 512 (ggml's most), an empty prompt, token counts below 1 or beyond the file's context length
(`<arch>.context_length`; at most 16,777,216 where the file states none).

Everything is local: the Hub is not contacted (HF_HUB_OFFLINE=1 unless set otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import bench, validate


def _stage(message: str) -> None:
    print(f"[ggml-kernels] {message}", file=sys.stderr, flush=True)


def _bounded_int(low: int, high: int):
    """An argparse type: a whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {low} to {high:,}")
        return value

    return parse


def _prompt_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the prompt is empty: give the text to continue")
    return text


THREADS = _bounded_int(1, bench.MAX_THREADS)
# --compile-decode -> enable()'s compile_decode
COMPILE_DECODE = {"auto": "auto", "on": True, "off": False}
TOKENS = _bounded_int(1, validate.MAX_CONTEXT_LENGTH)  # then bounded by the file's context (_check_against_file)
REPEATS = _bounded_int(1, bench.MAX_REPEATS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ggml-kernels", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream a greedy continuation of a prompt, then a summary line")
    gen.add_argument("--gguf", type=Path, required=True, help="the GGUF model file")
    gen.add_argument("--prompt", type=_prompt_text, required=True, help="the prompt text (not empty)")
    gen.add_argument("--max-new-tokens", type=TOKENS, default=64, help="at most the file's context length")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the file's chat template (one user turn)")
    gen.add_argument("--no-kernels", action="store_true",
                     help="transformers alone: every weight dequantized at load (the baseline)")
    gen.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="compute dtype; bfloat16 only with --no-kernels (our kernels compute in float32)")
    gen.add_argument("--threads", type=THREADS, default=None, help="CPU threads, 1 to 512 (default: torch's)")
    gen.add_argument("--compile-decode", choices=tuple(COMPILE_DECODE), default="auto",
                     help="compiled decode steps: auto (where stored or repaid), on (compile and store), off")

    ben = commands.add_parser("bench", help="measure load, prefill, decode and peak memory of one backend")
    ben.add_argument("--gguf", type=Path, required=True, help="the GGUF model file")
    ben.add_argument("--backend", choices=bench.BACKENDS, required=True)
    ben.add_argument("--prompt-tokens", type=TOKENS, nargs="+", default=list(bench.DEFAULT_PROMPT_TOKENS),
                     help="prefill lengths, each within the file's context length (default: %(default)s)")
    ben.add_argument("--decode-tokens", type=TOKENS, default=bench.DEFAULT_DECODE_TOKENS,
                     help="decode steps after the shortest prompt, both within the file's context length")
    ben.add_argument("--repeats", type=REPEATS, default=bench.DEFAULT_REPEATS,
                     help=f"timed runs per measurement (median), 1 to {bench.MAX_REPEATS}")
    ben.add_argument("--threads", type=THREADS, default=None, help="CPU threads, 1 to 512 (default: torch's)")
    ben.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    sto = commands.add_parser("store", help="export and store the decode steps and prompt packages \"auto\" runs")
    sto.add_argument("--gguf", type=Path, required=True, help="the GGUF model file")
    sto.add_argument("--positions", type=TOKENS, nargs="+", default=[256],
                     help="static cache lengths (powers of two from 256) to store a decode step for (default: 256)")
    sto.add_argument("--threads", type=THREADS, default=None,
                     help="CPU threads, 1 to 512 (default: torch's); packages serve this count only")
    return parser


def _chat_or_plain_ids(tokenizer, prompt: str, chat: bool):
    if not chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if not tokenizer.chat_template:
        raise ValueError("--chat: this GGUF file has no chat template (tokenizer.chat_template)")
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    return encoded["input_ids"]


def _timed_text_streamer(tokenizer):
    """transformers' TextStreamer (prints the text as tokens arrive) that also notes when each new
    token arrived, for the prefill (time to the first token) and decode rates."""
    from transformers import TextStreamer

    class TimedTextStreamer(TextStreamer):
        def __init__(self):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.token_times: list[float] = []

        def put(self, value):
            if not self.next_tokens_are_prompt:  # generate() hands over the prompt first
                self.token_times.append(time.perf_counter())
            super().put(value)

    return TimedTextStreamer()


def generate(args) -> int:
    import torch

    path = args.gguf
    kernels_on = not args.no_kernels
    if kernels_on and args.dtype != "float32":
        raise ValueError("--dtype bfloat16 needs --no-kernels: our kernels compute in float32")
    if not kernels_on and args.compile_decode == "on":
        raise ValueError("--compile-decode on compiles our kernels' decode steps: drop --no-kernels")
    if args.threads:
        torch.set_num_threads(args.threads)
    _stage(f"{path.name}: transformers {'on ggml-kernels' if kernels_on else 'alone (dequantized ' + args.dtype + ')'}, "
           f"{torch.get_num_threads()} threads")
    bench.setup_transformers(kernels_on, compile_decode=COMPILE_DECODE[args.compile_decode])
    from transformers import AutoTokenizer

    _stage("loading the tokenizer")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _stage("loading the model")
    model, _ = bench.load_transformers_model(path, args.dtype)
    load_s = time.perf_counter() - start
    input_ids = _chat_or_plain_ids(tokenizer, args.prompt, args.chat)
    if input_ids.shape[1] == 0:
        raise ValueError(f"the prompt {args.prompt!r} is no tokens at all for this tokenizer")
    if input_ids.shape[1] + args.max_new_tokens > args.context:
        raise ValueError(f"the prompt's {input_ids.shape[1]:,} tokens and --max-new-tokens {args.max_new_tokens:,} "
                         f"need more positions than the {args.context:,} of {path.name}'s context")
    _stage(f"loaded in {load_s:.1f} s; generating up to {args.max_new_tokens} tokens")

    streamer = _timed_text_streamer(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
                       do_sample=False, streamer=streamer, pad_token_id=pad)
    times = streamer.token_times
    n_prompt = input_ids.shape[1]
    rec = _compiled_decode(model) if kernels_on else None
    prompt_s, steps_s = rec.compiling_seconds() if rec is not None else (0.0, 0.0)
    if rec is not None and rec.describe():
        _stage(rec.describe() + ("; the compile is left out of the rates below" if prompt_s + steps_s else ""))
    elif kernels_on and args.compile_decode == "auto" and _can_store():
        _stage(_how_to_store(path))
    prefill = f"{n_prompt / (times[0] - start - prompt_s):.1f} tok/s" if times else "-"
    decode = f"{(len(times) - 1) / (times[-1] - times[0] - steps_s):.1f} tok/s" if len(times) > 1 else "-"
    print(f"prompt {n_prompt} tokens | prefill {prefill} | decode {decode} ({len(times)} tokens) | "
          f"load {load_s:.1f} s | peak RSS {bench.peak_rss_mib():.0f} MiB | kernels: {'on' if kernels_on else 'off'}",
          file=sys.stderr, flush=True)
    return 0


def store_steps(args) -> int:
    """Load the file on our kernels and store its steps (`store.store_steps`), one line per cache length."""
    import torch

    from . import store, stored_steps

    if store.why_not():
        raise ValueError(store.why_not())
    if args.threads:
        torch.set_num_threads(args.threads)
    _stage(f"{args.gguf.name}: storing decode steps and prompt packages for {torch.get_num_threads()} threads")
    bench.setup_transformers(True, compile_decode="auto")
    model, _ = bench.load_transformers_model(args.gguf, "float32")
    for positions in store.check_positions(args.positions):
        _stage(f"batch 1 x {positions} positions: exporting what is not stored yet (25-70 s a package)")
        done = store.store_steps(model, (positions,))[positions]
        spans = ", ".join(f"{a}-{b}" for a, b in done["prompts"]) or "none"
        print(f"batch 1 x {positions} positions: decode step {done['decode']}; prompt packages for {spans} tokens "
              f"({done['seconds']:.1f} s)", flush=True)
    _stage(f"stored in {stored_steps.folder()}; later runs load them under --compile-decode auto")
    return 0


def _can_store() -> bool:
    from . import store

    return store.why_not() is None


def _how_to_store(path: Path) -> str:
    from . import compiled_decode

    return compiled_decode.how_to_store(path.name, f"`python -m ggml_kernels_integration store --gguf {path}`")


def _compiled_decode(model):
    """The model's compiled decode `Record` (what it compiled, loaded, and how long that took), None
    where it decoded eagerly."""
    from . import compiled_decode

    return compiled_decode.record(model)


def run_bench(args) -> int:
    _stage(f"measuring {args.backend} on {args.gguf.name}: prefill {' '.join(map(str, args.prompt_tokens))} tokens, "
           f"decode {args.decode_tokens} tokens, {args.repeats} repeats")
    result = bench.run(args.gguf, args.backend, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                       repeats=args.repeats, threads=args.threads)
    print(json.dumps(result) if args.json else bench.format_result(result), flush=True)
    return 0


def _check_against_file(parser: argparse.ArgumentParser, args) -> None:
    """The file is a usable GGUF model (`check_gguf`: GgufFileError naming the file and the problem),
    and the token counts fit its context length (a usage error, exit status 2, if not), which it
    keeps as `args.context` for the prompt's own check."""
    if not args.gguf.is_file():
        raise FileNotFoundError(f"no such GGUF file: {args.gguf}")
    summary = validate.check_gguf(args.gguf)
    key = f"{summary.architecture}.context_length"
    args.context = summary.metadata.get(key, validate.MAX_CONTEXT_LENGTH)
    source = key if key in summary.metadata else "no context length in the file: the most this tool takes"
    if args.command == "store":
        from . import store

        try:
            store.check_positions(args.positions)
        except ValueError as error:
            parser.error(f"--{error}")
        needed, what = max(args.positions), f"--positions {' '.join(map(str, args.positions))}"
    elif args.command == "generate":
        needed, what = args.max_new_tokens, f"--max-new-tokens {args.max_new_tokens}"
    else:
        needed = max(max(args.prompt_tokens), min(args.prompt_tokens) + args.decode_tokens)
        what = (f"--prompt-tokens {' '.join(map(str, args.prompt_tokens))} (and --decode-tokens {args.decode_tokens} "
                "after the shortest)")
    if needed > args.context:
        parser.error(f"{what} needs {needed:,} positions; {args.gguf.name} holds {args.context:,} ({source})")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never wait on the network
    bench.silence_kernel_mapping_warnings()
    try:
        _check_against_file(parser, args)
        return {"generate": generate, "bench": run_bench, "store": store_steps}[args.command](args)
    except (FileNotFoundError, ValueError) as error:
        print(f"ggml-kernels: error: {error}", file=sys.stderr)
        return 2

"""llama.cpp's greedy answer to one chat turn (its own chat template code, the file's template), printed
on stdout. The demo runs it in a process of its own, so that a crash in llama.cpp is one failed row.

    python -m tools.bench.llama_cpp_chat --gguf FILE --prompt TEXT [--max-tokens 24] [--threads 2]
"""

from __future__ import annotations

import argparse


def answer(path: str, prompt: str, max_tokens: int, threads: int) -> str:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)
    reply = llm.create_chat_completion([{"role": "user", "content": prompt}], temperature=0.0, max_tokens=max_tokens)
    return reply["choices"][0]["message"]["content"].strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(answer(args.gguf, args.prompt, args.max_tokens, args.threads))


if __name__ == "__main__":
    main()

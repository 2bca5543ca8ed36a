"""A small byte-level BPE vocabulary, built here, for the generated GGUF models.

It has the shape of a Qwen vocabulary in GGUF (`tokenizer.ggml.model = "gpt2"`): the 256 byte
tokens spelled in the usual printable byte alphabet, then tokens made by merges learned from the
short text below, then tokens from made-up merges of those word pieces up to the model's vocabulary
size (so the embedding has as many rows as the vocabulary has tokens, and every token is a real,
reachable piece of text), then a few control tokens. Nothing here is read
from a file or the network: the same arguments always give the same vocabulary.

    vocab = build_vocab(2048)
    vocab.tokens, vocab.token_types, vocab.merges, vocab.eos_id ...
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
USER_DEFINED_TOKENS = ("<think>", "</think>")

# ChatML, the format Qwen chat models use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The training text for the merges: written for this file. Common English words, code-ish
# fragments and the phrases the tests tokenize, so that they come out as a few multi-byte tokens.
TRAINING_TEXT = """
Hello world! Hello there, world. The world says hello back to everyone in the world.
A kernel is a small piece of code that runs on the processor and does one job well: it reads the
weights of a model, multiplies them with the activations, and writes the result for the next layer.
Quantization stores every weight in a few bits, with one scale for each block of thirty two or two
hundred and fifty six values, so that the model is smaller and the memory is read faster.
The tokenizer cuts the text into pieces, the pieces become numbers, and the numbers go into the
model. The model predicts the next token, one token at a time, and the text grows word by word.
def forward(self, hidden_states): return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
for layer in model.layers: hidden = layer(hidden) + hidden
import torch; x = torch.randn(4, 8); y = x @ x.T; print(y.shape)
The quick brown fox jumps over the lazy dog. The lazy dog sleeps, and the fox runs into the forest.
Once upon a time there was a little model that wanted to learn how to write stories about the sea,
the mountains, the rivers and the people who lived in the small towns between them.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 and 3.14159 appear in text all the time.
Question: what is the capital of France? Answer: Paris is the capital of France.
She said that they would come back tomorrow, but they did not come, and we waited for them.
It is important that the results are the same on every machine, in every run, for every user.
"""

# A simplified, ASCII-level version of the Qwen pre-tokenizer split, only used to train the merges.
_SPLIT = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_alphabet() -> dict[int, str]:
    """Byte -> the printable character that spells it in byte-level BPE vocabularies.

    Bytes that are already printable (and not space) keep their own character; the other 68 are
    given the code points from 256 upwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def spell(text: str) -> str:
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in text.encode("utf-8"))


def train_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: repeatedly merge the most frequent adjacent pair (ties: the smallest pair)."""
    words = Counter(tuple(spell(piece)) for piece in _SPLIT.findall(text))
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best_count = max(pairs.values())
        best = min(pair for pair, count in pairs.items() if count == best_count)
        merges.append(best)
        merged = best[0] + best[1]
        new_words: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return merges


def synthetic_merges(tokens: list[str], count: int, seed: int = 0) -> list[tuple[str, str]]:
    """`count` more merges, each joining a word piece (`Ġ`-prefixed or not) and a lowercase piece
    already in the vocabulary into a new one, so that a large vocabulary is all real, reachable
    word pieces instead of padding (which llama.cpp and transformers detokenize differently)."""
    rng = random.Random(seed)
    word = re.compile("^Ġ?[a-z]+$")
    lefts = [t for t in tokens if word.match(t)]
    rights = [t for t in lefts if not t.startswith("Ġ")]
    seen = set(tokens)
    out: list[tuple[str, str]] = []
    while len(out) < count:
        left, right = rng.choice(lefts), rng.choice(rights)
        joined = left + right
        if joined in seen or len(joined) > 16:
            continue
        seen.add(joined)
        out.append((left, right))
        lefts.append(joined)
        if not joined.startswith("Ġ"):
            rights.append(joined)
    return out


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right", as GGUF stores them
    bos_id: int
    eos_id: int
    pad_id: int
    chat_template: str

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def build_vocab(vocab_size: int, n_merges: int = 400) -> Vocab:
    """A vocabulary of exactly `vocab_size` tokens (>= 256 + the specials + a few merges)."""
    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)]
    seen = set(tokens)
    room = vocab_size - 256 - len(CONTROL_TOKENS) - len(USER_DEFINED_TOKENS)
    if room < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small for the byte tokens and the specials")
    merges = []
    for left, right in train_merges(TRAINING_TEXT, min(n_merges, room)):
        merges.append(f"{left} {right}")
        if left + right not in seen:
            seen.add(left + right)
            tokens.append(left + right)
    room -= len(tokens) - 256
    for left, right in synthetic_merges(tokens, room):
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    types = [NORMAL] * len(tokens)
    tokens += [*CONTROL_TOKENS, *USER_DEFINED_TOKENS]
    types += [CONTROL] * len(CONTROL_TOKENS) + [USER_DEFINED] * len(USER_DEFINED_TOKENS)
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
    eot = tokens.index(ENDOFTEXT)
    return Vocab(
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=eot,  # Qwen's files name <|endoftext|> as BOS but never add it
        eos_id=tokens.index(IM_END),
        pad_id=eot,
        chat_template=CHAT_TEMPLATE,
    )


if __name__ == "__main__":
    v = build_vocab(1024)
    print(len(v.tokens), "tokens,", len(v.merges), "merges; last merges:", v.merges[-5:])

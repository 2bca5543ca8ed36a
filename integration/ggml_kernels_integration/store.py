"""Store a model's compiled steps ahead of use: `store_steps(model, positions=(256, 512))`.

`compile_decode="auto"` (the default) decodes compiled only where the step is stored as a package
(`packaged_steps`), and runs a prompt's package only where one serves its length; everything else
runs eagerly. A process with `compile_decode=True` stores what its own generations meet: one static
cache length (`compiled_decode.cache_positions` of that generate()) and the prompt lengths it saw.
`store_steps` stores them all up front, for a batch of one: for each cache length asked for, the
decode step and the prompt packages that serve every prompt length from 2 to
`packaged_steps.MAX_PROMPT_TOKENS` (each package serves a range of lengths, `_token_range`; SmolLM2
takes three, 2-8, 9-31 and 32-128 tokens). It drives `generate()` itself, one call per package, each
stopped after its first decode step, so that what it stores is keyed by exactly the inputs a later
`generate()` passes. What is stored already is loaded, not exported again. An export costs 25-70 s
(module docstring of `packaged_steps`); packages are kept per thread count, so store with the threads
the model will run on.
"""

from __future__ import annotations

import logging
import time

import torch

from . import compiled_decode, packaged_steps

LOGGER = logging.getLogger("ggml_kernels_integration")
MIN_PROMPT_TOKENS = 2  # a forward of one token is a decode step


class _AfterTokens:
    """transformers' stopping criterion: stop once the sequences are `length` tokens long."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


def check_positions(positions, context: int | None = None) -> tuple[int, ...]:
    """The cache lengths to store, sorted: each one a compiled generate() takes (a power of two from
    `compiled_decode.MIN_CACHE_POSITIONS`), within `context` where given; anything else is a
    ValueError naming it."""
    chosen = tuple(sorted({int(p) for p in positions}))
    if not chosen:
        raise ValueError("positions: give at least one static cache length, e.g. 256")
    for p in chosen:
        if compiled_decode.cache_positions(p) != p:
            raise ValueError(f"positions: {p} is not a cache length a compiled generate() takes (powers of two "
                             f"from {compiled_decode.MIN_CACHE_POSITIONS}: 256, 512, 1024, ...)")
        if context is not None and p > context:
            raise ValueError(f"positions: {p} is beyond the model's {context:,} positions")
    return chosen


def why_not() -> str | None:
    """Why nothing can be stored here, None where steps are packaged (`packaged_steps.enabled`)."""
    if packaged_steps.enabled():
        return None
    return (f"step packages are off here (they need torch {'.'.join(map(str, packaged_steps.MIN_TORCH))} or later, "
            f"this is {torch.__version__}, and {packaged_steps.ENV} not 0): there is nothing to store")


def _context(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def _vocab(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


def _generate_once(model, tokens: int, positions: int) -> None:
    """A greedy generate() of a `tokens`-long prompt whose static cache holds `positions`, stopped
    after its first decode step."""
    ids = ((torch.arange(tokens) * 7 + 3) % _vocab(model)).unsqueeze(0)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=positions - tokens, do_sample=False,
                       stopping_criteria=[_AfterTokens(tokens + 2)], pad_token_id=0)


def _prompt_span(rec, positions: int, tokens: int) -> tuple[int, int] | None:
    """The lengths of the prompt package (exported or loaded) that serves `tokens` on `positions`."""
    packaged = rec.packaged if rec is not None else None
    if packaged is None:
        return None
    for batch, cache, first, last in (*packaged.prompt_exported, *packaged.prompt_loaded):
        if batch == 1 and cache == positions and first <= tokens <= last:
            return first, last
    return None


def _says(rec, shape: tuple) -> str:
    """How the decode step of `shape` came to be: exported (seconds), loaded, or not at all (why)."""
    packaged = rec.packaged if rec is not None else None
    if packaged is not None and shape in packaged.exported:
        return f"exported in {packaged.exported[shape]:.1f} s"
    if packaged is not None and shape in packaged.loaded:
        return "stored already"
    return f"not packaged ({rec.failure if rec is not None and rec.failure else 'its export failed'})"


def store_steps(model, positions=(compiled_decode.MIN_CACHE_POSITIONS,)) -> dict:
    """Export and store `model`'s decode step for a batch of one on each static cache length of
    `positions`, and the prompt packages that serve every prompt length up to
    `packaged_steps.MAX_PROMPT_TOKENS` on it (unless prompts are not packaged:
    GGML_KERNELS_PACKAGED_PROMPTS=0), so that `compile_decode="auto"` runs them in later processes.
    `model`: loaded packed on the CPU with `enable()` in force. Returns, per cache length, how its
    decode step came to be, the prompt lengths its packages serve and the seconds it took."""
    if why_not():
        raise RuntimeError(why_not())
    if not compiled_decode._is_packed_cpu_model(model):
        raise ValueError("store_steps takes a model loaded packed on the CPU with ggml_kernels_integration.enable()")
    chosen = check_positions(positions, _context(model))
    was = compiled_decode.mode()
    compiled_decode.set_mode(True)
    try:
        return {n: _store_cache_length(model, n) for n in chosen}
    finally:
        compiled_decode.set_mode(was)


def _store_cache_length(model, positions: int) -> dict:
    start = time.perf_counter()
    longest = min(packaged_steps.MAX_PROMPT_TOKENS, positions - 2) if packaged_steps.prompts_enabled() \
        else MIN_PROMPT_TOKENS
    tokens, spans = MIN_PROMPT_TOKENS, []
    while tokens <= longest:
        _generate_once(model, tokens, positions)
        span = _prompt_span(compiled_decode.record(model), positions, tokens)
        if span is None and longest > MIN_PROMPT_TOKENS:  # a Qwen3.5 model's first prompt runs eagerly
            _generate_once(model, tokens, positions)
            span = _prompt_span(compiled_decode.record(model), positions, tokens)
        if span is None:
            break
        spans.append(span)
        tokens = span[1] + 1
    rec = compiled_decode.record(model)
    result = {"decode": _says(rec, (1, positions)), "prompts": spans, "seconds": time.perf_counter() - start}
    LOGGER.info("ggml-kernels: %s, batch 1 x %d positions: decode step %s; prompt packages for %s tokens (%.1f s)",
                type(model).__name__, positions, result["decode"],
                ", ".join(f"{a}-{b}" for a, b in spans) or "no", result["seconds"])
    return result

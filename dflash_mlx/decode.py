"""The DFlash draft-verify loop (batch 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx

from .drafter import Drafter
from .sampling import Strategy
from .target import Target

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Step:
    tokens: list[int]  # committed this step: accepted proposals, then the target's token
    accepted: int  # how many of them were drafted
    draft_seconds: float = 0.0  # only measured with profile=True (costs one extra sync)
    verify_seconds: float = 0.0


def _process(processors: list[LogitsProcessor], history: mx.array, block: mx.array, logits: mx.array) -> mx.array:
    """Apply mlx_lm logits processors to each verify row with that row's own history."""
    rows = []
    for j in range(logits.shape[0]):
        row, seen = logits[j : j + 1], mx.concatenate([history, block[: j + 1]])
        for processor in processors:
            row = processor(seen, row)
        rows.append(row)
    return mx.concatenate(rows)


def speculative_decode(
    prompt: mx.array,
    target: Target,
    drafter: Drafter,
    strategy: Strategy,
    *,
    block_size: int,
    max_tokens: int,
    logits_processors: list[LogitsProcessor] | None = None,
    prefill_step_size: int = 2048,
    profile: bool = False,
) -> Iterator[Step]:
    """Yield the committed tokens of each step until ``max_tokens`` are produced.

    Each step: the drafter proposes ``block_size - 1`` tokens after the anchor (the
    last committed token) in one forward; the target verifies ``[anchor,
    proposals]`` in one forward; the accepted prefix plus one target token is
    committed; the target cache drops the rejected rows and the drafter gets the
    hidden states of the committed rows as new context. One host sync per step.
    """
    processors = logits_processors or []
    ops = strategy.ops
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    mask = mx.array([drafter.args.mask_token_id], mx.int32)

    logits, context = target.prefill(prompt, cache, prefill_step_size)
    history = prompt
    if processors:
        logits = _process(processors, prompt[:-1], prompt[-1:], logits)
    anchor = strategy.first(logits).reshape(1)
    yield Step([anchor.item()], 0)
    produced = 1

    while produced < max_tokens:
        tic = time.perf_counter()
        B = min(block_size, max_tokens - produced)
        if B > 1:
            block = mx.concatenate([anchor, mx.repeat(mask, B - 1)])
            draft_logits = drafter(target.embed(block)[None], context, draft_cache, target.lm_head, ops)
            proposals, q = strategy.propose(draft_logits)
        else:
            proposals, q = mx.zeros((0,), mx.int32), None
        if profile:
            mx.eval(proposals)
        drafted = time.perf_counter()
        block = mx.concatenate([anchor, proposals])
        logits, hidden = target(block[None], cache)
        logits = logits[0]
        if processors:
            logits = _process(processors, history, block, logits)
        tokens, n = strategy.verify(logits, proposals, q)
        mx.eval(tokens, n)
        n = n.item()
        target.rollback(cache, B - 1 - n)
        context = hidden[:, : n + 1]
        if processors:
            history = mx.concatenate([history, block[: n + 1]])
        anchor = tokens[n : n + 1]
        produced += n + 1
        done = time.perf_counter()
        yield Step(tokens[: n + 1].tolist(), n, drafted - tic, done - drafted)

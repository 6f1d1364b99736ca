"""The DFlash draft-verify loop (batch 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import mlx.core as mx

from .drafter import Drafter
from .errors import DFlashError
from .sampling import Strategy
from .target import Target

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Step:
    tokens: list[int]  # committed this step: accepted proposals, then the target's token
    accepted: int  # how many of them were drafted
    draft_seconds: float = 0.0  # only measured with profile=True (costs one extra sync)
    verify_seconds: float = 0.0
    block_size: int = 0  # rows verified this step (1: plain decoding, no draft)


class BlockPolicy(Protocol):
    """Chooses each step's block size from what earlier steps accepted."""

    def next_block_size(self) -> int: ...

    def observe(self, block_size: int, accepted: int, seconds: float) -> None: ...


@dataclass
class DecodeCache:
    """Target and drafter caches of one conversation, reusable across turns.

    ``tokens`` are the tokens whose K/V the target cache holds, in order. Passing
    the same object to the next ``speculative_decode`` whose prompt extends them
    (the next chat turn) prefills only the new suffix.
    """

    cache: list
    draft_cache: list
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, target: Target, drafter: Drafter, draft_window: tuple[int, int] | None = None) -> "DecodeCache":
        return cls(target.make_cache(), drafter.make_cache(draft_window))

    def reuse(self, prompt: list[int], target: Target) -> int:
        """Trim both caches to the longest prefix of ``prompt`` they hold; return its length.

        The drafter lags the target by the last step's context rows, and the last
        prompt token must be run to get logits, so both bound the reusable prefix.
        """
        limit = min(len(self.tokens), len(prompt) - 1, self.draft_cache[0].offset)
        n = 0
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        try:
            target.rollback(self.cache, len(self.tokens) - n)
        except DFlashError:
            # Recurrent and sliding-window layers only undo their last forward:
            # a longer rollback means prefilling again from scratch.
            self.cache, n = target.make_cache(), 0
        for c in self.draft_cache:
            c.trim(c.offset - n)
        del self.tokens[n:]
        return n


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
    block_size: int | BlockPolicy,
    max_tokens: int,
    logits_processors: list[LogitsProcessor] | None = None,
    prefill_step_size: int = 2048,
    profile: bool = False,
    prompt_cache: DecodeCache | None = None,
) -> Iterator[Step]:
    """Yield the committed tokens of each step until ``max_tokens`` are produced.

    Each step: the drafter proposes ``block_size - 1`` tokens after the anchor (the
    last committed token) in one forward; the target verifies ``[anchor,
    proposals]`` in one forward; the accepted prefix plus one target token is
    committed; the target cache drops the rejected rows and the drafter gets the
    hidden states of the committed rows as new context. One host sync per step.

    ``block_size`` is fixed or a ``BlockPolicy`` asked every step. ``prompt_cache``
    carries the caches over from an earlier call; it is updated in place after
    every step, so it stays valid when the caller stops early.
    """
    processors = logits_processors or []
    policy = None if isinstance(block_size, int) else block_size
    state = prompt_cache if prompt_cache is not None else DecodeCache.new(target, drafter)
    mask = mx.array([drafter.args.mask_token_id], mx.int32)
    head = target.head(drafter.vocab_rows)

    start = state.reuse(prompt.tolist(), target)
    cache, draft_cache = state.cache, state.draft_cache
    logits, context = target.prefill(prompt[start:], cache, prefill_step_size, drafter.context_rows)
    if (unseen := prompt.size - start - context.shape[1]) > 0:
        for c in draft_cache:  # rows beyond every sliding window: positions only
            c.skip(unseen)
    state.tokens.extend(prompt[start:].tolist())
    history = prompt
    if processors:
        logits = _process(processors, prompt[:-1], prompt[-1:], logits)
    anchor = strategy.first(logits).reshape(1)
    last = anchor.item()
    yield Step([last], 0)
    produced = 1

    while produced < max_tokens:
        tic = time.perf_counter()
        B = min(policy.next_block_size() if policy else block_size, max_tokens - produced)
        if B > 1:
            block = mx.concatenate([anchor, mx.repeat(mask, B - 1)])
            proposals, q = drafter.propose(target.embed(block)[None], anchor, context, draft_cache, head, strategy)
            proposals, q = proposals[0], None if q is None else q[0]
            mx.async_eval(proposals)  # the draft runs while the verify graph is built
        else:
            proposals, q = mx.zeros((0,), mx.int32), mx.zeros((0, target.vocab_size))
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
        committed = tokens.tolist()[: n + 1]  # read once: slicing on the device would cost a second sync
        state.tokens += [last] + committed[:n]
        last = committed[-1]
        # Without a draft this step, the drafter has not consumed the pending context yet.
        new_context = hidden[:, : n + 1]
        context = new_context if B > 1 else mx.concatenate([context, new_context], axis=1)
        if processors:
            history = mx.concatenate([history, block[: n + 1]])
        anchor = tokens[n : n + 1]
        produced += n + 1
        done = time.perf_counter()
        if policy:
            policy.observe(B, n, done - tic)
        yield Step(committed, n, drafted - tic, done - drafted, B)

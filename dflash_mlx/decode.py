"""The DFlash draft-verify loop (batch 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx

from .adaptive import BlockPolicy, FixedBlockSize, Plan
from .copying import CopyIndex, merge
from .models import Drafter
from .errors import DFlashError
from .sampling import Strategy
from .target import Target

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Step:
    tokens: list[int]  # committed this step: accepted proposals, then the target's token
    accepted: int  # how many of them were proposals (drafted or copied)
    draft_seconds: float = 0.0  # only measured with profile=True (costs one extra sync)
    verify_seconds: float = 0.0
    block_size: int = 0  # rows verified this step (1: plain decoding, no proposals)
    copied: int = 0  # how many of the accepted proposals were copied from earlier text
    copies: int = 0  # how many of the block's proposals were copied
    from_corpus: bool = False  # whether the copy came from the drafter's corpus, not from this text


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


def apply_processors(processors: list[LogitsProcessor], history: mx.array, block: mx.array, logits: mx.array) -> mx.array:
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
    copy_proposals: bool = True,
) -> Iterator[Step]:
    """Yield the committed tokens of each step until ``max_tokens`` are produced.

    Each step: the policy plans the block (``adaptive.py``); the drafter proposes ``B - 1``
    tokens after the anchor (the last committed token) in one forward, and/or they are copied
    from where the text last read as it ends now (``copying.py``); the target verifies
    ``[anchor, proposals]`` in one forward; the accepted prefix plus one target token is
    committed; the target cache drops the rejected rows and the drafter gets the hidden states
    of the committed rows as new context. One host sync per step.

    ``block_size`` is fixed or a ``BlockPolicy``. ``prompt_cache`` carries the caches over from
    an earlier call; it is updated in place after every step, so it stays valid when the caller
    stops early.
    """
    processors = logits_processors or []
    policy = FixedBlockSize(block_size) if isinstance(block_size, int) else block_size
    state = prompt_cache if prompt_cache is not None else DecodeCache.new(target, drafter)
    mask = mx.array([drafter.args.mask_token_id], mx.int32)
    head = target.head(drafter.vocab_rows)

    start = state.reuse(prompt.tolist(), target)
    cache, draft_cache = state.cache, state.draft_cache
    logits, prompt_hidden = target.prefill(prompt[start:], cache, prefill_step_size, drafter.context_rows)
    if (unseen := prompt.size - start - prompt_hidden.shape[1]) > 0:
        for c in draft_cache:  # rows beyond every sliding window: positions only
            c.skip(unseen)
    # Target hidden rows the drafter has not taken in yet, joined only when it drafts: steps
    # without a draft (plain, copy-only) add theirs, and joining every step would copy them all.
    context = [prompt_hidden]
    state.tokens.extend(prompt[start:].tolist())
    history = prompt
    if processors:
        logits = apply_processors(processors, prompt[:-1], prompt[-1:], logits)
    anchor = strategy.at(prompt.size).first(logits).reshape(1)
    last = anchor.item()
    copies = CopyIndex(prompt.tolist() + [last], drafter.corpus) if copy_proposals else None
    yield Step([last], 0)
    produced = 1
    ahead = None  # the anchor's forward, started before the host read the anchor

    while produced < max_tokens:
        tic = time.perf_counter()
        room = max_tokens - produced  # rows past it would verify tokens never returned
        copy = copies.suggest(min(room, max(policy.max_block_size, policy.copy_block_size)) - 1) if copies else None
        plan = policy.plan(copy, strategy.deterministic)
        B = min(plan.block_size, room)
        if copy is not None:
            copy = copy.cut(B - 1) if B > 1 else None
        drafted = from_copy = None
        rules = strategy.at(prompt.size + produced)  # the block's first verified row predicts this position
        if B > 1 and plan.draft:
            block = mx.concatenate([anchor, mx.repeat(mask, B - 1)])
            drafted, q, confidence = drafter.propose(target.embed(block)[None], anchor,
                                                     mx.concatenate(context, axis=1), draft_cache, head, rules)
            drafted, q, proposals = drafted[0], None if q is None else q[0], drafted[0]
            if plan.copy:
                rates = policy.acceptance.copy_rates(copy)
                proposals, from_copy = merge(drafted, confidence[0], mx.array(copy.tokens, mx.int32),
                                             mx.array([rates.rate(i) for i in range(B - 1)]))
        elif B > 1:  # copy only: no drafter forward this step
            proposals, q = mx.array(copy.tokens, mx.int32), None
            from_copy = mx.ones((B - 1,), mx.bool_)
        else:
            proposals, q = mx.zeros((0,), mx.int32), None
        if profile:
            mx.eval(proposals)
        else:  # the drafter computes while the host builds the verify graph
            mx.async_eval(proposals)
        drafted_at = time.perf_counter()
        block = mx.concatenate([anchor, proposals])
        if ahead is None:
            logits, hidden = target(block[None], cache)
        elif B == 1:
            logits, hidden = ahead
        else:  # the anchor's row already ran: verify the proposals after it
            logits, hidden = target(proposals[None], cache)
            logits, hidden = (mx.concatenate([a, b], axis=1) for a, b in zip(ahead, (logits, hidden)))
        logits = logits[0]
        if processors:
            logits = apply_processors(processors, history, block, logits)
        tokens, n = rules.verify(logits, proposals, q)
        ran_ahead, ahead = ahead is not None, None
        outputs = (tokens, n, *(x for x in (drafted, from_copy) if x is not None))
        if B == 1 and produced + 1 < max_tokens and policy.expects_plain():
            # mlx_lm's pipelining: the next anchor's forward (the whole of a plain step) runs
            # while the host reads this step's token and the caller handles it. Evaluated
            # apart: in one evaluation with it, reading the token would wait for that forward.
            mx.async_eval(outputs)
            ahead = target(tokens[None, :1], cache)
            mx.async_eval(ahead)
        mx.eval(outputs)
        n = n.item()
        target.rollback(cache, B - 1 - n)
        committed = tokens.tolist()[: n + 1]  # read once: slicing on the device would cost a second sync
        state.tokens += ([] if ran_ahead else [last]) + committed[:n]
        last = committed[-1]
        if ahead is not None:
            state.tokens.append(last)  # the cache holds it already
        if drafted is not None:  # the drafter took in the rows before these
            context = []
        context.append(hidden[:, : n + 1])
        if processors:
            history = mx.concatenate([history, block[: n + 1]])
        anchor = tokens[n : n + 1]
        produced += n + 1
        done = time.perf_counter()
        if copies:
            copies.extend(committed)
        drafted = drafted.tolist() if drafted is not None else None
        policy.record(Plan(B, drafted is not None, from_copy is not None), drafted, copy, committed, done - tic)
        from_copy = from_copy.tolist() if from_copy is not None else []
        yield Step(committed, n, drafted_at - tic, done - drafted_at, B, sum(from_copy[:n]), sum(from_copy),
                   any(from_copy) and copy.from_corpus)


"""What the batch engine keeps per request, and the events it returns for each committed token."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import StopSequences

from .adaptive import AdaptiveBlockSize
from .batch_copies import RowCopies
from .decode import LogitsProcessor
from .sampling import Strategy
from .stats import SpeculativeStats


@dataclass
class TokenEvent:
    """One committed token of one request, in order.

    The request's last event has a ``finish_reason``: "stop" (``token`` is the
    stop token, not part of the answer, as in mlx_lm) or "length"; it also
    carries the request's acceptance record.
    """

    uid: int
    token: int
    from_draft: bool  # a drafter proposal the target accepted
    finish_reason: str | None = None
    logprob: float | None = None  # with add(logprobs=True): log p of the token (after processors)
    stats: SpeculativeStats | None = None


@dataclass(eq=False)
class BatchRequest:
    """A request in the batch engine: its settings, random stream, caches (until it joins the
    batch), copy index, acceptance record and the tokens committed so far."""

    uid: int
    prompt: list[int]
    max_tokens: int
    strategy: Strategy
    processors: list[LogitsProcessor]
    matcher: StopSequences.Matcher
    key: mx.array | None
    logprobs: bool
    stats: SpeculativeStats
    tracker: AdaptiveBlockSize | None
    block_cap: int | None  # the request's own largest block
    copies: RowCopies | None
    cache: list  # one-row caches until the request joins the batch
    draft_cache: list
    prefilled: int = 0  # prompt tokens in the caches (from the prompt cache, then prefilled)
    tokens: list[int] = field(default_factory=list)  # prompt, then every committed token
    produced: int = 0
    anchor: int = 0
    history: mx.array | None = None  # prompt + committed tokens, for logits processors
    context: list[mx.array] = field(default_factory=list)  # hidden rows the drafter has not seen

    def subkey(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

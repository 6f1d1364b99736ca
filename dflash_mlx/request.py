"""A request in the engine (``Row``), the tokens it commits (``TokenEvent``), and which of the
engine's mechanisms a request or a model pair may use (the refusals the stats report)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.generate import StopSequences

from . import tree_verify
from .copying import Copy, CopyIndex
from .model import DFlashModel
from .models import Drafter
from .policy import Acceptance, BlockPolicy
from .sampling import Strategy
from .stats import SpeculativeStats

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

@dataclass
class TokenEvent:
    """One committed token of one request, in order.

    The request's last event has a ``finish_reason``: "stop" (``token`` is the stop token, not part
    of the answer, as in mlx_lm) or "length"; it also carries the request's acceptance record.
    ``logprobs``: with ``add(logprobs=True)``, the log-probabilities (V,) of the distribution the
    token was committed from (after logits processors, before sampling filters), as mlx_lm gives.
    """

    uid: int
    token: int
    from_draft: bool  # a proposal (drafted or copied) the target accepted
    finish_reason: str | None = None
    logprobs: mx.array | None = None
    stats: SpeculativeStats | None = None


@dataclass(eq=False)
class Row:
    """A request in the engine: its settings, random stream, caches (until it joins the batch), copy
    index, acceptance estimates and the tokens committed so far."""

    uid: int
    prompt: list[int]
    max_tokens: int
    strategy: Strategy
    processors: list[LogitsProcessor]
    matcher: StopSequences.Matcher
    key: mx.array | None
    logprobs: bool
    stats: SpeculativeStats
    acceptance: Acceptance
    block_cap: int | None  # the request's own largest block
    copies: CopyIndex | None
    cache: list | None  # one-row caches until the request joins the batch
    draft_cache: list | None
    prefilled: int = 0  # prompt tokens in the caches (from the prompt cache, then prefilled)
    cached: int = 0  # of those, the ones the prompt cache held
    tokens: list[int] = field(default_factory=list)  # prompt, then every committed token
    produced: int = 0
    anchor: int = 0
    history: mx.array | None = None  # prompt + committed tokens, for logits processors
    pending: list[mx.array] = field(default_factory=list)  # hidden rows (n, k*H) the drafter has not taken in
    copy: Copy | None = None  # this step's copy suggestion

    def subkey(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    @property
    def room(self) -> int:
        return self.max_tokens - self.produced

    @property
    def context(self) -> int:
        return len(self.tokens)

    @property
    def merges(self) -> bool:
        return self.strategy.deterministic


def apply_processors(processors: list[LogitsProcessor], history: mx.array, block: mx.array, logits: mx.array) -> mx.array:
    """Apply mlx_lm logits processors to each verify row with that row's own history."""
    rows = []
    for j in range(logits.shape[0]):
        row, seen = logits[j : j + 1], mx.concatenate([history, block[: j + 1]])
        for processor in processors:
            row = processor(seen, row)
        rows.append(row)
    return mx.concatenate(rows)


def couples(model: DFlashModel) -> bool:
    """Whether the pair samples with ``sampling.Coupled``: not with a DFlash2 drafter, whose selector
    picks among candidates the noise does not index (it keeps rejection sampling)."""
    return model.drafter.architecture == Drafter.architecture


def tree_refusal(model: DFlashModel, policy: BlockPolicy) -> str | None:
    """Why ``model``'s steps verify chains only, or None when they may verify draft trees."""
    if policy.tree_budget_setting == 0:
        return "tree_budget is 0"
    if policy.max_block_size == 1:
        return "the block size is 1"
    if not couples(model):
        return f"{model.drafter.architecture} drafters pick each proposal given the one before"
    if getattr(model.target, "start_record", None):  # distributed.Driver: the other ranks run chains
        return "a sharded target verifies chains"
    return tree_verify.refusal(model.target)


def row_tree_refusal(strategy: Strategy, processors: list | None) -> str | None:
    """Why a request's steps verify chains whatever the engine allows, or None."""
    if not hasattr(strategy, "pick_nodes"):
        return f"{strategy.name} verification follows one chain of proposals"
    if processors:
        return "logits processors see one token history per row"
    return None


def batch_refusal(model: DFlashModel) -> str | None:
    """Why the engine decodes ``model``'s requests one at a time, or None if it batches them."""
    return model.target.cache_policy.batch_refusal

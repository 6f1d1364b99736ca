"""How proposals are drawn and verified, for each way of picking tokens.

Three strategies, all lossless:
- ``Greedy``: argmax proposals, accept while they equal the target's argmax.
- ``Rejection``: temperature / top-p / top-k / min-p with known distributions p
  and q; proposals sampled from q, accepted with probability min(1, p/q).
- ``Match``: any opaque mlx_lm ``sampler``; the target row is sampled with it and
  an argmax proposal is accepted only if it equals that sample (exact for any
  sampler, but accepts less than ``Rejection``).

Every method takes an optional PRNG ``key`` (the batch engine gives each request
its own); without one, MLX's global random state is used. An opaque sampler
always draws from the global state.

``propose`` picks from any rows of scores: a DFlash drafter's logits, or one
position's candidate scores at a time for the DFlash2 selector, which places the
returned distribution back in the vocabulary (Drafter.propose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import DFlashError
from .kernels import KernelOps

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if self.temp < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise DFlashError(
                f"bad sampling settings (temp {self.temp}, top_p {self.top_p}, top_k {self.top_k}, "
                f"min_p {self.min_p}): need temp >= 0, 0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1"
            )


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Row-wise sampling distribution, the same one mlx_lm's make_sampler draws from."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logits.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return mx.softmax(logprobs / params.temp, axis=-1)


class Greedy:
    deterministic = True  # proposals are a function of the drafter's logits: copies may be merged in

    def __init__(self, ops: KernelOps):
        self.ops = ops

    def first(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def propose(self, draft_logits: mx.array, key: mx.array | None = None) -> tuple[mx.array, None]:
        return mx.argmax(draft_logits, axis=-1).astype(mx.int32), None

    def verify(self, logits: mx.array, proposals: mx.array, _q, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        return self.ops.greedy_accept(logits, proposals)


class Rejection:
    deterministic = False  # proposals are sampled: a choice between sources must not look at them

    def __init__(self, params: SamplingParams, ops: KernelOps):
        self.params, self.ops = params, ops

    def first(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        return mx.random.categorical(mx.log(probabilities(logits, self.params)), key=key).astype(mx.int32)

    def propose(self, draft_logits: mx.array, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        q = probabilities(draft_logits, self.params)
        return mx.random.categorical(mx.log(q), key=key).astype(mx.int32), q

    def verify(self, logits: mx.array, proposals: mx.array, q: mx.array | None, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """``q``: the distributions the proposals were drawn from; None for copied proposals,
        drawn from point masses (all probability on the copied token)."""
        p = probabilities(logits, self.params)
        if q is None:
            q = (mx.arange(p.shape[-1])[None] == proposals[:, None]).astype(p.dtype)
        uniforms = mx.random.uniform(shape=(logits.shape[0],), key=key)
        return self.ops.rejection_accept(p, q, proposals, uniforms)


class Match:
    deterministic = True

    def __init__(self, sampler: Sampler, ops: KernelOps):
        self.sampler, self.ops = sampler, ops

    def _sample(self, logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs).astype(mx.int32)

    def first(self, logits: mx.array, key: mx.array | None = None) -> mx.array:
        return self._sample(logits)

    def propose(self, draft_logits: mx.array, key: mx.array | None = None) -> tuple[mx.array, None]:
        return mx.argmax(draft_logits, axis=-1).astype(mx.int32), None

    def verify(self, logits: mx.array, proposals: mx.array, _q, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        return self.ops.match_accept(self._sample(logits), proposals)


Strategy = Greedy | Rejection | Match


class KeyedPicks:
    """A strategy as ``Drafter.propose`` calls it, each pick drawn with a fresh key from ``next_key``
    (the batch engine's per-request random stream)."""

    def __init__(self, strategy: Strategy, next_key: Callable[[], mx.array | None]):
        self.strategy, self.next_key, self.ops = strategy, next_key, strategy.ops

    def propose(self, scores: mx.array) -> tuple[mx.array, mx.array | None]:
        return self.strategy.propose(scores, self.next_key())


def make_strategy(params: SamplingParams, sampler: Sampler | None, ops: KernelOps) -> Strategy:
    if sampler is not None:
        return Match(sampler, ops)
    if params.temp == 0:
        return Greedy(ops)
    return Rejection(params, ops)


def token_logprobs(logits: mx.array, tokens: mx.array) -> mx.array:
    """log p of each row's token under that row's (processed) distribution."""
    logits = logits.reshape(-1, logits.shape[-1])
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(lp, tokens.reshape(-1, 1), axis=-1)[:, 0]

"""Adaptive block size: pick each step's block to maximise expected tokens per second.

A step with block ``B`` costs ``draft(B) + verify(B)`` seconds (measured once per
loaded model by ``calibrate``; optionally rescaled by the step times actually
seen) and commits ``1 + sum_k prod_{i<=k} a_i`` tokens in
expectation, where ``a_i`` is the chance the i-th proposal is accepted given the
ones before it were (tracked as an EMA of what the target accepted). When no
block beats plain decoding (``B = 1``: one target row, no draft) the policy
decodes plainly, and probes a speculative block now and then so it notices
when the text becomes predictable again.

Why measured and not assumed: on MLX the verify cost of B rows is far from
flat (quantized matmuls on CPU scale with rows), so the best block differs per
machine, model and dtype.
"""

from __future__ import annotations

import math
import time
import weakref
from bisect import bisect_left
from dataclasses import dataclass

import mlx.core as mx

from . import kernels
from .model import DFlashModel
from .sampling import Greedy

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class CostCurve:
    """Seconds per decode step on this machine: target verify and drafter forward of B rows."""

    verify: dict[int, float]
    draft: dict[int, float]

    def step_seconds(self, block_size: int) -> float:
        """Cost of one step; a block of 1 is plain decoding and runs no draft."""
        cost = _interpolate(self.verify, block_size)
        return cost if block_size == 1 else cost + _interpolate(self.draft, block_size)

    def relative(self) -> dict[int, float]:
        """Step cost of each measured block size relative to plain decoding."""
        base = self.step_seconds(1)
        return {b: self.step_seconds(b) / base for b in sorted(self.verify)}


def _interpolate(points: dict[int, float], x: int) -> float:
    xs = sorted(points)
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1) if len(xs) > 1 else 0
    if len(xs) == 1 or x == xs[i]:
        return points[xs[i]]
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def _seconds(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def calibrate(
    model: DFlashModel,
    max_block_size: int | None = None,
    context: int = 128,
    repeats: int = 5,
    use_metal: bool | None = None,
) -> CostCurve:
    """Time target verify and drafter forward for a few block sizes after ``context`` tokens.

    Uses throw-away caches; the model is left as it was. Sizes are timed in
    interleaved rounds and the fastest round kept: on a shared machine noise only
    ever adds time, and interleaving spreads a busy spell over all sizes.
    """
    target, drafter = model.target, model.drafter
    ops = kernels.get_ops(use_metal)
    max_block_size = max_block_size or model.block_size
    sizes = sorted({b for b in CALIBRATION_SIZES if b < max_block_size} | {1, max_block_size})
    # Deterministic tokens: calibration must not consume the caller's random stream.
    tokens = mx.arange(context + max(sizes), dtype=mx.int32) % target.vocab_size
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    _, hidden = target.prefill(tokens[:context], cache)
    mx.eval(hidden)
    head = target.head(drafter.vocab_rows)
    greedy = Greedy(ops)
    # The drafter's context as in steady state: the prompt absorbed, a few new rows per step.
    drafter(target.embed(tokens[:2])[None], hidden[:, :-2], draft_cache, head, ops)
    def run_verify(B: int) -> None:
        logits, h = target(tokens[context : context + B][None], cache)
        mx.eval(logits, h)
        target.rollback(cache, B)

    def run_draft(B: int) -> None:
        block = target.embed(tokens[context : context + B][None])
        proposals, _ = drafter.propose(block, tokens[context : context + 1], hidden[:, -2:], draft_cache, head, greedy)
        mx.eval(proposals)
        for c in draft_cache:
            c.trim(2)

    verify, draft = {B: float("inf") for B in sizes}, {B: float("inf") for B in sizes if B > 1}
    for i in range(repeats + 1):
        warm_up = i == 0  # first calls pay for allocation and graph setup
        for B in sizes:
            t = _seconds(lambda: run_verify(B))
            verify[B] = verify[B] if warm_up else min(verify[B], t)
            if B > 1:
                t = _seconds(lambda: run_draft(B))
                draft[B] = draft[B] if warm_up else min(draft[B], t)
    draft[1] = 0.0
    # More rows never cost less: a size that timed faster than a smaller one was noise.
    for small, large in zip(sizes, sizes[1:]):
        verify[large] = max(verify[large], verify[small])
        if small > 1:
            draft[large] = max(draft[large], draft[small])
    return CostCurve(verify, draft)


# One calibration per loaded pair, for as long as the pair lives.
_curves: "weakref.WeakKeyDictionary[DFlashModel, CostCurve]" = weakref.WeakKeyDictionary()


def cost_curve(model: DFlashModel, use_metal: bool | None = None) -> CostCurve:
    """The pair's cost curve, calibrated on its first adaptive use and remembered after."""
    if model not in _curves:
        _curves[model] = calibrate(model, use_metal=use_metal)
    return _curves[model]


class AdaptiveBlockSize:
    """A ``decode.BlockPolicy`` maximising expected tokens per second.

    prior: assumed acceptance rate before anything is observed. A position
    never tested yet borrows the rate of the deepest tested position before it:
    with the prior alone, a policy that settled on a small block would never
    learn that longer blocks get accepted. decay: EMA weight of the past per
    observation. optimism: the block is chosen with each rate raised by
    ``optimism / sqrt(observations + 1)`` (an upper confidence bound), so
    positions seen rarely, e.g. after one unlucky early rejection, get tested
    again instead of capping the block for good. probe_every: after this many
    plain steps, run one speculative step to refresh the acceptance estimates.

    timed: let observed step times rescale the calibrated cost of each block
    size used (``drift``), so choices follow what this generation really costs,
    e.g. at a context length the calibration never saw (on MLX CPU, verifying
    8+ rows at a 4k context costs far more than the short-context curve says).
    A size never used borrows the rescaling of the nearest size used (the
    per-step overhead the calibration misses applies to all). Off by default:
    block sizes then depend on timing, and with them the random draws, so
    seeded sampling would stop being reproducible (greedy output is the same
    whatever the block sizes); and on a busy machine the timings are noisy
    enough to cost more than the calibration's blind spots.
    """

    def __init__(
        self,
        curve: CostCurve,
        max_block_size: int,
        prior: float = 0.6,
        decay: float = 0.8,
        probe_every: int = 16,
        timed: bool = False,
        optimism: float = 0.3,
    ):
        self.curve, self.max_block_size = curve, max_block_size
        self.rates = [prior] * (max_block_size - 1)
        self.seen = [0] * (max_block_size - 1)  # observations per position
        self.tested = 0  # positions 0..tested-1 have been observed at least once
        self.decay, self.probe_every = decay, probe_every
        self.plain_steps = probe_every - 1  # due for a probe: the prior alone must not rule speculation out
        self.timed, self.optimism = timed, optimism
        self.drift: dict[int, float] = {}  # block size -> observed / calibrated seconds

    def rate(self, position: int, optimistic: bool = False) -> float:
        i = min(position, self.tested - 1) if self.tested else position
        bonus = self.optimism / math.sqrt(self.seen[position] + 1) if optimistic else 0.0
        return min(1.0, self.rates[i] + bonus)

    def expected_tokens(self, block_size: int, optimistic: bool = False) -> float:
        total, run = 1.0, 1.0
        for i in range(block_size - 1):
            run *= self.rate(i, optimistic)
            total += run
        return total

    def step_seconds(self, block_size: int) -> float:
        if not self.drift:
            return self.curve.step_seconds(block_size)
        nearest = min(self.drift, key=lambda b: (abs(b - block_size), b))
        return self.curve.step_seconds(block_size) * self.drift[nearest]

    def tokens_per_second(self, block_size: int, optimistic: bool = False) -> float:
        return self.expected_tokens(block_size, optimistic) / self.step_seconds(block_size)

    def best(self, smallest: int = 1) -> int:
        """The block size to use next: highest optimistic expected tokens per second."""
        return max(range(smallest, self.max_block_size + 1), key=lambda b: self.tokens_per_second(b, True))

    def next_block_size(self) -> int:
        B = self.best()
        if B > 1 or self.max_block_size == 1:
            self.plain_steps = 0
            return B
        self.plain_steps += 1
        if self.plain_steps < self.probe_every:
            return 1
        self.plain_steps = 0
        return self.best(smallest=2)

    def observe(self, block_size: int, accepted: int, seconds: float | None = None) -> None:
        # Proposal i was tested only if all before it were accepted.
        observed = min(accepted + 1, block_size - 1)
        for i in range(observed):
            if 0 < self.tested <= i:  # first sight: start from the estimate it borrowed so far
                self.rates[i] = self.rates[self.tested - 1]
            hit = 1.0 if i < accepted else 0.0
            # Averaged with the prior while there are few observations, an EMA after.
            self.seen[i] += 1
            weight = max(1 - self.decay, 1 / (self.seen[i] + 1))
            self.rates[i] += weight * (hit - self.rates[i])
        self.tested = max(self.tested, observed)
        if self.timed and seconds is not None:
            ratio = seconds / self.curve.step_seconds(block_size)
            if block_size not in self.drift:
                self.drift[block_size] = ratio
            else:
                # Clipped: one slow step (the drafter absorbing a whole prompt, a
                # busy spell) must not rule a block size out for long.
                d = self.drift[block_size]
                self.drift[block_size] = self.decay * d + (1 - self.decay) * min(ratio, 2 * d)


def make_policy(
    model: DFlashModel, max_block_size: int | None = None, use_metal: bool | None = None, **kwargs
) -> AdaptiveBlockSize:
    """An adaptive block-size policy for one generation (pass it as ``block_size``).

    Calibrates the model on first use (a second or so on small models); keyword
    arguments go to ``AdaptiveBlockSize``.
    """
    return AdaptiveBlockSize(cost_curve(model, use_metal), max_block_size or model.block_size, **kwargs)

"""What a decode step costs on this machine: calibrated once per pair, rescaled by what is seen.

``calibrate`` times target verify and drafter forward of a few block sizes (``CostCurve``,
interpolated in between); ``Drift`` keeps the ratio of observed to calibrated step times, for
policies that let real steps correct the calibration (a long context, a noisy calibration, per-row
work the calibration does not run).
"""

from __future__ import annotations

import time
import weakref
from bisect import bisect_left
from dataclasses import dataclass

import mlx.core as mx

from . import kernels
from .model import DFlashModel
from .cache.ragged import RaggedKVCache
from .sampling import Greedy

# 12 as well as the powers of two: with OpenBLAS on this 2-core x86 CPU a 16-row forward
# costs what 8 rows do and less than 12 (its kernels seem to take rows 16 at a time): 9..15 do
# not lie between 8 and 16.
CALIBRATION_SIZES = (1, 2, 4, 8, 12, 16, 32)
# Largest block of a copy-only step: no drafter bounds it, and long copies are the ones that pay.
COPY_BLOCK_SIZE = 16


@dataclass(frozen=True)
class CostCurve:
    """Seconds per decode step on this machine: target verify and drafter forward of B rows."""

    verify: dict[int, float]
    draft: dict[int, float]

    def step_seconds(self, block_size: int, draft: bool = True) -> float:
        """Cost of one step; a block of 1 is plain decoding and runs no draft, nor does a copy-only step."""
        cost = interpolate(self.verify, block_size)
        return cost + interpolate(self.draft, block_size) if draft and block_size > 1 else cost

    def relative(self) -> dict[int, float]:
        """Step cost of each measured block size relative to plain decoding."""
        base = self.step_seconds(1)
        return {b: self.step_seconds(b) / base for b in sorted(self.verify)}


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through ``points``, extended linearly past both ends."""
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
    rows: int = 1,
) -> CostCurve:
    """Time target verify and drafter forward for a few block sizes after ``context`` tokens.

    Uses throw-away caches; the model is left as it was. Sizes are timed in
    interleaved rounds and the fastest round kept: on a shared machine noise only
    ever adds time, and interleaving spreads a busy spell over all sizes. Sizes in
    between are interpolated.
    ``rows > 1`` times a batch of that many rows with the batch engine's caches.
    """
    target, drafter = model.target, model.drafter
    ops = kernels.get_ops(use_metal)
    max_block_size = max_block_size or model.block_size
    # Verify sizes up to COPY_BLOCK_SIZE: copy-only steps may verify more rows than the drafter
    # drafts (the batch engine has none).
    largest = max(max_block_size, COPY_BLOCK_SIZE) if rows == 1 else max_block_size
    sizes = sorted({b for b in CALIBRATION_SIZES if b < largest} | {1, max_block_size, largest})
    # Deterministic tokens: calibration must not consume the caller's random stream.
    tokens = mx.arange(context + max(sizes), dtype=mx.int32) % target.vocab_size
    if rows == 1:
        cache, draft_cache = target.make_cache(), drafter.make_cache()
        _, hidden = target.prefill(tokens[:context], cache)
    else:
        tokens = mx.broadcast_to(tokens, (rows, tokens.size))
        cache, draft_cache = target.make_batch_cache(rows), [RaggedKVCache(rows) for _ in drafter.layers]
        _, hidden = target(tokens[:, :context], cache)
        target.cache_policy.forget()
    tokens = tokens.reshape(rows, -1)
    mx.eval(hidden)
    head = target.head(drafter.vocab_rows)
    greedy = Greedy(ops)
    # The drafter's context as in steady state: the prompt absorbed, a few new rows per step.
    drafter(target.embed(tokens[:, :2]), hidden[:, :-2], draft_cache, head, ops)
    def run_verify(B: int) -> None:
        logits, h = target(tokens[:, context : context + B], cache)
        mx.eval(logits, h)
        target.rollback(cache, B)

    def run_draft(B: int) -> None:
        block = target.embed(tokens[:, context : context + B])
        proposals, _, _ = drafter.propose(block, tokens[:, context], hidden[:, -2:], draft_cache, head, greedy)
        mx.eval(proposals)
        for c in draft_cache:
            c.trim(2)

    verify = {B: float("inf") for B in sizes}
    draft = {B: float("inf") for B in sizes if 1 < B <= max_block_size}
    for i in range(repeats + 1):
        warm_up = i == 0  # first calls pay for allocation and graph setup
        for B in sizes:
            t = _seconds(lambda: run_verify(B))
            verify[B] = verify[B] if warm_up else min(verify[B], t)
            if B in draft:
                t = _seconds(lambda: run_draft(B))
                draft[B] = draft[B] if warm_up else min(draft[B], t)
    draft[1] = 0.0
    # Not forced to grow with B: more rows can cost less (see CALIBRATION_SIZES), and then the
    # policy should take the larger block, which also holds more proposals.
    return CostCurve(verify, draft)


# One calibration per loaded pair, for as long as the pair lives.
_curves: "weakref.WeakKeyDictionary[DFlashModel, CostCurve]" = weakref.WeakKeyDictionary()


def cost_curve(model: DFlashModel, use_metal: bool | None = None) -> CostCurve:
    """The pair's cost curve, calibrated on its first adaptive use and remembered after."""
    if model not in _curves:
        _curves[model] = calibrate(model, use_metal=use_metal)
    return _curves[model]


class Drift:
    """Observed over calibrated step seconds per block size: an EMA (``decay``) of each
    size's ratio. A size never used borrows the ratio of the nearest size used where that
    is below 1 (the whole curve runs faster than calibrated) and counts as calibrated
    otherwise: a size that looks cheaper than it is gets tried and corrected, while one
    that looked dearer would never be tried (8 rows whose blocks of 2 cost 1.35x the
    calibration lent that to plain steps and kept drafting where plain steps were faster)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.ratios: dict[int, float] = {}
        self._run: tuple[int, float, float, bool] | None = None  # steps timed together so far

    def scale(self, block_size: int) -> float:
        if not self.ratios:
            return 1.0
        if block_size in self.ratios:
            return self.ratios[block_size]
        return min(1.0, self.ratios[min(self.ratios, key=lambda b: (abs(b - block_size), b))])

    def observe(self, block_size: int, seconds: float, calibrated: float, ahead: bool = False,
                steady: bool = True) -> None:
        """A step of ``block_size`` took ``seconds`` where the calibration says ``calibrated``.

        ``ahead``: the step started the next one's forward early. It then waits for that forward
        too (one MLX evaluation holds both) and the step after it waits for almost nothing, so
        such a run of steps is timed as a whole, under its first step's block size. ``steady``:
        False when the step also did work not its own (a batch's rows joined or left, their
        caches concatenated or filtered); its run is not timed.
        """
        size, spent, expected, ok = self._run or (block_size, 0.0, 0.0, True)
        spent, expected, ok = spent + seconds, expected + calibrated, ok and steady
        self._run = (size, spent, expected, ok) if ahead else None
        if ahead or not ok:
            return
        ratio = spent / expected
        if size not in self.ratios:
            self.ratios[size] = ratio
        else:
            # Clipped: one slow step (the drafter absorbing a whole prompt, a
            # busy spell) must not rule a block size out for long.
            d = self.ratios[size]
            self.ratios[size] = self.decay * d + (1 - self.decay) * min(ratio, 2 * d)

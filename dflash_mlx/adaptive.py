"""Block policies: each step's block size, and where its proposals come from.

A step verifies ``B`` rows: the anchor and ``B - 1`` proposals, drafted, copied from earlier
text (``copying.py``), or both merged. It commits ``1 + sum_k prod_{i<=k} a_i`` tokens in
expectation, where ``a_i`` is the chance the i-th proposal of a source is accepted given the
ones before it were (``RunRates``: EMAs of what the target accepted). ``FixedBlockSize`` keeps
``B`` and only chooses the source; ``AdaptiveBlockSize`` also chooses ``B`` to maximise expected
tokens per second, from what a step costs on this machine: ``draft(B) + verify(B)`` seconds, or
``verify(B)`` alone for a copy-only step (``step_costs``: measured once per loaded pair,
optionally rescaled by the step times actually seen). When nothing beats plain decoding
(``B = 1``: one target row, no proposals) it decodes plainly, and probes a speculative block now
and then so it notices when the text becomes predictable again.

Why measured and not assumed: on MLX the verify cost of B rows is far from
flat (quantized matmuls on CPU scale with rows), so the best block differs per
machine, model and dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .copying import Copy, common_run
from .model import DFlashModel
from .step_costs import COPY_BLOCK_SIZE, CostCurve, Drift, cost_curve

# Copy runs are told apart by how much context they matched: (shortest match, ...) of each class.
COPY_MATCH_CLASSES = (2, 4, 8)
# Longest run of plain steps between two probes of a drafter that keeps missing.
MAX_PROBE_EVERY = 128


class RunRates:
    """Chances that proposal i of a run is accepted given the ones before it were.

    Averaged with the prior while a position has few observations, an EMA after (``decay``: the
    weight of the past). A position never tested borrows the rate of the deepest tested one
    before it: with the prior alone, a source that settled on short runs would never learn that
    longer ones get accepted. ``optimism`` raises each rate by ``optimism / sqrt(observations +
    1)`` for choices (an upper confidence bound), so positions seen rarely, e.g. after one unlucky
    early rejection, get tested again instead of being ruled out for good.
    """

    def __init__(self, length: int, prior: float, decay: float, optimism: float):
        self.rates = [prior] * length
        self.seen = [0] * length  # observations per position
        self.tested = 0  # positions 0..tested-1 have been observed at least once
        self.decay, self.optimism = decay, optimism

    def rate(self, position: int, optimistic: bool = False) -> float:
        i = min(position, self.tested - 1) if self.tested else position
        bonus = self.optimism / math.sqrt(self.seen[position] + 1) if optimistic else 0.0
        return min(1.0, self.rates[i] + bonus)

    def expected(self, proposals: int, optimistic: bool = False) -> float:
        """Expected accepted tokens among the first ``proposals`` of a run."""
        total, run = 0.0, 1.0
        for i in range(min(proposals, len(self.rates))):
            run *= self.rate(i, optimistic)
            total += run
        return total

    def observe(self, tested: int, accepted: int) -> None:
        """The first ``tested`` proposals were checked; the first ``accepted`` of them passed."""
        for i in range(min(tested, len(self.rates))):
            if 0 < self.tested <= i:  # first sight: start from the estimate it borrowed so far
                self.rates[i] = self.rates[self.tested - 1]
            self.seen[i] += 1
            weight = max(1 - self.decay, 1 / (self.seen[i] + 1))
            self.rates[i] += weight * ((1.0 if i < accepted else 0.0) - self.rates[i])
        self.tested = max(self.tested, min(tested, len(self.rates)))


@dataclass(frozen=True)
class Plan:
    """One step: ``block_size`` rows verified; proposals drafted (``draft``), copied (``copy``) or both merged."""

    block_size: int
    draft: bool
    copy: bool

    @property
    def plain(self) -> bool:
        return self.block_size == 1


PLAIN = Plan(1, False, False)


class BlockPolicy(Protocol):
    """Plans each step from what earlier steps accepted (``decode.speculative_decode`` asks it)."""

    max_block_size: int  # of drafted steps
    copy_block_size: int  # of copy-only steps
    acceptance: "Acceptance"

    def plan(self, copy: Copy | None, merge: bool) -> Plan: ...

    def expects_plain(self) -> bool: ...

    def record(self, plan: Plan, drafted: list[int] | None, copy: Copy | None, committed: list[int], seconds: float) -> None: ...


class Acceptance:
    """Run rates of each source: the drafter, and copies by where they came from (the text itself
    or the drafter's corpus) and how much context they matched."""

    def __init__(self, draft_length: int, copy_length: int, prior: float, decay: float, optimism: float,
                 copy_prior: float = 0.5):
        self.drafter = RunRates(draft_length, prior, decay, optimism)
        self.copies = [RunRates(copy_length, copy_prior, decay, optimism) for _ in COPY_MATCH_CLASSES]
        self.corpus_copies = [RunRates(copy_length, copy_prior, decay, optimism) for _ in COPY_MATCH_CLASSES]

    def copy_rates(self, copy: Copy) -> RunRates:
        classes = self.corpus_copies if copy.from_corpus else self.copies
        return classes[sum(copy.match >= m for m in COPY_MATCH_CLASSES) - 1]

    def copy_goes_further(self, copy: Copy, proposals: int) -> bool:
        """Whether ``copy`` is expected (optimistically) to get at least as many of ``proposals``
        accepted as the drafter: then a block holds the copy alone."""
        return self.copy_rates(copy).expected(proposals, True) >= self.drafter.expected(proposals, True)

    def record(self, drafted: list[int] | None, copy: Copy | None, committed: list[int]) -> None:
        """What each source proposed this step against what was committed: the source not followed
        is scored too (``copying.common_run``), so both keep learning from every step."""
        if drafted is not None:
            self.drafter.observe(*common_run(drafted, committed))
        if copy is not None:
            self.copy_rates(copy).observe(*common_run(copy.tokens, committed))


class FixedBlockSize:
    """Always ``block_size`` rows; copied tokens alone when copies are expected to be accepted at
    least as far as drafts (the step then skips the drafter), merged with the draft otherwise."""

    def __init__(self, block_size: int, prior: float = 0.6, decay: float = 0.8, optimism: float = 0.3):
        self.max_block_size = self.copy_block_size = block_size
        self.acceptance = Acceptance(max(block_size - 1, 1), max(block_size - 1, 1), prior, decay, optimism)

    def plan(self, copy: Copy | None, merge: bool) -> Plan:
        B, a = self.max_block_size, self.acceptance
        if B == 1:
            return PLAIN
        if copy is not None and a.copy_goes_further(copy, B - 1):
            return Plan(B, draft=False, copy=True)
        return Plan(B, draft=True, copy=copy is not None and merge)

    def expects_plain(self) -> bool:
        return self.max_block_size == 1

    def record(self, plan: Plan, drafted, copy, committed, seconds) -> None:
        self.acceptance.record(drafted, copy, committed)


class ProbeSchedule:
    """When a policy whose estimates favour plain decoding runs a speculative probe instead.

    A probe follows ``every`` plain steps; each probe after which plain decoding still wins
    doubles the wait, up to ``longest`` (text the drafter cannot predict should not keep paying
    for probes), and a step that drafts on its merits resets it. It starts due, so a low prior
    alone cannot rule speculation out.
    """

    def __init__(self, every: int, longest: int = MAX_PROBE_EVERY):
        self.every, self.wait, self.longest = every, every, longest
        self.plain_steps, self.probed = every - 1, False

    def due(self) -> bool:
        """Whether the next step that would decode plainly probes instead."""
        return self.plain_steps + 1 >= self.wait

    def probe(self, plain: bool, drafted: bool) -> bool:
        """Account for a step whose best plan is ``plain`` (``drafted``: it runs the drafter);
        True when that plain step is to be a probe."""
        probed, self.probed = self.probed, False
        if not plain:
            self.plain_steps = 0
            if drafted:
                self.wait = self.every
            return False
        if probed:
            self.wait = min(2 * self.wait, self.longest)
        self.plain_steps += 1
        if self.plain_steps < self.wait:
            return False
        self.plain_steps, self.probed = 0, True
        return True


def _fastest(options: list[tuple[float, Plan]]) -> Plan:
    """The plan with the most expected tokens per second."""
    return max(options, key=lambda option: option[0])[1]


class AdaptiveBlockSize:
    """A ``BlockPolicy`` maximising expected tokens per second.

    prior / decay / optimism: of the drafter's ``RunRates``. probe_every: after this many plain
    steps, run one speculative step to refresh the acceptance estimates (``ProbeSchedule``).
    copy_block_size: the largest copy-only block (default: ``COPY_BLOCK_SIZE`` or the
    drafted maximum if larger).

    timed: let observed step times rescale the calibrated cost of each block
    size used (``Drift``), so choices follow what this generation really costs,
    e.g. at a context length the calibration never saw (on MLX CPU, verifying
    8+ rows at a 4k context costs far more than the short-context curve says).
    Off by default:
    block sizes then depend on timing, and with them rejection sampling's
    draws (DFlash2 drafters), so seeded runs there would stop being
    reproducible (greedy and coupled sampling commit the same text whatever
    the block sizes); and on a busy machine the timings are noisy enough to
    cost more than the calibration's blind spots.
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
        copy_block_size: int | None = None,
    ):
        self.curve, self.max_block_size = curve, max_block_size
        # Copy-only steps run no drafter, so the drafter's block does not bound them.
        self.copy_block_size = copy_block_size or max(max_block_size, COPY_BLOCK_SIZE)
        longest = max(max_block_size, self.copy_block_size) - 1
        self.acceptance = Acceptance(max(max_block_size - 1, 1), max(longest, 1), prior, decay, optimism)
        self.probes = ProbeSchedule(probe_every)
        self.drift = Drift(decay) if timed else None

    def expected_tokens(self, block_size: int, optimistic: bool = False) -> float:
        """Expected tokens of a drafted step (the anchor's bonus token included)."""
        return 1.0 + self.acceptance.drafter.expected(block_size - 1, optimistic)

    def step_seconds(self, block_size: int, draft: bool = True) -> float:
        seconds = self.curve.step_seconds(block_size, draft)
        return seconds * self.drift.scale(block_size) if self.drift is not None else seconds

    def tokens_per_second(self, block_size: int, optimistic: bool = False) -> float:
        return self.expected_tokens(block_size, optimistic) / self.step_seconds(block_size)

    def best(self, smallest: int = 1) -> int:
        """The drafted block size to use next: highest optimistic expected tokens per second."""
        return max(range(smallest, self.max_block_size + 1), key=lambda b: self.tokens_per_second(b, True))

    def _options(self, copy: Copy | None, merge: bool) -> list[tuple[float, Plan]]:
        """Every plan with its optimistic expected tokens per second; plain decoding first."""
        drafter = self.acceptance.drafter
        copies = self.acceptance.copy_rates(copy) if copy is not None else None
        options = [(1.0 / self.step_seconds(1), PLAIN)]
        for B in range(2, self.max_block_size + 1):
            gain = drafter.expected(B - 1, True)
            if copies is not None and merge:  # the merge follows the better source after they differ
                gain = max(gain, copies.expected(B - 1, True))
            options.append(((1 + gain) / self.step_seconds(B), Plan(B, True, copies is not None and merge)))
        if copies is not None:
            for B in range(2, self.copy_block_size + 1):
                gain = copies.expected(B - 1, True)
                options.append(((1 + gain) / self.step_seconds(B, draft=False), Plan(B, False, True)))
        return options

    def plan(self, copy: Copy | None, merge: bool) -> Plan:
        options = self._options(copy, merge)
        plan = _fastest(options)
        if self.probes.probe(plan.plain and self.max_block_size > 1, plan.draft):
            return _fastest(options[1:])
        return plan

    def expects_plain(self) -> bool:
        """Whether the next step decodes plainly unless a copy turns up."""
        if self.probes.due():
            return False
        return _fastest(self._options(None, False)).plain

    def next_block_size(self) -> int:
        """The next drafted block size when there is nothing to copy."""
        return self.plan(None, False).block_size

    def record(self, plan: Plan, drafted, copy, committed, seconds) -> None:
        self.acceptance.record(drafted, copy, committed)
        self._time(plan, seconds)

    def observe(self, block_size: int, accepted: int, seconds: float | None = None) -> None:
        """A drafted step of ``block_size`` rows whose first ``accepted`` proposals passed."""
        if block_size > 1:
            self.acceptance.drafter.observe(min(accepted + 1, block_size - 1), accepted)
        self._time(Plan(block_size, block_size > 1, False), seconds)

    def _time(self, plan: Plan, seconds: float | None) -> None:
        if self.drift is not None and seconds is not None:
            self.drift.observe(plan.block_size, seconds, self.curve.step_seconds(plan.block_size, plan.draft))


def make_policy(
    model: DFlashModel, max_block_size: int | None = None, use_metal: bool | None = None, **kwargs
) -> AdaptiveBlockSize:
    """An adaptive block-size policy for one generation (pass it as ``block_size``).

    Calibrates the model on first use (a second or so on small models); keyword
    arguments go to ``AdaptiveBlockSize``. A ``max_block_size`` given bounds copy-only
    blocks too.
    """
    if max_block_size is not None:
        kwargs.setdefault("copy_block_size", max_block_size)
    return AdaptiveBlockSize(cost_curve(model, use_metal), max_block_size or model.block_size, **kwargs)

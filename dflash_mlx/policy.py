"""Block policy: each step's block size, and where each row's proposals come from.

A step verifies ``B`` tokens per row: the anchor and ``B - 1`` proposals, drafted, copied from
earlier text (``copying.py``), or both merged. A row commits ``1 + sum_k prod_{i<=k} a_i`` tokens in
expectation, where ``a_i`` is the chance that its i-th proposal from a source is accepted given the
ones before it were (``RunRates``: EMAs of what the target accepted, per row and per source:
``Acceptance``). A fixed block size only chooses the source; ``"auto"`` also chooses ``B`` (and
whether to run the drafter at all) to maximise the rows' expected tokens per second, from what a step
of R rows costs on this machine at the context in use (``costs.py``). When nothing beats plain
decoding (``B = 1``: one target row per request, no proposals) it decodes plainly, and probes a
speculative block now and then so it notices when the text becomes predictable again.

Why measured and not assumed: on MLX the verify cost of B rows is far from flat (quantized matmuls
scale with rows, on Metal most of all in the 2-16 row range), so the best block differs per machine,
model, dtype, batch and context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import mlx.core as mx
import numpy as np

from .copying import Copy, common_run
from .costs import COPY_BLOCK_SIZE, Costs, Drift, Overlap, costs, overlap
from .errors import DFlashError
from .model import MAX_BLOCK_SIZE, DFlashModel
from .tree import DraftTree

# Copy runs are told apart by how much context they matched: (shortest match, ...) of each class.
COPY_MATCH_CLASSES = (2, 4, 8)
# Longest run of plain steps between two probes of a drafter that keeps missing.
MAX_PROBE_EVERY = 128


class RunRates:
    """Chances that proposal i of a run is accepted given the ones before it were.

    Averaged with the prior while a position has few observations, an EMA after (``decay``: the
    weight of the past). A position never tested borrows the rate of the deepest tested one
    before it: with the prior alone, a source that settled on short runs would never learn that
    longer ones get accepted. ``optimistic`` choices add ``optimism / sqrt(runs + 1)`` to the
    rates of the positions tested so far and of the first one past them (an upper confidence
    bound; ``runs``: how often the source was tested at all), so a source tried rarely, e.g. after
    one unlucky early rejection, gets tried again instead of being ruled out for good. The bonus
    shrinks with the source's runs, not with each position's observations: a deep position is
    observed only when a run gets there, so a source that is seldom right keeps few observations
    there, and a bonus by them would keep betting long blocks on it. Positions further out get
    none, so a run is explored a position deeper at a time: after one lucky run, a block to the end
    would be a bet that nothing measured backs, and at a long context each verify row costs dearly.

    ``drifts``: the source's rate moves along the text, as the drafter's does (it drafts boilerplate
    far and prose hardly at all). Its EMA then remembers about ``(1 + decay) / (1 - decay)`` runs,
    and ``runs`` counts no more than that: a few misses after a hundred runs leave it tried again,
    not idle while the text turns predictable. A copy class pools copies from all over the text,
    a mean that holds; a floor there kept betting blocks on seldom-right classes at 8k tokens.
    """

    def __init__(self, length: int, prior: float, decay: float, drifts: bool = False):
        self.rates = [prior] * length
        self.seen = [0] * length  # observations per position
        self.tested = 0  # positions 0..tested-1 have been observed at least once
        self.decay = decay
        self.memory = (1 + decay) / (1 - decay) if drifts else math.inf

    def rate(self, position: int, optimism: float = 0.0) -> float:
        i = min(position, self.tested - 1) if self.tested else position
        bonus = optimism / math.sqrt(min(self.seen[0], self.memory) + 1) if position <= self.tested else 0.0
        return min(1.0, self.rates[i] + bonus)

    def expected(self, proposals: int, optimism: float = 0.0) -> float:
        """Expected accepted tokens among the first ``proposals`` of a run."""
        return self.expectations(proposals, optimism)[-1]

    def expectations(self, proposals: int, optimism: float = 0.0) -> list[float]:
        """``expected(n)`` for n = 0 .. ``proposals`` (a run of more than ``len(rates)`` stops there)."""
        out, run = [0.0], 1.0
        for i in range(min(proposals, len(self.rates))):
            run *= self.rate(i, optimism)
            out.append(out[-1] + run)
        return out + [out[-1]] * (proposals + 1 - len(out))

    def observe(self, tested: int, accepted: int) -> None:
        """The first ``tested`` proposals were checked; the first ``accepted`` of them passed."""
        for i in range(min(tested, len(self.rates))):
            if 0 < self.tested <= i:  # first sight: start from the estimate it borrowed so far
                self.rates[i] = self.rates[self.tested - 1]
            self.seen[i] += 1
            weight = max(1 - self.decay, 1 / (self.seen[i] + 1))
            self.rates[i] += weight * ((1.0 if i < accepted else 0.0) - self.rates[i])
        self.tested = max(self.tested, min(tested, len(self.rates)))


class DepthCalibration:
    """How right the drafter's path probabilities are, by depth: observed over predicted acceptance
    (EMAs with ``decay``), which turns a draft tree's node scores into expected accepted tokens.

    A tree's nodes at one depth are exclusive (at most one is accepted), so the sum of their path
    probabilities predicts the chance that the walk gets that deep, were the drafter calibrated.
    """

    def __init__(self, depths: int, decay: float):
        self.observed, self.predicted, self.decay = [1.0] * (depths + 1), [1.0] * (depths + 1), decay

    def _reach(self, tree: DraftTree, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Per node of ``row`` in order, its depth and path probability."""
        n = int(tree.sizes[row])
        return tree.depths[row, 1:n], np.exp(tree.scores[row, 1:n])

    def expected(self, tree: DraftTree, row: int) -> np.ndarray:
        """Expected accepted proposals of the tree's first n nodes, for n = 1 .. N (nodes are
        added best first, so each prefix is the budget-best tree of its size)."""
        depths, probs = self._reach(tree, row)
        reach = np.zeros(len(self.observed))
        out = np.zeros(tree.shape[1])
        for i, (d, p) in enumerate(zip(depths, probs), start=1):
            reach[d] += p
            factors = np.minimum.accumulate(np.minimum(1.0, reach[1:] * self._factors()[1:]))
            out[i] = factors.sum()
        out[len(depths) + 1 :] = out[len(depths)]
        return out

    def _factors(self) -> np.ndarray:
        return np.array(self.observed) / np.maximum(np.array(self.predicted), 1e-9)

    def observe(self, tree: DraftTree, row: int, accepted: int) -> None:
        """The walk through row ``row``'s tree accepted ``accepted`` proposals."""
        depths, probs = self._reach(tree, row)
        reach = np.bincount(depths, probs, minlength=len(self.observed))
        for d in range(1, int(depths.max(initial=0)) + 1):
            self.observed[d] += (1 - self.decay) * (float(accepted >= d) - self.observed[d])
            self.predicted[d] += (1 - self.decay) * (reach[d] - self.predicted[d])


class Acceptance:
    """One row's run rates per source: the drafter, and copies by where they came from (the text
    itself or the drafter's corpus) and how much context they matched; and how right the drafter's
    probabilities are by depth, for draft trees."""

    def __init__(self, draft_length: int, copy_length: int, prior: float = 0.6, decay: float = 0.8,
                 copy_prior: float = 0.5):
        self.drafter = RunRates(draft_length, prior, decay, drifts=True)
        self.depths = DepthCalibration(draft_length, decay)
        self.trees: np.ndarray | None = None  # expected accepted proposals of a tree of n (``grew``)
        self.decay = decay
        self.copies = [RunRates(copy_length, copy_prior, decay) for _ in COPY_MATCH_CLASSES]
        self.corpus_copies = [RunRates(copy_length, copy_prior, decay) for _ in COPY_MATCH_CLASSES]

    def grew(self, expected: np.ndarray) -> None:
        """A draft tree was grown for the row: ``expected`` accepted proposals of its first n nodes
        (``DepthCalibration.expected``). Their EMA values the next drafted step as the tree it will
        become, where its top chain alone (``drafter``) would undervalue it."""
        if self.trees is None or self.trees.shape != expected.shape:
            self.trees = expected
        else:
            self.trees = self.trees + (1 - self.decay) * (expected - self.trees)

    def copy_rates(self, copy: Copy) -> RunRates:
        classes = self.corpus_copies if copy.from_corpus else self.copies
        return classes[sum(copy.match >= m for m in COPY_MATCH_CLASSES) - 1]

    def copy_goes_further(self, copy: Copy, proposals: int, optimism: float = 0.0) -> bool:
        """Whether ``copy`` is expected to get at least as many of ``proposals`` accepted as the
        drafter: then a block holds the copy alone."""
        return self.copy_rates(copy).expected(proposals, optimism) >= self.drafter.expected(proposals, optimism)

    def record(self, drafted: list[int] | None, copy: Copy | None, committed: list[int]) -> None:
        """What each source proposed this step against what was committed: the source not followed
        is scored too (``copying.common_run``), so both keep learning from every step."""
        if drafted is not None:
            self.drafter.observe(*common_run(drafted, committed))
        if copy is not None:
            self.copy_rates(copy).observe(*common_run(copy.tokens, committed))


class Row(Protocol):
    """What the policy reads of a running request (``request.Row``)."""

    acceptance: Acceptance
    copy: Copy | None  # this step's copy suggestion
    block_cap: int | None  # the request's own largest block
    room: int  # tokens it may still produce
    context: int  # tokens in its target cache

    @property
    def merges(self) -> bool: ...  # whether its proposals may merge a copy into a draft


@dataclass(frozen=True)
class Plan:
    """One step: ``block_size`` tokens verified per row, after a drafter forward (``draft``) or not
    (plain decoding, or copies alone); with ``tree``, the drafter's whole block grows a draft tree
    and ``block_size`` is its size (anchor included) as far as the plan knows it: the tree's own
    budget is chosen once it is grown (``BlockPolicy.tree_budget``)."""

    block_size: int
    draft: bool
    tree: bool = False

    @property
    def plain(self) -> bool:
        return self.block_size == 1


PLAIN = Plan(1, False)


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


class BlockPolicy:
    """The block size of every step, fixed or ``auto``, for the rows running then.

    costs: the pair's ``Costs`` for ``auto`` (None: a fixed ``max_block_size``). Rows' estimates
    start at ``prior`` and follow what was accepted with ``decay``. ``optimism`` is the bonus for
    rarely tested positions (``RunRates``), divided among the rows of a step: a wrong guess costs
    every row's verify, so a batch weighs what it measured. probe_every: after this many plain
    steps, one speculative step refreshes the estimates (``ProbeSchedule``). copy_block_size: the
    largest copy-only block (default: ``COPY_BLOCK_SIZE`` or the drafted maximum if larger).
    timed: multi-row steps' observed times rescale their calibrated cost (``Drift``): the
    calibration of several rows is the noisiest, and per-row work (picks, copies, rollback) is not in
    it. Single rows stay untimed: there timing noise cost more than it corrected
    (benchmarks/results/README.md).
    """

    def __init__(self, max_block_size: int, costs: Costs | None = None, *, prior: float = 0.6, decay: float = 0.8,
                 optimism: float = 0.3, probe_every: int = 16, copy_block_size: int | None = None,
                 timed: bool = True, tree_budget: int | str = "auto", overlap: Overlap | None = None):
        self.costs, self.max_block_size = costs, max_block_size
        self.overlap = overlap  # whether running ahead frees the host here (None: take it that it does)
        self.tree_budget_setting = tree_budget
        self.prior, self.decay, self.optimism = prior, decay, optimism
        # Copy-only steps run no drafter, so the drafter's block does not bound them.
        self.copy_block_size = copy_block_size or (max(max_block_size, COPY_BLOCK_SIZE) if costs else max_block_size)
        self.probes = ProbeSchedule(probe_every)
        self.drift = Drift(decay) if timed and costs else None
        self.last_rows = 0  # rows of the last step observed

    @property
    def adaptive(self) -> bool:
        return self.costs is not None

    @property
    def max_tree_budget(self) -> int:
        """Most proposals a tree holds: as many as the calibration timed verify rows for (auto),
        the drafter's block without it, or the budget asked for."""
        if self.tree_budget_setting != "auto":
            return self.tree_budget_setting
        return max(self.costs.ready(1).rows[1].verify) - 1 if self.adaptive else self.max_block_size - 1

    def tree_budget(self, rows: list[Row], grown: DraftTree, waiting: bool = False) -> int:
        """Proposals per row to verify of ``grown``'s best-first trees: the most value per second
        (``worth``) from the rows' expected tokens (their ``DepthCalibration``) at what verifying
        that many costs here; without a calibration, or at a fixed budget, all of them. The rows keep
        those expected tokens for their next plans (``Acceptance.grew``)."""
        N = grown.shape[1]
        if not self.adaptive:
            return N - 1
        expected = [r.acceptance.depths.expected(grown, i) for i, r in enumerate(rows)]
        for r, e in zip(rows, expected):
            r.acceptance.grew(e)
        if self.tree_budget_setting != "auto":
            return N - 1
        value = [self.worth(rows, [1 + e[n - 1] for e in expected], waiting) /
                 self.step_seconds(rows, Plan(n, True, tree=True)) for n in range(2, N + 1)]
        return int(np.argmax(value)) + 1

    @staticmethod
    def worth(rows: list[Row], tokens: list[float], waiting: bool) -> float:
        """What a step committing ``tokens`` (expected, per row) is worth. With requests waiting to
        join, a row that finishes sooner frees its place for one: every token counts. With none
        waiting the rows are a closed batch, done when its slowest row is, and fewer rows cost
        little less per step here (``costs.py``): a step is worth how far it brings the row with the
        most steps left, as the share of its room it commits."""
        if waiting:
            return sum(tokens)
        return min(t / max(r.room, 1) for t, r in zip(tokens, rows))

    def acceptance(self) -> Acceptance:
        """A new row's estimates."""
        longest = max(self.max_block_size, self.copy_block_size) - 1
        return Acceptance(max(self.max_block_size - 1, 1), max(longest, 1), self.prior, self.decay)

    def step_seconds(self, rows: list[Row], plan: Plan, head_start: bool = False) -> float:
        """What a step of ``plan`` costs here (``_calibrated``), rescaled by the drift for several rows."""
        seconds = self._calibrated(rows, plan, head_start)
        return seconds * self.drift.scale(plan.block_size) if self.drift is not None and len(rows) > 1 else seconds

    def _calibrated(self, rows: list[Row], plan: Plan, head_start: bool) -> float:
        """The calibration's seconds for a step of ``plan``. ``head_start``: the step before already
        ran this step's anchors (the engine runs a plain step's successor ahead when plain steps are
        expected), so proposals, e.g. a copy that turned up since, take a second forward of B - 1
        tokens per row after that one: a block then costs both."""
        R, B = len(rows), plan.block_size
        context = sum(r.context for r in rows) / R
        table = self.costs.ready(R)
        if plan.tree:  # the drafter's forward is over its whole block, whatever the tree's size
            seconds = table.step_seconds(R, B, False, context) + table.draft_seconds(R, self.max_block_size)
        else:
            seconds = table.step_seconds(R, B, plan.draft, context)
        if head_start and B > 1:  # the anchors' forward and the proposals' in place of one of B
            verify = partial(table.step_seconds, R, draft=False, context=context)
            seconds += verify(1) + verify(B - 1) - verify(B)
        return seconds

    def _gain(self, row: Row, plan: Plan, optimism: float, copies: bool, chain: list[float]) -> float:
        """Expected accepted proposals of ``row`` in a step of ``plan`` (its copy counted if ``copies``;
        ``chain``: its drafter's ``expectations``); a tree's as its recent trees of that size were
        worth (``Acceptance.grew``), at least its top chain's."""
        n = plan.block_size - 1
        copy = 0.0
        if copies and row.copy is not None and n:  # a copy proposes as many tokens as it holds
            copy = row.acceptance.copy_rates(row.copy).expected(min(n, len(row.copy.tokens)), optimism)
        if not plan.draft:
            return copy
        drafted = chain[min(n, len(chain) - 1)]
        trees = row.acceptance.trees
        if plan.tree and trees is not None:
            drafted = max(drafted, float(trees[min(n, len(trees) - 1)]))
        return max(drafted, copy)  # merged, or the copy alone where it goes further

    def _options(self, rows: list[Row], copies: bool = True, waiting: bool = False,
                 head_start: bool = False, trees: bool = False) -> list[tuple[float, Plan]]:
        """Every plan with its value per second (``worth``; ``waiting``: requests wait to join;
        ``head_start``: ``_calibrated``); plain first. ``copies``: count the rows' copy suggestions
        (else as if there were none). ``trees``: a drafted step grows a draft tree, of any size
        the budget allows (``tree_budget``)."""
        limit = self._limit(rows)
        optimism = self.optimism / len(rows)
        if trees and limit > 1:
            sizes = range(2, self.max_tree_budget + 2) if self.tree_budget_setting == "auto" else [self.max_tree_budget + 1]
            plans = [PLAIN] + [Plan(n, True, tree=True) for n in sizes]
        else:
            plans = [PLAIN] + [Plan(B, True) for B in range(2, min(self.max_block_size, limit) + 1)]
        if copies and any(r.copy is not None for r in rows):
            plans += [Plan(B, False) for B in range(2, min(self.copy_block_size, limit) + 1)]
        chains = [r.acceptance.drafter.expectations(self.max_block_size - 1, optimism) for r in rows]
        return [(self.worth(rows, [1 + self._gain(r, p, optimism, copies, c) for r, c in zip(rows, chains)], waiting)
                 / self.step_seconds(rows, p, head_start), p) for p in plans]

    @staticmethod
    def _limit(rows: list[Row]) -> int:
        """Most tokens per row worth verifying: no row's own cap exceeded, none past every row's end."""
        return min([max(r.room for r in rows)] + [r.block_cap for r in rows if r.block_cap])

    def plan(self, rows: list[Row], waiting: bool = False, head_start: bool = False, trees: bool = False) -> Plan:
        """This step's plan (``waiting``: requests wait to join; ``head_start``: its anchors ran
        already; ``trees``: a drafted step may grow draft trees; ``_options``). A fixed size runs the
        drafter unless every row's copy is expected to go at least as far (the step then skips the drafter)."""
        limit = self._limit(rows)
        if not self.adaptive:
            B = min(self.max_block_size, limit)
            if B == 1:
                return PLAIN
            copies = all(r.copy is not None and r.acceptance.copy_goes_further(r.copy, B - 1, self.optimism)
                         for r in rows)
            return Plan(B, not copies, tree=trees and not copies)
        options = self._options(rows, waiting=waiting, head_start=head_start, trees=trees)
        plan = max(options, key=lambda o: o[0])[1]
        if self.probes.probe(plan.plain and self.max_block_size > 1 and limit > 1, plan.draft):
            return max(options[1:], key=lambda o: o[0])[1]
        return plan

    @property
    def runs_ahead(self) -> bool:
        """Whether a plain step expected to be followed by another starts that one's forward early."""
        return self.overlap is None or self.overlap.frees_host

    def start_ahead(self, arrays) -> None:
        """Hand the next step's early forward to MLX (``Overlap.start``)."""
        if self.overlap is None:
            mx.async_eval(arrays)
        else:
            self.overlap.start(arrays)

    def describe_run_ahead(self) -> str:
        return "on" if self.overlap is None else self.overlap.describe()

    def expects_plain(self, rows: list[Row], waiting: bool = False, trees: bool = False) -> bool:
        """Whether the next step decodes plainly unless a copy turns up (the engine then starts it
        early, where that frees the host: ``runs_ahead``; ``trees``: as in ``plan``)."""
        if any(r.block_cap == 1 for r in rows) or self.max_block_size == 1:
            return True
        if not self.adaptive or self.probes.due():
            return False
        return max(self._options(rows, copies=False, waiting=waiting, trees=trees), key=lambda o: o[0])[1].plain

    def observe(self, rows: list[Row], plan: Plan, seconds: float, ahead: bool = False,
                head_start: bool = False) -> None:
        """A step of ``plan`` over ``rows`` took ``seconds``; ``ahead``: it started the next step's
        forward early (``Drift.observe``); ``head_start``: its own anchors ran in the step before
        (``_calibrated``). A step after rows joined or left also joined or filtered their caches:
        its run is not timed."""
        R = len(rows)
        steady, self.last_rows = R == self.last_rows, R
        if self.drift is not None and R > 1:
            self.drift.observe(plan.block_size, seconds, self._calibrated(rows, plan, head_start), ahead, steady)


def make_policy(model: DFlashModel, block_size: int | str | None = None, use_metal: bool | None = None,
                **kwargs) -> BlockPolicy:
    """The block policy of ``block_size``: an int (fixed), ``"auto"`` (adaptive; calibrates the pair
    on first use: ``costs.py``) or None (the drafter's block size, fixed);
    keyword arguments go to ``BlockPolicy``."""
    if block_size == "auto":
        return BlockPolicy(model.block_size, costs(model, use_metal), overlap=overlap(model), **kwargs)
    block_size = model.block_size if block_size is None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise DFlashError(f"block size {block_size!r} is not an integer or 'auto'")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise DFlashError(f"block size {block_size} is out of range: use 1..{MAX_BLOCK_SIZE} or 'auto'")
    return BlockPolicy(block_size, overlap=overlap(model), **kwargs)

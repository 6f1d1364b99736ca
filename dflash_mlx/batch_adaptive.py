"""Block size per batch step: the adaptive policy (``adaptive.py``) over R rows.

A batch step of R rows with block B costs ``draft(R, B) + verify(R, B)``
seconds, measured at a few row counts (``calibrate`` with ``rows``) and
interpolated linearly in R, and commits the sum over the rows of each row's
expected tokens at B, each row's acceptance tracked on its own. Every step
takes the B with the most expected tokens per second for the rows running
then: the more rows, the more a long block costs against what it gains, and
on this CPU a batch of 8 verifying 16 tokens each is 128 target rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from .adaptive import AdaptiveBlockSize, ProbeSchedule
from .step_costs import CostCurve, Drift, calibrate, interpolate
from .model import DFlashModel

CALIBRATION_ROWS = (1, 2, 4, 8)


@dataclass(frozen=True)
class RowCostCurve:
    """Seconds per batch step for a few row counts (``CostCurve`` at each)."""

    curves: dict[int, CostCurve]

    def step_seconds(self, rows: int, block_size: int) -> float:
        return interpolate({r: c.step_seconds(block_size) for r, c in self.curves.items()}, rows)


def calibrate_rows(
    model: DFlashModel,
    rows: tuple[int, ...] = CALIBRATION_ROWS,
    max_block_size: int | None = None,
    repeats: int = 2,
    use_metal: bool | None = None,
) -> RowCostCurve:
    """``step_costs.calibrate`` at each row count in ``rows``."""
    curves = {r: calibrate(model, max_block_size, repeats=repeats, use_metal=use_metal, rows=r) for r in sorted(rows)}
    # More rows never cost less: a count that timed faster than a smaller one was noise.
    for small, large in zip(sorted(rows), sorted(rows)[1:]):
        a, b = curves[small], curves[large]
        curves[large] = CostCurve(
            {k: max(v, a.verify[k]) for k, v in b.verify.items()}, {k: max(v, a.draft[k]) for k, v in b.draft.items()}
        )
    return RowCostCurve(curves)


_curves: "weakref.WeakKeyDictionary[DFlashModel, RowCostCurve]" = weakref.WeakKeyDictionary()


def row_cost_curve(model: DFlashModel, use_metal: bool | None = None) -> RowCostCurve:
    """The pair's batch cost curve, calibrated on first use and remembered after."""
    if model not in _curves:
        _curves[model] = calibrate_rows(model, use_metal=use_metal)
    return _curves[model]


class BatchBlockSize:
    """The block size of each batch step: the B with the most expected tokens per second
    (optimistic by the rows' ``optimism``) summed over the running rows (``next_block_size``;
    one ``AdaptiveBlockSize`` per row from ``track``, which the engine feeds that row's own
    outcomes). A run of ``probe_every`` plain steps is followed by a speculative probe, so a low
    prior or an unlucky start cannot rule speculation out for good. Unlike one row's, the wait does not back off: in
    a batch, copies are proposed only on drafted steps, and with the backoff 4 MT-Bench clients
    measured 0.80x of mlx_lm's BatchGenerator against 0.97x without it (bench_batch.py).

    timed: the engine's measured step times rescale the calibrated cost of each block size
    (``Drift``, as in ``AdaptiveBlockSize``). The calibration's few rounds of 8 rows are
    noisy: one that timed plain steps 12% slow had 8 MT-Bench rows draft blocks of 2 at
    0.85x of mlx_lm where plain steps ran at 0.99x; and the rows' own per-step work (picks,
    copies, rollback) is not in it. Block sizes then depend on timing, as they already do on
    the calibration and on the neighbours' acceptance.
    """

    def __init__(self, curve: RowCostCurve, max_block_size: int, probe_every: int = 16, timed: bool = False,
                 **row_kwargs):
        self.row_curve, self.max_block_size = curve, max_block_size
        self.probes = ProbeSchedule(probe_every, longest=probe_every)
        self.drift = Drift(row_kwargs.get("decay", 0.8)) if timed else None
        self.last_rows = 0  # rows of the last step observed
        self.row_kwargs = row_kwargs

    def track(self) -> AdaptiveBlockSize:
        """A new row's acceptance tracker (prior, decay and optimism from ``row_kwargs``)."""
        return AdaptiveBlockSize(self.row_curve.curves[min(self.row_curve.curves)], self.max_block_size,
                                 **self.row_kwargs)

    def step_seconds(self, rows: int, block_size: int) -> float:
        seconds = self.row_curve.step_seconds(rows, block_size)
        return seconds * self.drift.scale(block_size) if self.drift is not None else seconds

    def observe(self, rows: int, block_size: int, seconds: float, ahead: bool = False) -> None:
        """A step of ``rows`` rows and ``block_size`` took ``seconds``; ``ahead``: it started the
        next step's forward early (used when timed; ``Drift.observe``). A step after rows joined
        or left also joined or filtered their caches: its run is not timed."""
        if self.drift is None:
            return
        steady, self.last_rows = rows == self.last_rows, rows
        self.drift.observe(block_size, seconds, self.row_curve.step_seconds(rows, block_size), ahead, steady)

    def tokens_per_second(self, trackers: list[AdaptiveBlockSize], block_size: int) -> float:
        expected = sum(t.expected_tokens(block_size, True) for t in trackers)
        return expected / self.step_seconds(len(trackers), block_size)

    def best(self, trackers: list[AdaptiveBlockSize], smallest: int = 1) -> int:
        return max(range(smallest, self.max_block_size + 1), key=lambda b: self.tokens_per_second(trackers, b))

    def expects_plain(self, trackers: list[AdaptiveBlockSize]) -> bool:
        """Whether the next step decodes plainly (the engine then starts it early)."""
        if self.max_block_size == 1:
            return True
        return not self.probes.due() and self.best(trackers) == 1

    def next_block_size(self, trackers: list[AdaptiveBlockSize]) -> int:
        B = self.best(trackers)
        if self.probes.probe(B == 1 and self.max_block_size > 1, B > 1):
            return self.best(trackers, 2)
        return B


def make_batch_policy(
    model: DFlashModel, max_block_size: int | None = None, use_metal: bool | None = None, **kwargs
) -> BatchBlockSize:
    """A timed batch block-size policy for one engine; calibrates the pair on first use.

    Rows weigh their acceptance rates as measured (``optimism`` 0; one row's generation adds a
    bonus to rarely tested positions): a batch's wrong guess costs R rows' verify, and on the
    built-in pair (bench_batch's race, 1/4/8 clients, 64 tokens, against mlx_lm batched) the
    bonus cost GSM8K 1.35x/1.21x/1.00x -> 1.27x/1.16x/0.95x and MT-Bench at 4/8 clients
    1.01x/0.99x -> 0.96x/0.87x (its probes of 8 rows drafted blocks of 4 to 7).
    """
    kwargs.setdefault("timed", True)
    kwargs.setdefault("optimism", 0.0)
    return BatchBlockSize(row_cost_curve(model, use_metal), max_block_size or model.block_size, **kwargs)

"""What a decode step costs on this machine: timed once per pair, rescaled by what is seen.

A step of R rows verifies B tokens per row in one target forward, after one drafter forward that
drafted them (none for a plain step, B = 1, or a copy-only one). ``calibrate`` times both for a few
block sizes after a short context, and the target forward again after longer ones: a verify row's
cost grows with the keys it attends to, so a step is priced at the context in use (``StepCosts``,
linear between the contexts timed and beyond). Row counts are timed as the engine first runs them (``Costs``).
``Drift`` keeps the ratio of observed to calibrated step times, for multi-row steps, whose few
calibration rounds are the noisiest and miss each row's own per-step work.

A calibration is kept on disk (``calibration_dir()``, one JSON file per key), so that only a pair's
first process on a machine pays for it: the key names the pair's configs and
weights, this machine, the kernels, the software and the calibration's own settings, and a file
whose key, format or figures are not what they should be is skipped with a log line and replaced by
a fresh calibration. Removing the folder makes the next process measure again.

``PrefillChunks`` times prefill forwards of a few sizes the same way, once, and keeps which size
costs least per prompt token: the engine's default chunk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
import weakref
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import mlx.core as mx

from . import BLAS, kernels
from .cache.layout import pair_digest, software, target_digest
from .default import cache_dir
from .errors import one_line
from .model import DFlashModel
from .sampling import Greedy

# 12 as well as the powers of two: with OpenBLAS on a 2-core x86 CPU a 16-row forward cost what
# 8 rows do and less than 12 (its kernels seem to take rows 16 at a time): 9..15 do not lie
# between 8 and 16 there.
CALIBRATION_SIZES = (1, 2, 4, 8, 12, 16, 32)
# Largest block of a copy-only step, and the nodes a draft tree may hold with auto: no drafter bounds
# them, and long copies are the ones that pay.
COPY_BLOCK_SIZE = 16
# The contexts a verify is timed at; priced linearly between them and past the last along the
# last stretch. A verify's cost per key grows past 4k tokens on a CPU, so a line through 128 and 4k
# alone priced 2-row steps at 8k under what they cost (benchmarks/results/README.md, twentieth stop).
SHORT_CONTEXT, LONG_CONTEXTS = 128, (4096, 8192)
CONTEXTS = (SHORT_CONTEXT, *LONG_CONTEXTS)
# Rounds a calibration of one row and of several rows times (after a warm-up round): odd, so that
# a median is one of them.
ROUNDS, BATCH_ROUNDS = 7, 3
ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # batch sizes timed (others interpolated)
# Runs ahead timed to learn whether running ahead frees the host, and the least share of a forward
# left running after async_eval returns (``Overlap``) for it to.
OVERLAP_SAMPLES, RUN_AHEAD_OVERLAP = 3, 0.5
KEPT_FORMAT = "dflash-mlx step costs 2"  # bump when what a kept calibration's figures mean changes
# Prompt tokens per prefill forward a calibration times (the largest is mlx_lm's prefill step).
PREFILL_CHUNKS = (128, 256, 512, 1024, 2048)
PREFILL_FORMAT = "dflash-mlx prefill chunks 1"
# A larger chunk within this of the cheapest per token is taken (``PrefillChunks``): it leaves
# fewer short remainders, and a forward has costs this timing on an empty cache does not see (the
# drafter's share, reading a long cache). Timing stops at the first chunk CHUNK_STOP times dearer
# per token than the cheapest before it.
CHUNK_TOLERANCE, CHUNK_STOP = 1.1, 1.25
log = logging.getLogger("dflash_mlx.costs")


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through ``points``, extended linearly past both ends."""
    xs = sorted(points)
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1) if len(xs) > 1 else 0
    if len(xs) == 1 or x == xs[i]:
        return points[xs[i]]
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class RowCosts:
    """Seconds per step of one row count: target verify and drafter forward of B tokens per row,
    after ``SHORT_CONTEXT`` tokens."""

    verify: dict[int, float]
    draft: dict[int, float]


@dataclass
class StepCosts:
    """Seconds per decode step by rows, block size and context.

    ``per_key``: from each timed context on (``SHORT_CONTEXT`` first) to the next, per block size
    the seconds a verify row pays per context token; the default: costs that do not grow."""

    rows: dict[int, RowCosts]
    per_key: dict[int, dict[int, float]] = field(default_factory=lambda: {SHORT_CONTEXT: {1: 0.0}})
    source: ClassVar[str] = "given"  # where the figures came from (``Costs.source``), for the stats

    def step_seconds(self, rows: int, block_size: int, draft: bool = True, context: float = SHORT_CONTEXT) -> float:
        """A step of ``rows`` rows verifying ``block_size`` tokens each, ``draft``: after a drafter
        forward; ``context``: the rows' mean context length."""
        starts = sorted(self.per_key)
        keys = sum(max(min(context, end) - start, 0) * interpolate(self.per_key[start], block_size)
                   for start, end in zip(starts, [*starts[1:], math.inf]))
        seconds = self._at("verify", rows, block_size) + rows * keys
        return seconds + self.draft_seconds(rows, block_size) if draft and block_size > 1 else seconds

    def draft_seconds(self, rows: int, block_size: int) -> float:
        """The drafter's forward of ``block_size`` tokens for each of ``rows`` rows."""
        return self._at("draft", rows, block_size)

    def _at(self, table: str, rows: int, block_size: int) -> float:
        counts = sorted(self.rows)  # the two row counts ``interpolate`` reads: this runs for every plan weighed
        i = min(max(bisect_left(counts, rows), 1), len(counts) - 1) if len(counts) > 1 else 0
        return interpolate({r: interpolate(getattr(self.rows[r], table), block_size) for r in counts[max(i - 1, 0) : i + 1]},
                           rows)

    def ready(self, rows: int) -> "StepCosts":
        """These costs as ``Costs.ready`` gives them (every row count they have is all there is)."""
        return self

    def relative(self) -> dict[int, float]:
        """Cost of each timed block size relative to plain decoding, one row."""
        base = self.step_seconds(1, 1)
        return {b: self.step_seconds(1, b) / base for b in sorted(self.rows[1].verify)}


def _seconds(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def timed_sizes(max_block_size: int) -> list[int]:
    """The verify sizes a calibration times for a drafter of ``max_block_size``."""
    largest = max(max_block_size, COPY_BLOCK_SIZE)
    return sorted({b for b in CALIBRATION_SIZES if b < largest} | {1, max_block_size, largest})


def calibrate(model: DFlashModel, rows: int = 1, max_block_size: int | None = None, repeats: int | None = None,
              use_metal: bool | None = None, contexts: tuple[int, ...] = (SHORT_CONTEXT,)) -> list[RowCosts]:
    """Time target verify of ``rows`` rows for a few block sizes after each of ``contexts`` tokens
    (the first run through the target, longer ones stretched from it: ``Target.stretch``), and the
    drafter forward after the first; one ``RowCosts`` per context.

    Uses throw-away caches; the model is left as it was. Every size and context is timed once a
    round, and each timing is taken relative to its round's plain forward after the first context:
    a busy spell or a clock change scales a whole round, and the ratio cancels it. A figure is the
    median of its rounds' ratios times the median plain forward, a typical step rather than the
    fastest, and steadier from one calibration to the next than each size's fastest round
    (benchmarks/results/README.md, twenty-first stop). Verify sizes go up to ``COPY_BLOCK_SIZE`` at least: copy-only
    steps and draft trees verify more tokens per row than the drafter drafts.
    """
    target, drafter = model.target, model.drafter
    ops = kernels.get_ops(use_metal)
    max_block_size = max_block_size or model.block_size
    repeats = repeats or (ROUNDS if rows == 1 else BATCH_ROUNDS)
    sizes = timed_sizes(max_block_size)
    head, greedy = target.head(drafter.vocab_rows), Greedy(ops)
    # Deterministic tokens: calibration must not consume the caller's random stream.
    longest = max(contexts) + max(sizes)
    tokens = mx.broadcast_to(mx.arange(longest, dtype=mx.int32) % target.vocab_size, (rows, longest))
    caches = []
    for context in contexts:
        cache = target.make_cache(rows)
        # Only the first context goes through the target: a longer one repeats its keys, which
        # cost a verify row what real keys do, without a prefill that long (it took longer than
        # all the timings together).
        _, hidden = target(tokens[:, : contexts[0]], cache)
        target.cache_policy.forget()
        if context > contexts[0]:
            target.stretch(cache, context)
        mx.eval(hidden, [c.state for c in cache])
        caches.append(cache)
        if context == contexts[0]:
            draft_cache, draft_hidden = drafter.make_cache(rows=rows), hidden
            # The drafter's context as in steady state: the prompt absorbed, a few new rows per step.
            drafter.absorb(hidden[:, :-2], draft_cache)

    def run_verify(B: int, k: int) -> None:
        logits, h = target(tokens[:, contexts[k] : contexts[k] + B], caches[k])
        mx.eval(logits, h)
        target.rollback(caches[k], B)

    def run_draft(B: int) -> None:
        start = contexts[0]
        block = target.embed(tokens[:, start : start + B])
        proposals, _, _ = drafter.propose(block, tokens[:, start], draft_hidden[:, -2:], draft_cache, head, greedy)
        mx.eval(proposals)
        for c in draft_cache:
            c.trim(2)

    verify = [{B: [] for B in sizes} for _ in contexts]
    drafts = {B: [] for B in sizes if 1 < B <= max_block_size}
    for _ in range(repeats + 1):
        for B in sizes:  # 1 first: the round's reference
            for k in range(len(contexts)):
                verify[k][B].append(_seconds(lambda: run_verify(B, k)))
            if B in drafts:
                drafts[B].append(_seconds(lambda: run_draft(B)))
    # The first round is left out: its calls pay for allocation and graph setup.
    plain = verify[0][1][1:]
    draft = {B: typical(times[1:], plain) for B, times in drafts.items()} | {1: 0.0}
    # Not forced to grow with B: more rows can cost less (see CALIBRATION_SIZES), and then the
    # policy should take the larger block, which also holds more proposals.
    return [RowCosts({B: typical(times[1:], plain) for B, times in v.items()}, draft) for v in verify]


def typical(times: list[float], plain: list[float]) -> float:
    """Seconds of a forward timed once a round (``times``), from its ratios to the same rounds'
    plain forward (``plain``): their median times the median plain forward (``calibrate``)."""
    return statistics.median(plain) * statistics.median(t / p for t, p in zip(times, plain, strict=True))


def context_slopes(contexts: tuple[int, ...], timed: list[RowCosts]) -> dict[int, dict[int, float]]:
    """``StepCosts.per_key`` from verify times ``timed`` after each of ``contexts`` tokens. A slope is
    a difference of two timings, the noisiest figure of a calibration; more rows attend to the
    same keys each, so a larger block's slope is taken to be at least a smaller one's (a 2-row
    slope timed below the 1-row one once priced 2-row steps under plain ones at 8k tokens)."""
    per_key = {}
    for start, end, near, far in zip(contexts, contexts[1:], timed, timed[1:]):
        slopes, steepest = {}, 0.0
        for b in sorted(near.verify):
            steepest = max(steepest, (far.verify[b] - near.verify[b]) / (end - start))
            slopes[b] = steepest
        per_key[start] = slopes
    return per_key


class Costs:
    """A pair's step costs, calibrated as the engine first needs them and kept for as long as the
    pair lives, and on disk: one row with its context slope first, then each count in
    ``ROW_COUNTS`` up to the rows a step runs (more rows never cost less: a count timed faster than a
    smaller one was noise). ``source`` says where the costs came from, for the stats."""

    def __init__(self, model: DFlashModel, use_metal: bool | None = None):
        self.model, self.use_metal = model, use_metal
        settings = [CALIBRATION_SIZES, COPY_BLOCK_SIZE, SHORT_CONTEXT, LONG_CONTEXTS, ROUNDS, BATCH_ROUNDS,
                    ROW_COUNTS, model.block_size]
        self.path, self.key, why_not = _kept_file(model, use_metal, KEPT_FORMAT, settings)
        table = _read(self.path, self.key, model.block_size) if self.path else None
        if table is not None:
            self.table, self.source = table, f"read from {self.path}"
            return
        tic = time.perf_counter()
        timed = calibrate(model, 1, use_metal=use_metal, contexts=CONTEXTS)
        self.table = StepCosts({1: timed[0]}, context_slopes(CONTEXTS, timed))
        why_not = why_not or self._write()
        self.source = (f"measured in {time.perf_counter() - tic:.1f} s, "
                       + (f"not kept ({why_not})" if why_not else f"kept in {self.path}"))

    def ready(self, rows: int) -> StepCosts:
        """The costs, with row counts timed up to the first count in ``ROW_COUNTS`` >= ``rows``."""
        needed = next((r for r in ROW_COUNTS if r >= rows), ROW_COUNTS[-1])
        missing = [r for r in ROW_COUNTS if r <= needed and r not in self.table.rows]
        tic = time.perf_counter()
        for r in missing:
            (measured,) = calibrate(self.model, r, use_metal=self.use_metal)
            smaller = self.table.rows[max(k for k in self.table.rows if k < r)]
            self.table.rows[r] = RowCosts({k: max(v, smaller.verify.get(k, 0.0)) for k, v in measured.verify.items()},
                                          {k: max(v, smaller.draft.get(k, 0.0)) for k, v in measured.draft.items()})
        if missing:
            self.source += f"; {', '.join(map(str, missing))} rows measured in {time.perf_counter() - tic:.1f} s"
            if self.path:
                self._write()
        return self.table

    def _write(self) -> str | None:
        """Keep the table in ``self.path``; why not, or None."""
        rows = {r: {"verify": c.verify, "draft": c.draft} for r, c in self.table.rows.items()}
        why_not = _keep(self.path, {"format": KEPT_FORMAT, "key": self.key, "measured": time.time(), "rows": rows,
                                    "per_key": self.table.per_key})
        if why_not:
            self.path = None
        return why_not


class PrefillChunks:
    """How many prompt tokens a prefill forward should take on this machine: the size in
    ``PREFILL_CHUNKS`` whose forward cost least per token (``time_prefill_chunks``), the largest
    within ``CHUNK_TOLERANCE`` of it, since fewer forwards pass over the weights fewer times. Where
    attention is unfused (MLX's CPU backend), a chunk of c tokens scores c x c query-key pairs of its
    own that the causal mask then throws away, so there smaller chunks prefill long prompts
    faster; where a fused kernel skips the masked pairs, the largest tends to win. Kept on disk
    like ``Costs``; ``source`` says where the figures came from, for the stats."""

    def __init__(self, model: DFlashModel, use_metal: bool | None = None):
        # The target's alone: the timing runs no drafter.
        self.path, key, why_not = _kept_file(model, use_metal, PREFILL_FORMAT, [PREFILL_CHUNKS, CHUNK_STOP],
                                             lambda m: target_digest(m.target))
        self.per_token = _read_chunks(self.path, key) if self.path else None
        if self.per_token is not None:
            self.source = f"read from {self.path}"
        else:
            tic = time.perf_counter()
            self.per_token = time_prefill_chunks(model)
            if not why_not:
                why_not = _keep(self.path, {"format": PREFILL_FORMAT, "key": key, "measured": time.time(),
                                            "per_token": self.per_token})
            self.source = (f"measured in {time.perf_counter() - tic:.1f} s, "
                           + (f"not kept ({why_not})" if why_not else f"kept in {self.path}"))
        best = min(self.per_token.values())
        self.size = max(n for n, t in self.per_token.items() if t <= CHUNK_TOLERANCE * best)

    def describe(self) -> str:
        timed = ", ".join(f"{n}: {1000 * t:.3g}" for n, t in sorted(self.per_token.items()))
        return f"{self.size} tokens (ms per token by chunk size {timed}; {self.source})"


def time_prefill_chunks(model: DFlashModel) -> dict[int, float]:
    """Seconds per token of one prefill forward (``Target.prefill_rows``, one row, an empty cache)
    of each size in ``PREFILL_CHUNKS``, smallest first, up to the first size ``CHUNK_STOP`` times
    dearer per token than the cheapest before it: past the sizes that spread a forward's fixed
    costs, a larger chunk only costs more per token. A second round re-times the sizes that can
    still win and keeps the faster time (noise only ever adds time)."""
    target = model.target
    tokens = [i % target.vocab_size for i in range(max(PREFILL_CHUNKS))]

    def per_token(n: int) -> float:
        cache = target.make_cache(1)
        return _seconds(lambda: mx.eval(target.prefill_rows([cache], [tokens[:n]]), [c.state for c in cache])) / n

    per_token(PREFILL_CHUNKS[0])  # the first forward pays for allocation and graph setup
    timed: dict[int, float] = {}
    for n in PREFILL_CHUNKS:
        timed[n] = per_token(n)
        if timed[n] > CHUNK_STOP * min(timed.values()):
            break
    for n in [n for n, t in timed.items() if t <= CHUNK_STOP * min(timed.values())]:
        timed[n] = min(timed[n], per_token(n))
    return timed


_chunks: "weakref.WeakKeyDictionary[object, PrefillChunks]" = weakref.WeakKeyDictionary()


def prefill_chunks(model: DFlashModel, use_metal: bool | None = None) -> PrefillChunks:
    """The ``PrefillChunks`` of the pair's target, measured on its first use and remembered after
    (for every pair over that target)."""
    if model.target not in _chunks:
        _chunks[model.target] = PrefillChunks(model, use_metal)
    return _chunks[model.target]


def calibration_dir() -> Path:
    """Where calibrations are kept between processes."""
    return cache_dir() / "calibration"


def _machine(use_metal: bool | None) -> dict:
    """What decides step costs besides the pair and the software: the processor, the device, the
    kernels, the BLAS library and its kernels."""
    device = mx.default_device()
    # mx.device_info names the CPU or GPU model; versions of mlx without it have only the Metal one.
    info = mx.device_info() if hasattr(mx, "device_info") else \
        mx.metal.device_info() if device == mx.gpu else platform.processor()
    return {"machine": platform.machine(), "system": platform.system(), "cpus": os.cpu_count(),
            "device": str(device), "info": info, "kernels": kernels.get_ops(use_metal).path, "blas": BLAS}


def _kept_file(model: DFlashModel, use_metal: bool | None, kept_format: str, settings: list,
               digest=pair_digest) -> tuple[Path | None, str | None, str | None]:
    """(file, key, None) a measurement of ``model`` (named by ``digest(model)``) in ``kept_format``
    with ``settings`` is kept in, or (None, None, why it is not kept)."""
    if hasattr(model.target, "on_all_ranks"):
        return None, None, "a sharded target is timed over its ranks' links at every start"
    described = [kept_format, digest(model), _machine(use_metal), software(), settings]
    key = hashlib.sha256(json.dumps(described, default=str).encode()).hexdigest()
    return calibration_dir() / f"{key[:32]}.json", key, None


def _keep(path: Path, data: dict) -> str | None:
    """Write ``data`` to ``path`` whole (under a temp name, then renamed); why it could not be, or None."""
    temp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp.write_text(json.dumps(data))
        os.replace(temp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        log.warning("could not keep a calibration in %s: %s", path, one_line(e))
        return f"could not write {temp.parent}: {one_line(e)}"
    return None


def _kept(path: Path, key: str, kept_format: str, what: str) -> dict | None:
    """The JSON object kept in ``path`` for ``key``, or None if there is none or it is unreadable or
    foreign (logged, naming ``what`` it held)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("skipping the %s in %s: it is unreadable (%s)", what, path, one_line(e))
        return None
    if not isinstance(data, dict) or data.get("format") != kept_format or data.get("key") != key:
        log.warning("skipping the %s in %s: it was written for another pair, machine or version", what, path)
        return None
    return data


def _seconds_table(table: dict) -> dict[int, float]:
    out = {int(k): float(v) for k, v in table.items()}
    if not all(math.isfinite(v) and v >= 0 for v in out.values()):
        raise ValueError("a time in it is not a number of seconds")
    return out


def _read(path: Path, key: str, max_block_size: int) -> StepCosts | None:
    """The table kept in ``path``, or None if there is none or it is damaged or foreign (logged)."""
    data = _kept(path, key, KEPT_FORMAT, "step costs")
    if data is None:
        return None
    try:
        rows = {int(r): RowCosts(_seconds_table(c["verify"]), _seconds_table(c["draft"]))
                for r, c in data["rows"].items()}
        table = StepCosts(rows, {int(c): _seconds_table(slopes) for c, slopes in data["per_key"].items()})
        sizes = timed_sizes(max_block_size)
        drafted = [b for b in sizes if b <= max_block_size]
        if 1 not in rows or not set(rows) <= set(ROW_COUNTS) or sorted(table.per_key) != list(CONTEXTS[:-1]) \
                or any(sorted(slopes) != sizes for slopes in table.per_key.values()) \
                or any(sorted(c.verify) != sizes or sorted(c.draft) != drafted for c in rows.values()):
            raise ValueError("its block sizes or row counts are not the ones a calibration times")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("skipping the step costs in %s: %s", path, one_line(e))
        return None
    return table


def _read_chunks(path: Path, key: str) -> dict[int, float] | None:
    """The prefill timings kept in ``path``, or None if there are none or they are damaged or
    foreign (logged)."""
    data = _kept(path, key, PREFILL_FORMAT, "prefill timings")
    if data is None:
        return None
    try:
        per_token = _seconds_table(data["per_token"])
        if not per_token or not set(per_token) <= set(PREFILL_CHUNKS):
            raise ValueError("its chunk sizes are not the ones a calibration times")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("skipping the prefill timings in %s: %s", path, one_line(e))
        return None
    return per_token


_costs: "weakref.WeakKeyDictionary[DFlashModel, Costs]" = weakref.WeakKeyDictionary()
_overlaps: "weakref.WeakKeyDictionary[DFlashModel, Overlap]" = weakref.WeakKeyDictionary()


def costs(model: DFlashModel, use_metal: bool | None = None) -> Costs:
    """The pair's ``Costs``, calibrated on its first adaptive use and remembered after."""
    if model not in _costs:
        _costs[model] = Costs(model, use_metal)
    return _costs[model]


class Overlap:
    """How much of a plain step's target forward still runs once ``mx.async_eval`` has handed it
    over: what the host could spend building the next step while it runs. Starting a plain step's
    successor early, as mlx_lm does, pays only where that share is large: on a GPU, MLX queues
    command buffers and should return early, while its CPU backend keeps only a few operations in
    flight, so there async_eval returns near the forward's end and running ahead only moves a
    forward's wait into the step that starts it (and splits the forward of a step that then
    verifies a copy). Measured on a pair's first ``OVERLAP_SAMPLES`` runs ahead, by waiting for
    each (the next step would have); running ahead is assumed to pay until then."""

    def __init__(self):
        self.shares: list[float] = []

    @property
    def frees_host(self) -> bool:
        return len(self.shares) < OVERLAP_SAMPLES or max(self.shares) >= RUN_AHEAD_OVERLAP

    def start(self, arrays) -> None:
        """``mx.async_eval(arrays)``, timed to their end while the share is being measured."""
        tic = time.perf_counter()
        mx.async_eval(arrays)
        if len(self.shares) < OVERLAP_SAMPLES:
            handed = time.perf_counter()
            mx.eval(arrays)
            done = time.perf_counter()
            self.shares.append((done - handed) / max(done - tic, 1e-9))

    def describe(self) -> str:
        if len(self.shares) < OVERLAP_SAMPLES:
            return "on (its payoff not measured yet)"
        share = f"{max(self.shares):.0%} of a forward runs after async_eval returns here"
        return f"on ({share})" if self.frees_host else f"off ({share}: it would not free the host)"


def overlap(model: DFlashModel) -> Overlap:
    """The pair's ``Overlap``, measured as its engines first run ahead and remembered after."""
    if model not in _overlaps:
        _overlaps[model] = Overlap()
    return _overlaps[model]


class Drift:
    """Observed over calibrated step seconds per block size: an EMA (``decay``) of each
    size's ratio. A size never used borrows the ratio of the nearest size used where that
    is below 1 (the whole curve runs faster than calibrated) and counts as calibrated
    otherwise: a size that looks cheaper than it is gets tried and corrected, while one
    that looked dearer would never be tried (a dear block size lending its ratio to plain
    steps kept a batch drafting where plain steps were faster)."""

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
        False when the step also did work not its own (rows joined or left, their caches
        concatenated or filtered); its run is not timed.
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
            # Clipped: one slow step (a busy spell) must not rule a block size out for long.
            d = self.ratios[size]
            self.ratios[size] = self.decay * d + (1 - self.decay) * min(ratio, 2 * d)

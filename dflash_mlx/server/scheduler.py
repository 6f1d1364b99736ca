"""Continuous batching for ``dflash-mlx serve``: the worker's jobs as rows of one ``BatchEngine``.

Between engine steps new jobs join (their prompts prefilled in chunks after what the engine's
prompt cache holds, ``BatchEngine.add``) and jobs whose client went away, or whose reply a stop
string ended, leave at once (``cancel``). Each committed token becomes the job's next ``GenerationResponse``, the one ``stream_generate`` would
have produced for that request alone (greedy: the same tokens; sampled: the same distribution).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from ..batch import BatchEngine, TokenEvent
from ..generation import GenerationResponse
from .jobs import End, Job
from ..stats import SpeculativeStats


@dataclass
class _Row:
    job: Job
    detokenizer: Any
    admitted: float
    first_token: float | None = None
    tokens: int = 0

    def rate(self) -> float:
        """Tokens per second since the first one, as ``stream_generate`` counts it."""
        return self.tokens / max(time.perf_counter() - self.first_token, 1e-9) if self.first_token else 0.0


class BatchScheduler:
    """Runs the worker's jobs through one engine; ``record(job, stats, tokens, seconds, tps)`` is
    called once per job that produced tokens, for the server's metrics."""

    def __init__(self, make_engine: Callable[[], BatchEngine], tokenizer: Any,
                 record: Callable[[Job, SpeculativeStats, int, float, float], None]):
        self.make_engine, self.tokenizer, self.record = make_engine, tokenizer, record
        self.engine = make_engine()
        self.rows: dict[int, _Row] = {}  # engine uid -> its job

    @property
    def idle(self) -> bool:
        return self.engine.idle

    def jobs(self) -> list[Job]:
        return [row.job for row in list(self.rows.values())]

    def admit(self, job: Job, arguments: dict[str, Any]) -> None:
        """Queue a job in the engine (``arguments``: the worker's ``stream_generate`` keywords)."""
        p = job.params
        uid = self.engine.add(
            p.prompt, max_tokens=p.max_tokens, temp=p.temp, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            sampler=arguments.get("sampler"), seed=p.seed, stop_tokens=self.tokenizer.eos_token_ids,
            logits_processors=arguments.get("logits_processors"), block_size=p.block_size,
        )
        job.cached_tokens = self.engine.cached_tokens(uid)
        self.rows[uid] = _Row(job, self.tokenizer.detokenizer, time.perf_counter())

    def step(self) -> None:
        """Drop the rows of cancelled jobs, then one engine step; its tokens go to their jobs."""
        for uid, row in list(self.rows.items()):
            if row.job.cancelled:
                stats = next((r.stats for r in self.engine.rows if r.uid == uid), None)
                self.engine.cancel(uid)
                if stats is not None and row.tokens:
                    self.record(row.job, stats, row.tokens, time.perf_counter() - row.admitted, row.rate())
                self._end(uid, End(row.job.reason, 503) if row.job.reason else End())
        if not self.engine.idle:
            for event in self.engine.step():
                self._emit(event)

    def fail_all(self, message: str, status: int = 500) -> int:
        """End every job with an error and start over with a fresh engine (after a failed step its
        caches are in an unknown state). Returns how many jobs were ended."""
        ended = len(self.rows)
        for uid in list(self.rows):
            self._end(uid, End(message, status))
        self.engine = self.make_engine()
        return ended

    def _emit(self, event: TokenEvent) -> None:
        row = self.rows[event.uid]
        now = time.perf_counter()
        if row.first_token is None:
            row.first_token = now
        row.tokens += 1
        if event.finish_reason != "stop":  # the stop token is not part of the answer, as in mlx_lm
            row.detokenizer.add_token(event.token)
        if event.finish_reason:
            row.detokenizer.finalize()
        p = row.job.params
        response = GenerationResponse(
            row.detokenizer.last_segment, event.token, event.from_draft, len(p.prompt),
            len(p.prompt) / max(row.first_token - row.admitted, 1e-9), row.tokens, row.rate(),
            mx.get_peak_memory() / 1e9, event.stats, event.finish_reason,
        )
        row.job.events.put(response)
        if event.finish_reason:
            self.record(row.job, event.stats, row.tokens, now - row.admitted, row.rate())
            self._end(event.uid, End())

    def _end(self, uid: int, end: End) -> None:
        row = self.rows.pop(uid)
        row.job.events.put(end)

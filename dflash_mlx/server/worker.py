"""The generation worker of ``dflash-mlx serve``: one thread owns the model and runs every job.

MLX streams are per thread, so all MLX work happens here. The interface is
small on purpose, so that the protocol and the HTTP code do not care how jobs
are run: ``submit`` a ``Job``, read its ``events`` queue (responses, then
exactly one ``End``), ``cancel`` it. With ``--decode-concurrency`` above 1 and
a pair the batch engine can batch, jobs run together (``scheduler.py``);
otherwise one at a time, with the conversation cache and copy proposals
(/metrics says which, and why). An exception in one job ends that job (``End``
carries the message and an HTTP status) and the worker takes the next;
``state`` says whether it can serve.
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
import time

from ..errors import DFlashError, one_line
from .jobs import End, Job
from .request import GenerationParams

SHUTTING_DOWN = "the server is shutting down"


class Unavailable(Exception):
    """The worker cannot take jobs (loading, failed or stopping); the message says which."""


class Metrics:
    """Counters for /metrics (Prometheus text format)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.failed = self.cancelled = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.generation_seconds = 0.0
        self.steps = self.step_tokens = self.plain_steps = 0
        self.drafted_tokens = self.copied_tokens = self.corpus_copied_tokens = 0
        self.last_tps = 0.0
        self.last_speculative = 0
        self.batching: str | None = "not started"  # None when requests are batched, else why not
        self.engine = None  # the batch engine's EngineStats, when batching

    def render(self, active: int, queued: int) -> str:
        with self.lock:
            tau = self.step_tokens / self.steps if self.steps else 0.0
            tps = self.completion_tokens / self.generation_seconds if self.generation_seconds else 0.0
            rows = [
                ("requests_total", "counter", "Completion requests accepted", self.requests),
                ("requests_failed_total", "counter", "Requests that failed in generation", self.failed),
                ("requests_cancelled_total", "counter", "Requests whose client went away before the end", self.cancelled),
                ("requests_active", "gauge", "Requests generating now", active),
                ("requests_queued", "gauge", "Requests waiting for the worker", queued),
                ("prompt_tokens_total", "counter", "Prompt tokens received", self.prompt_tokens),
                ("prompt_cached_tokens_total", "counter", "Prompt tokens served from the cache", self.cached_tokens),
                ("completion_tokens_total", "counter", "Tokens generated", self.completion_tokens),
                ("generation_seconds_total", "counter", "Seconds spent generating", self.generation_seconds),
                ("tokens_per_second", "gauge", "Generated tokens per second over all requests", tps),
                ("last_tokens_per_second", "gauge", "Generation tokens per second of the last request", self.last_tps),
                ("tau", "gauge", "Mean tokens committed per draft-verify step", tau),
                ("steps_total", "counter", "Decode steps", self.steps),
                ("plain_steps_total", "counter", "Steps decoded without a draft (block size 1)", self.plain_steps),
                ("drafted_tokens_total", "counter", "Accepted tokens the drafter proposed", self.drafted_tokens),
                ("copied_tokens_total", "counter", "Accepted tokens copied from earlier text", self.copied_tokens),
                ("corpus_copied_tokens_total", "counter", "Of the copied tokens, those from the drafter's corpus",
                 self.corpus_copied_tokens),
                ("speculative", "gauge", "1 if the last request drafted, 0 if it decoded plainly", self.last_speculative),
                ("batched", "gauge", "1 if concurrent requests are decoded together; if 0, the reason label says why not",
                 int(self.batching is None)),
            ]
            if (e := self.engine) is not None:
                rows += [
                    ("batch_steps_total", "counter", "Batch engine steps", e.steps),
                    ("batch_rows_mean", "gauge", "Mean requests per batch engine step", e.mean_rows),
                    ("batch_ragged_steps_total", "counter", "Batch steps whose rows accepted different counts", e.ragged_steps),
                ]
        lines = []
        for name, kind, help, value in rows:
            label = f'{{reason="{_label(self.batching)}"}}' if name == "batched" and self.batching else ""
            lines += [f"# HELP dflash_{name} {help}", f"# TYPE dflash_{name} {kind}", f"dflash_{name}{label} {value}"]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value: backslashes, quotes and newlines escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Worker(threading.Thread):
    """Owns the model: loads it, calibrates it, and runs every job, one at a time."""

    def __init__(self, args: argparse.Namespace, metrics: Metrics):
        super().__init__(name="dflash-worker", daemon=True)
        self.args, self.metrics = args, metrics
        self.prefill_step_size = getattr(args, "prefill_step_size", None)  # None: each path's default
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.ready = threading.Event()  # set once loading ended, well or not
        self.state, self.error = "loading", None  # loading, ready, failed, stopping, stopped
        self.current: Job | None = None
        self.batch = None  # a scheduler.BatchScheduler when jobs are batched
        self.model = self.tokenizer = self.prompt_cache = None
        self._lock = threading.Lock()  # orders submit() against close() and failure

    def submit(self, job: Job) -> None:
        """Queue a job; ``Unavailable`` if the worker cannot run it."""
        with self._lock:
            if self.state != "ready":
                raise Unavailable(self.error or f"the model is {self.state}")
            self.jobs.put(job)

    def close(self) -> None:
        """Refuse new jobs, end the queued and running ones (503), and let the thread finish."""
        with self._lock:
            if self.state in ("loading", "ready"):
                self.state, self.error = "stopping", SHUTTING_DOWN
            for job in self.batch.jobs() if self.batch else [self.current] if self.current else []:
                job.cancel(SHUTTING_DOWN)
            self.jobs.put(None)

    @property
    def active(self) -> int:
        return len(self.batch.rows) if self.batch else int(self.current is not None)

    def run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # reported through `state`; the starting thread exits cleanly
            self.state = "failed"
            self.error = str(e) if isinstance(e, DFlashError) else f"could not load the model: {one_line(e)}"
            self.ready.set()
            return
        with self._lock:
            if self.state == "loading":
                self.state = "ready"
        self.ready.set()
        try:
            if self.batch:
                self._serve_batched()
            else:
                while (job := self.jobs.get()) is not None:
                    self._run(job)
        except BaseException as e:  # a bug in the loop itself: say so on /health instead of hanging
            logging.exception("the generation worker stopped")
            with self._lock:
                self.state, self.error = "failed", f"the generation worker stopped: {one_line(e)}"
        else:
            self.state = "stopped"
        while not self.jobs.empty():  # jobs queued behind the end
            if (job := self.jobs.get()) is not None:
                job.events.put(End(self.error or SHUTTING_DOWN, 503))

    def _load(self) -> None:
        from ..step_costs import cost_curve
        from ..model import load

        # Under mlx.launch only rank 0 returns (and serves); the other ranks follow it inside load.
        self.model, self.tokenizer = load(self.args.model, self.args.draft, getattr(self.args, "chat_template", None),
                                          pipeline=getattr(self.args, "pipeline", False))
        concurrency = getattr(self.args, "decode_concurrency", 1)
        if concurrency > 1 and getattr(self.model.target, "start_record", None):
            self.metrics.batching = "a sharded target serves one request at a time"
        elif concurrency > 1 and self.args.draft_window:
            self.metrics.batching = "--draft-window bounds the drafter of one-at-a-time decoding only"
        elif concurrency > 1:
            from ..batch import BatchEngine, batch_refusal
            from ..batch_prefill import PREFILL_STEP_SIZE

            self.metrics.batching = batch_refusal(self.model, concurrency)
            if self.metrics.batching is None:
                from .scheduler import BatchScheduler

                def engine() -> BatchEngine:
                    made = BatchEngine(self.model, block_size=self.args.block_size, completion_batch_size=concurrency,
                                       prefill_step_size=self.prefill_step_size or PREFILL_STEP_SIZE,
                                       copy_proposals=getattr(self.args, "copy_proposals", True))
                    self.metrics.engine = made.stats
                    return made

                self.batch = BatchScheduler(engine, self.tokenizer, self._record)
        else:
            self.metrics.batching = "--decode-concurrency is 1"
        if self.args.block_size == "auto" and not self.batch:
            cost_curve(self.model)  # calibrate now, not during the first request

    def _run(self, job: Job) -> None:
        with self._lock:  # so that close() either sees this job running or finds the state changed
            if self.state != "ready":
                job.cancel(self.error or SHUTTING_DOWN)
            elif not job.cancelled:
                self.current = job
        end = End(job.reason, 503) if job.cancelled else None
        if end is None:
            try:
                self._generate(job)
                end = End(job.reason, 503) if job.reason else End()
            except DFlashError as e:  # a setting the request checks did not catch
                end = End(str(e), 400)
            except Exception as e:
                logging.exception("generation failed")
                self.prompt_cache = None  # its contents are unknown after a failure
                with self.metrics.lock:
                    self.metrics.failed += 1
                end = End(f"generation failed: {one_line(e)}", 500)
            finally:
                self.current = None
        job.events.put(end)

    def _serve_batched(self) -> None:
        """Admit every queued job between engine steps; wait only while nothing runs."""
        while True:
            wait = self.batch.idle
            while True:
                try:
                    job = self.jobs.get(block=wait)
                except queue.Empty:
                    break
                if job is None:
                    self.batch.fail_all(self.error or SHUTTING_DOWN, 503)
                    return
                self._admit(job)
                wait = False
            try:
                self.batch.step()
            except Exception as e:
                logging.exception("generation failed")
                failed = self.batch.fail_all(f"generation failed: {one_line(e)}")
                with self.metrics.lock:
                    self.metrics.failed += failed

    def _admit(self, job: Job) -> None:
        with self._lock:  # as in _run: close() either cancels this job or finds the state changed
            if self.state != "ready":
                job.cancel(self.error or SHUTTING_DOWN)
            elif not job.cancelled:
                try:
                    self.batch.admit(job, self._arguments(job.params))
                    return
                except DFlashError as e:
                    job.events.put(End(str(e), 400))
                    return
        job.events.put(End(job.reason, 503) if job.reason else End())

    def _cache(self):
        from ..decode import DecodeCache

        if self.prompt_cache is None:
            self.prompt_cache = DecodeCache.new(self.model.target, self.model.drafter, self.args.draft_window)
        return self.prompt_cache

    def _arguments(self, p: GenerationParams) -> dict:
        """``stream_generate`` keyword arguments for a job's parameters."""
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        kwargs = dict(temp=p.temp, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, block_size=p.block_size or self.args.block_size,
                      copy_proposals=getattr(self.args, "copy_proposals", True))
        if p.xtc_probability > 0 and p.temp > 0:
            # XTC is an opaque sampler: still exact (the match strategy), but it accepts fewer drafts.
            specials = self.tokenizer.encode("\n", add_special_tokens=False) + list(self.tokenizer.eos_token_ids)
            kwargs["sampler"] = make_sampler(p.temp, p.top_p, p.min_p, 1, p.top_k, p.xtc_probability, p.xtc_threshold, specials)
        if p.logits:
            kwargs["logits_processors"] = make_logits_processors(**p.logits)
        if self.prefill_step_size:
            kwargs["prefill_step_size"] = self.prefill_step_size
        return kwargs

    def _generate(self, job: Job) -> None:
        import mlx.core as mx

        from ..generation import stream_generate

        p = job.params
        kwargs = self._arguments(p)
        cache = self._cache()
        job.cached_tokens = cache.reuse(p.prompt, self.model.target)
        if p.seed is not None:
            mx.random.seed(p.seed)
        tic, response = time.perf_counter(), None
        for response in stream_generate(self.model, self.tokenizer, p.prompt, p.max_tokens, prompt_cache=cache, **kwargs):
            job.events.put(response)
            if job.cancelled:
                break
        if response is not None:
            self._record(job, response.stats, response.generation_tokens, time.perf_counter() - tic,
                         response.generation_tps)

    def _record(self, job: Job, s, tokens: int, seconds: float, tps: float) -> None:
        """A job's counts into the metrics (``s``: its ``SpeculativeStats``)."""
        m = self.metrics
        with m.lock:
            m.prompt_tokens += len(job.params.prompt)
            m.cached_tokens += job.cached_tokens
            m.completion_tokens += tokens
            m.generation_seconds += seconds
            m.steps += len(s.acceptance_lengths)
            m.step_tokens += sum(s.acceptance_lengths)
            m.plain_steps += sum(1 for b in s.block_sizes if b == 1)
            m.drafted_tokens += s.drafted
            m.copied_tokens += s.copied
            m.corpus_copied_tokens += s.corpus_copied
            m.last_tps = tps
            m.last_speculative = int(s.speculative)

"""The generation worker of ``dflash-mlx serve``: one thread owns the model and runs every job.

MLX streams are per thread, so all MLX work happens here. The interface is
small on purpose, so that the protocol and the HTTP code do not care how jobs
are run: ``submit`` a ``Job``, read its ``events`` queue (responses, then
exactly one ``End``), ``cancel`` it. Jobs are rows of one ``Engine``: between
steps new jobs join (their prompts prefilled after what the prompt cache holds)
and jobs whose client went away, or whose reply a stop string ended, leave at
once; up to ``--decode-concurrency`` decode together (/metrics says whether
they are batched, and why not). Each committed token becomes the job's next
``GenerationResponse``, the one ``stream_generate`` would have produced for
that request alone. An exception in a step ends the jobs of that step (``End``
carries the message and an HTTP status) and the worker goes on with a fresh
engine; ``state`` says whether it can serve.
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

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
        self.tree_steps = self.tree_nodes = self.off_chain_steps = 0
        self.last_tps = 0.0
        self.last_speculative = 0
        self.batching: str | None = "not started"  # None when requests are batched, else why not
        self.engine = None  # the batch engine's EngineStats, when batching
        self.prompt_cache = None  # the worker's PromptCache, once loaded

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
                ("tree_steps_total", "counter", "Steps that verified draft trees", self.tree_steps),
                ("tree_nodes_total", "counter", "Nodes of those trees, roots included", self.tree_nodes),
                ("tree_off_chain_steps_total", "counter",
                 "Tree steps whose accepted path left the drafter's top choices", self.off_chain_steps),
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
            if (c := self.prompt_cache) is not None:
                rows += [
                    ("prompt_cache_ram_hits_total", "counter", "Requests that started from a prompt cache entry in RAM", c.ram_hits),
                    ("prompt_cache_disk_hits_total", "counter", "Requests that started from a prompt cache file", c.disk_hits),
                    ("prompt_cache_misses_total", "counter", "Requests that found no prompt cache entry", c.misses),
                    ("prompt_cache_ram_bytes", "gauge", "Bytes the prompt cache holds in RAM", c.nbytes),
                    ("prompt_cache_disk_bytes", "gauge", "Bytes of this model's prompt cache files", c.disk_bytes),
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
    """Owns the model: loads it, calibrates it, and runs every job through one engine."""

    def __init__(self, args: argparse.Namespace, metrics: Metrics):
        super().__init__(name="dflash-worker", daemon=True)
        self.args, self.metrics = args, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.ready = threading.Event()  # set once loading ended, well or not
        self.state, self.error = "loading", None  # loading, ready, failed, stopping, stopped
        self.running: dict[int, _Running] = {}  # engine uid -> its job
        self.model = self.tokenizer = self.engine = self.prompt_cache = None
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
            for running in list(self.running.values()):
                running.job.cancel(SHUTTING_DOWN)
            self.jobs.put(None)

    @property
    def active(self) -> int:
        return len(self.running)

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
            self._serve()
        except BaseException as e:  # a bug in the loop itself: say so on /health instead of hanging
            logging.exception("the generation worker stopped")
            with self._lock:
                self.state, self.error = "failed", f"the generation worker stopped: {one_line(e)}"
        else:
            self.state = "stopped"
        if self.prompt_cache is not None:
            self.prompt_cache.close()  # the entries saved last reach the disk
        while not self.jobs.empty():  # jobs queued behind the end
            if (job := self.jobs.get()) is not None:
                job.events.put(End(self.error or SHUTTING_DOWN, 503))

    def _load(self) -> None:
        from ..cache.prompt import DISK_BYTES, PromptCache, ram_bytes
        from ..costs import costs
        from ..model import load

        # Under mlx.launch only rank 0 returns (and serves); the other ranks follow it inside load.
        self.model, self.tokenizer = load(self.args.model, self.args.draft, getattr(self.args, "chat_template", None),
                                          pipeline=getattr(self.args, "pipeline", False))
        self.prompt_cache = PromptCache(getattr(self.args, "prompt_cache_size", 10),
                                        getattr(self.args, "prompt_cache_bytes", None) or ram_bytes(),
                                        getattr(self.args, "prompt_cache_dir", None),
                                        getattr(self.args, "prompt_cache_disk_bytes", None) or DISK_BYTES)
        self.metrics.prompt_cache = self.prompt_cache
        self.engine = self._engine()
        logging.info("prefill chunks: %s", self.engine.stats.prefill)
        if self.args.block_size == "auto":  # calibrate now, not during the first requests
            pair_costs = costs(self.model)
            pair_costs.ready(self.engine.max_rows)
            logging.info("step costs: %s", pair_costs.source)

    def _engine(self):
        from ..engine import Engine

        concurrency = getattr(self.args, "decode_concurrency", 1)
        engine = Engine(self.model, block_size=self.args.block_size, max_rows=concurrency,
                        prefill_step_size=getattr(self.args, "prefill_step_size", None),
                        prompt_cache=self.prompt_cache, copy_proposals=getattr(self.args, "copy_proposals", True),
                        draft_window=getattr(self.args, "draft_window", "auto"),
                        tree_budget=getattr(self.args, "tree_budget", "auto"))
        self.metrics.engine = engine.stats
        self.metrics.batching = None if engine.stats.batched else engine.stats.reason
        return engine

    def _serve(self) -> None:
        """Admit every queued job between engine steps; wait only while nothing runs."""
        while True:
            wait = self.engine.idle
            while True:
                try:
                    job = self.jobs.get(block=wait)
                except queue.Empty:
                    break
                if job is None:
                    self._fail_all(self.error or SHUTTING_DOWN, 503)
                    return
                self._admit(job)
                wait = False
            try:
                self._step()
            except Exception as e:
                logging.exception("generation failed")
                failed = self._fail_all(f"generation failed: {one_line(e)}")
                with self.metrics.lock:
                    self.metrics.failed += failed

    def _admit(self, job: Job) -> None:
        with self._lock:  # close() either cancels this job or finds the state changed
            if self.state != "ready":
                job.cancel(self.error or SHUTTING_DOWN)
            elif not job.cancelled:
                try:
                    uid = self.engine.add(job.params.prompt, **self._arguments(job.params))
                except DFlashError as e:  # a setting the request checks did not catch
                    job.events.put(End(str(e), 400))
                    return
                from ..generation import Responses

                job.cached_tokens = self.engine.cached_tokens(uid)
                stats = self.engine.pending[-1].stats
                self.running[uid] = _Running(job, Responses(self.tokenizer, len(job.params.prompt)), stats)
                return
        job.events.put(End(job.reason, 503) if job.reason else End())

    def _arguments(self, p: GenerationParams) -> dict:
        """``Engine.add`` keyword arguments for a job's parameters."""
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        kwargs = dict(max_tokens=p.max_tokens, temp=p.temp, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
                      stop_tokens=self.tokenizer.eos_token_ids, block_size=p.block_size)
        if p.xtc_probability > 0 and p.temp > 0:
            # XTC is an opaque sampler: still exact (the match strategy), but it accepts fewer drafts.
            specials = self.tokenizer.encode("\n", add_special_tokens=False) + list(self.tokenizer.eos_token_ids)
            kwargs["sampler"] = make_sampler(p.temp, p.top_p, p.min_p, 1, p.top_k, p.xtc_probability, p.xtc_threshold,
                                             specials)
            kwargs["seed"] = None  # an opaque sampler draws from MLX's global state
            if p.seed is not None:
                import mlx.core as mx

                mx.random.seed(p.seed)
        if p.logits:
            kwargs["logits_processors"] = make_logits_processors(**p.logits)
        return kwargs

    def _step(self) -> None:
        """Drop the rows of cancelled jobs, then one engine step; its tokens go to their jobs."""
        for uid, running in list(self.running.items()):
            if running.job.cancelled:
                stats = next((r.stats for r in self.engine.rows if r.uid == uid), None)
                self.engine.cancel(uid)
                if stats is not None and running.responses.tokens:
                    self._record(running, stats)
                self._end(uid, End(running.job.reason, 503) if running.job.reason else End())
        if self.engine.idle:
            return
        for event in self.engine.step():
            running = self.running[event.uid]
            if running.job.cancelled:  # cancelled during the step: its row leaves before the next
                continue
            response = running.responses(event, running.stats)
            running.job.events.put(response)
            if event.finish_reason:
                self._record(running, event.stats)
                self._end(event.uid, End())

    def _fail_all(self, message: str, status: int = 500) -> int:
        """End every job with an error and start over with a fresh engine (after a failed step its
        caches are in an unknown state; the prompt cache holds copies taken before). Returns how
        many jobs were ended."""
        ended = len(self.running)
        for uid in list(self.running):
            self._end(uid, End(message, status))
        self.engine = self._engine()
        return ended

    def _end(self, uid: int, end: End) -> None:
        self.running.pop(uid).job.events.put(end)

    def _record(self, running: "_Running", s) -> None:
        """A job's counts into the metrics (``s``: its ``SpeculativeStats``)."""
        m, job, r = self.metrics, running.job, running.responses
        with m.lock:
            m.prompt_tokens += len(job.params.prompt)
            m.cached_tokens += job.cached_tokens
            m.completion_tokens += r.tokens
            m.generation_seconds += time.perf_counter() - r.started
            m.steps += len(s.acceptance_lengths)
            m.step_tokens += sum(s.acceptance_lengths)
            m.plain_steps += sum(1 for b in s.block_sizes if b == 1)
            m.drafted_tokens += s.drafted
            m.tree_steps += s.tree_steps
            m.tree_nodes += s.tree_nodes
            m.off_chain_steps += s.off_chain
            m.copied_tokens += s.copied
            m.corpus_copied_tokens += s.corpus_copied
            m.last_tps = r.generation_tps
            m.last_speculative = int(s.speculative)


@dataclass
class _Running:
    job: Job
    responses: Any  # generation.Responses
    stats: Any  # stats.SpeculativeStats

"""The generation worker of ``dflash-mlx serve``: one thread owns the model and runs every job.

MLX streams are per thread, so all MLX work happens here; HTTP handlers only
submit jobs and read each job's event queue.
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One generation request, as the worker runs it."""

    prompt: list[int]
    max_tokens: int
    sampling: dict[str, Any]  # stream_generate keyword arguments
    seed: int | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cached_tokens: int = 0



class Metrics:
    """Counters for /metrics (Prometheus text format)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.failed = self.cancelled = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.generation_seconds = 0.0
        self.steps = self.step_tokens = self.plain_steps = 0
        self.last_tps = 0.0
        self.last_speculative = 0

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
                ("speculative", "gauge", "1 if the last request drafted, 0 if it decoded plainly", self.last_speculative),
            ]
        lines = []
        for name, kind, help, value in rows:
            lines += [f"# HELP dflash_{name} {help}", f"# TYPE dflash_{name} {kind}", f"dflash_{name} {value}"]
        return "\n".join(lines) + "\n"


class Worker(threading.Thread):
    """Owns the model: loads it, calibrates it, and runs every generation."""

    def __init__(self, args: argparse.Namespace, metrics: Metrics):
        super().__init__(name="dflash-worker", daemon=True)
        self.args, self.metrics = args, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.ready = threading.Event()
        self.active = 0
        self.error: BaseException | None = None
        self.model = self.tokenizer = self.prompt_cache = None

    def run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # reported to the starting thread, which exits cleanly
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                job.events.put(None)
                continue
            self.active = 1
            try:
                self._generate(job)
            finally:
                self.active = 0
                job.events.put(None)

    def _load(self) -> None:
        from .adaptive import cost_curve
        from .model import load

        self.model, self.tokenizer = load(self.args.model, self.args.draft)
        if self.args.block_size == "auto":
            cost_curve(self.model)  # calibrate now, not during the first request

    def _cache(self):
        from .decode import DecodeCache

        if self.prompt_cache is None:
            self.prompt_cache = DecodeCache.new(self.model.target, self.model.drafter, self.args.draft_window)
        return self.prompt_cache

    def _generate(self, job: Job) -> None:
        import mlx.core as mx

        from .generation import stream_generate

        kwargs = dict(job.sampling)
        kwargs.setdefault("block_size", self.args.block_size)
        cache = self._cache()
        job.cached_tokens = cache.reuse(job.prompt, self.model.target)
        if job.seed is not None:
            mx.random.seed(job.seed)
        tic, response = time.perf_counter(), None
        try:
            for response in stream_generate(
                self.model, self.tokenizer, job.prompt, job.max_tokens, prompt_cache=cache, **kwargs
            ):
                job.events.put(response)
                if job.cancelled.is_set():
                    break
        except Exception as e:
            logging.exception("generation failed")
            self.prompt_cache = None  # its contents are unknown after a failure
            with self.metrics.lock:
                self.metrics.failed += 1
            job.events.put(e)
            return
        if response is None:
            return
        s, m = response.stats, self.metrics
        with m.lock:
            m.prompt_tokens += len(job.prompt)
            m.cached_tokens += job.cached_tokens
            m.completion_tokens += response.generation_tokens
            m.generation_seconds += time.perf_counter() - tic
            m.steps += len(s.acceptance_lengths)
            m.step_tokens += sum(s.acceptance_lengths)
            m.plain_steps += sum(1 for b in s.block_sizes if b == 1)
            m.last_tps = response.generation_tps
            m.last_speculative = int(s.speculative)

    def stop(self) -> None:
        self.jobs.put(None)


"""What the server's HTTP threads and its generation worker pass each other: a ``Job`` and its ``End``."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from .request import GenerationParams


@dataclass(frozen=True)
class End:
    """The last event of every job: ``error`` is None when it ran to its end (or its client left)."""

    error: str | None = None
    status: int = 200


class Job:
    """One generation: what to generate, the worker's responses, and a way to stop it."""

    def __init__(self, params: GenerationParams):
        self.params = params
        self.events: queue.Queue = queue.Queue()  # GenerationResponse, ..., then one End
        self.cached_tokens = 0  # prompt tokens served from the conversation cache
        self.reason: str | None = None  # why it was cancelled, when the client should be told
        self._cancelled = threading.Event()

    def cancel(self, reason: str | None = None) -> None:
        self.reason = self.reason or reason
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

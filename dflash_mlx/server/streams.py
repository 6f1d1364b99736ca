"""A worker job seen from the HTTP layer's event loop: its events, its client, its event stream.

The worker thread puts a job's events into a queue that wakes the event loop
(the loop never blocks on the worker); a watcher on the request's ASGI
``receive`` sees the client leave and cancels the job at once; the stream
response ends the job's run however it ends.
"""

from __future__ import annotations

import asyncio
import json
import queue
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse

from .jobs import End, Job
from .worker import Metrics


class Events(queue.Queue):
    """A job's event queue that wakes the event loop on every put (the worker thread puts, the loop gets)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.loop, self.ready = loop, asyncio.Event()

    def _put(self, item: Any) -> None:
        super()._put(item)
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # the loop is closed: nobody waits for this job any more
            pass


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


class JobRun:
    """One job on the worker, seen from the event loop: its events, and its cancellation when the client leaves."""

    def __init__(self, metrics: Metrics, job: Job, receive: Callable):
        self.metrics, self.job = metrics, job
        self.events = Events(asyncio.get_running_loop())
        job.events = self.events  # before submit: the worker puts into this queue
        self.gone = self.dropped = False
        self.finished = False  # End arrived, or the reply ended and the job was stopped
        self.watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.events.ready.set()
        self._drop()  # at once, whatever the answering task is doing

    async def next(self, timeout: float | None = None) -> Any:
        """The next event; None when ``timeout`` passed without one; ``ClientGone`` if the client left."""
        while True:
            if self.gone:
                raise ClientGone()
            try:
                event = self.events.get_nowait()
                if isinstance(event, End):
                    self.finished = True
                return event
            except queue.Empty:
                pass
            self.events.ready.clear()  # a put from now on sets it again (call_soon_threadsafe runs after this)
            try:
                await asyncio.wait_for(self.events.ready.wait(), timeout)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                return None

    def stop(self) -> None:
        """The reply is complete (a stop string may end it before the worker does): free the worker."""
        self.finished = True
        self.job.cancel()

    def _drop(self) -> None:
        """The client went away, or its answer failed, before the job ended: stop generating for it (once)."""
        if not self.finished and not self.dropped:
            self.dropped = True
            with self.metrics.lock:
                self.metrics.cancelled += 1
            self.job.cancel()

    def close(self) -> None:
        self.watcher.cancel()
        self._drop()


class EventStream(StreamingResponse):
    """An event stream that ends its job's run however the response ends: finished, failed, or cancelled by
    Starlette when the client leaves (maybe before the event generator even started)."""

    def __init__(self, events: AsyncIterator[bytes], on_end: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_end = on_end

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


def sse(payload: dict | str, named: bool) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    event = f"event: {payload['type']}\n" if named and isinstance(payload, dict) else ""
    return f"{event}data: {data}\n\n".encode()

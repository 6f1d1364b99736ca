"""The HTTP transport of ``dflash-mlx serve``: HTTP/1.1, CORS, body limits, streams, disconnects.

Keep-alive with every response framed (Content-Length, or chunked encoding for
streams; HTTP/1.0 clients get the stream up to a closed connection); CORS as
mlx_lm.server does it (``--allowed-origins``), with OPTIONS preflights and
HEAD; a 413 before an oversized body is read; every error in OpenAI's shape,
http.server's own ones included. What a request means is ``protocol`` and
``request``, what to answer is ``responses``; the model runs on the ``worker``
thread. A handler thread per connection parses, tokenizes and writes, and
cancels its job when its client goes away.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

from ..errors import one_line
from .jobs import End, Job
from .protocol import RequestError, ServerInfo, decode_json, error_body
from .request import Request, parse_request
from .reply import Reply
from .worker import Metrics, Unavailable, Worker

MAX_BODY_BYTES = 16 * 2**20
POLL_SECONDS = 0.2  # how often a waiting handler checks that its client is still there
ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text", "/completions": "text"}
GET_ROUTES = ("/health", "/v1/models", "/metrics")
_HEADER_LIST = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~, -]{1,1000}$")  # a safe Access-Control-Request-Headers echo


@dataclass
class App:
    """What the request handlers share."""

    worker: Worker
    metrics: Metrics
    model_id: str
    allowed_origins: list[str]
    info: ServerInfo | None = None  # once the model is loaded
    fingerprint: str = "dflash-mlx"
    created: int = field(default_factory=lambda: int(time.time()))
    busy: int = 0  # handlers answering a completion now
    idle: threading.Condition = field(default_factory=threading.Condition)

    def enter(self) -> None:
        with self.idle:
            self.busy += 1

    def leave(self) -> None:
        with self.idle:
            self.busy -= 1
            self.idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.busy == 0, timeout)


class ClientGone(Exception):
    """The client closed the connection before its request was read or answered."""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server_version = "dflash-mlx"
    timeout = 120  # socket timeout: a client that stalls mid-request cannot pin a thread forever
    chunked = False

    @property
    def app(self) -> App:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args) -> None:
        logging.info("%s - %s", self.address_string(), format % args)

    # -- writing ------------------------------------------------------------

    def _cors(self) -> None:
        origins = self.app.allowed_origins
        origin = self.headers.get("Origin") if getattr(self, "headers", None) else None
        if "*" in origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin in origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _head(self, status: int, content_type: str | None, length: int | None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self._cors()
        if self.server.closing:  # type: ignore[attr-defined]
            self.close_connection = True
        if self.close_connection:
            self.send_header("Connection", "close")

    def _send(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self._head(status, content_type, len(data))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode())

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, oversized headers, unknown method), in the one error shape."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # an unparsable request line: answer with a status line anyway
            self.request_version = "HTTP/1.0"
        self._send_json(code, error_body(message or HTTPStatus(code).phrase, code))

    def _start_stream(self) -> None:
        self.chunked = self.request_version >= "HTTP/1.1"
        if not self.chunked:  # an HTTP/1.0 client reads to the end of the connection
            self.close_connection = True
        self._head(200, "text/event-stream", None)
        self.send_header("Cache-Control", "no-cache")
        if self.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _event(self, payload: dict | str) -> None:
        data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" if self.chunked else data)

    def _end_stream(self) -> None:
        self._event("[DONE]")
        if self.chunked:
            self.wfile.write(b"0\r\n\r\n")

    # -- reading ------------------------------------------------------------

    def _read_body(self) -> bytes:
        """The request body, or RequestError; the connection closes when the body is not read."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise RequestError(411, "chunked request bodies are not supported: send a Content-Length")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            if self.command == "POST":
                raise RequestError(411, "a Content-Length header is required")
            return b""
        if len(set(lengths)) > 1 or not lengths[0].strip().isdigit():
            self.close_connection = True
            raise RequestError(400, "invalid Content-Length header")
        length = int(lengths[0])
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read, so the connection cannot be reused
            raise RequestError(413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        raw = self.rfile.read(length)
        if len(raw) < length:
            self.close_connection = True
            raise ClientGone()
        return raw

    def handle_expect_100(self) -> bool:
        """Refuse an oversized body before the client sends it."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send_json(413, RequestError(413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}").body())
            return False
        return super().handle_expect_100()

    # -- methods ------------------------------------------------------------

    def do_OPTIONS(self) -> None:
        """CORS preflight (browser-based clients send it before a POST with JSON)."""
        try:
            self._read_body()
        except (RequestError, ClientGone):
            pass
        self._head(204, None, None)
        self.send_header("Access-Control-Allow-Methods", "GET, POST, HEAD, OPTIONS")
        requested = self.headers.get("Access-Control-Request-Headers", "")
        # A wildcard does not cover Authorization, which OpenAI clients send: echo what was asked.
        self.send_header("Access-Control-Allow-Headers", requested if _HEADER_LIST.match(requested) else "*")
        self.send_header("Access-Control-Max-Age", "86400")
        self.end_headers()

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        try:
            self._read_body()  # a body on a GET is allowed; it must still be read to reuse the connection
        except RequestError as e:
            self._send_json(e.status, e.body())
            return
        except ClientGone:
            return
        path = self.path.split("?", 1)[0]
        app, worker = self.app, self.app.worker
        if path == "/health":
            if worker.state == "ready":
                self._send_json(200, {"status": "ok"})
            else:
                self._send_json(503, {"status": worker.state, "error": worker.error})
        elif path == "/v1/models":
            model = {"id": app.model_id, "object": "model", "created": app.created, "owned_by": "dflash-mlx"}
            self._send_json(200, {"object": "list", "data": [model]})
        elif path == "/metrics":
            text = app.metrics.render(worker.active, worker.jobs.qsize())
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        elif path in ROUTES:
            self._send_json(405, RequestError(405, f"{path} takes POST").body())
        else:
            self._send_json(404, RequestError(404, f"no route {path}").body())

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            raw = self._read_body()  # first, so that an error answer leaves the connection usable
            if path not in ROUTES:
                raise RequestError(405 if path in GET_ROUTES else 404, f"no POST route {path}")
            if not raw:
                raise RequestError(400, "the request body is empty: send a JSON object")
            if self.app.info is None or self.app.worker.state != "ready":
                raise RequestError(503, self.app.worker.error or f"the model is {self.app.worker.state}")
            request = parse_request(decode_json(raw), ROUTES[path], self.app.info)
        except RequestError as e:
            self._send_json(e.status, e.body())
            return
        except ClientGone:
            return
        except Exception as e:  # a bug in the checks must cost this request, not the connection's silence
            logging.exception("could not read a request")
            self._send_json(500, error_body(f"the server could not read this request: {one_line(e)}", 500))
            return
        job, reply = Job(request.params), Reply(request, self.app.info.tokenizer, self.app.fingerprint)
        try:
            self.app.worker.submit(job)
        except Unavailable as e:
            self._send_json(503, error_body(str(e), 503))
            return
        with self.app.metrics.lock:
            self.app.metrics.requests += 1
        self.app.enter()
        try:
            self._answer(request, job, reply)
        except (ConnectionError, TimeoutError):  # the client went away while we wrote
            self._cancel(job)
            self.close_connection = True
        except Exception:  # a bug here must cost this request: stop its generation, drop its connection
            logging.exception("could not answer a request")
            job.cancel()
            self.close_connection = True
        finally:
            self.app.leave()

    # -- answering ----------------------------------------------------------

    def _cancel(self, job: Job) -> None:
        """The client went away: stop generating for it."""
        with self.app.metrics.lock:
            self.app.metrics.cancelled += 1
        job.cancel()

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _events(self, job: Job) -> Iterator[Any]:
        """The worker's events for ``job``; cancels it and stops if the client disconnects while waiting."""
        checked = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                event = None
            # Checked while tokens flow too: a non-streaming client is never written to until the end.
            if time.monotonic() - checked >= POLL_SECONDS:
                checked = time.monotonic()
                if self._client_gone():
                    self._cancel(job)
                    self.close_connection = True
                    return
            if event is not None:
                yield event
                if isinstance(event, End):
                    return

    def _answer(self, request: Request, job: Job, reply: Reply) -> None:
        started = False  # the stream's headers are sent
        for event in self._events(job):
            if isinstance(event, End):  # the job ended before its reply did
                message, status = (event.error, event.status) if event.error else ("generation ended early", 500)
                if started:
                    self._event(error_body(message, status))
                    self._end_stream()
                else:
                    self._send_json(status, error_body(message, status))
                return
            chunks, done = reply.feed(event.text, event.finish_reason, event.generation_tokens)
            if chunks and not started:
                self._start_stream()
                started = True
            for chunk in chunks:
                self._event(chunk)
            if done:
                job.cancel()  # a stop string may have ended it early: free the worker
                break
        else:
            return  # the client went away
        if request.stream:
            if request.include_usage:
                self._event(reply.usage_chunk(job.cached_tokens))
            self._end_stream()
        else:
            self._send_json(200, reply.body(job.cached_tokens))


class Server(ThreadingHTTPServer):
    daemon_threads = True  # idle keep-alive connections must not hold up an exit
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], app: App):
        self.app, self.closing = app, False
        super().__init__(address, Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):  # a client that went away: not a server error
            logging.info("%s - connection ended: %s", client_address[0], one_line(error))
        else:
            logging.exception("error while serving %s", client_address[0])

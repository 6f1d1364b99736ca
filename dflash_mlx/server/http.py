"""The HTTP layer of ``dflash-mlx serve``: a Starlette app on uvicorn (h11), three APIs, one pipeline.

Why uvicorn and Starlette rather than the hand-written ``http.server`` transport
this replaced: the library parses HTTP/1.1 (h11) including chunked request
bodies (the old transport answered them 411), keep-alive with an idle timeout,
pipelining and HTTP/1.0 close-delimited streams; an event loop holds idle and
slow connections without a thread each (the old transport pinned one thread per
connection for up to two minutes, with no bound on threads); a client that goes
away is seen at once (``http.disconnect``) instead of by polling its socket
every 0.2 s; routing with path parameters (``/v1/responses/{id}``) and CORS are
the library's, so three APIs cost routes, not transport code. It is what vLLM,
SGLang and mlx-vlm serve on. What we gave up: a request h11 cannot parse (a
garbled request line, a bad Content-Length, an HTTP/1.1 request without Host)
gets uvicorn's own plain-text 400 and a closed connection, where the old
transport answered 400/414/431/505 in OpenAI's JSON shape (no API client sends
such requests). A client that stalls is cut off after ``READ_SECONDS``: mid-body
with a 408, mid-head by closing its connection (``_HeadDeadline``).

Routes: OpenAI chat and text completions, Anthropic Messages (and count_tokens),
OpenAI Responses (and GET/DELETE of a stored response), /v1/models, /health,
/metrics. Each generation route maps its body to the internal ``Request`` (in a
thread: tokenizing and the chat template are CPU work) and answers through its
API's renderer; every error is a 4xx/5xx in the API's own shape. The model runs
on the ``worker`` thread; the event loop only waits on a job's events, which the
worker puts into a queue that wakes the loop. A client that disconnects cancels
its job. ``--api-key`` guards every route but /health and CORS preflights.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import anyio
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.routing import Route

from ..errors import one_line
from . import anthropic
from .jobs import End, Job
from .protocol import RequestError, ServerInfo, decode_json, error_body
from .reply import Reply
from .request import parse_request
from .responses import ResponseStore, parse_response_request
from .streams import ClientGone, EventStream, JobRun, sse
from .worker import Metrics, Unavailable, Worker

MAX_BODY_BYTES = 16 * 2**20
READ_SECONDS = 120.0  # a client that stalls mid-body cannot hold its request open forever
PING_SECONDS = 10.0  # how often a stream that has nothing to say yet pings (Anthropic's streams)
KEEP_ALIVE_SECONDS = 60  # an idle keep-alive connection is closed after this
DRAIN_SECONDS = 10.0  # how long a shutdown waits for answers in flight to be written
APIS = ("chat", "text", "messages", "responses")


@dataclass
class App:
    """What the routes share."""

    worker: Worker
    metrics: Metrics
    model_id: str
    allowed_origins: list[str]
    info: ServerInfo | None = None  # once the model is loaded
    fingerprint: str = "dflash-mlx"
    api_key: str | None = None
    store: ResponseStore = field(default_factory=lambda: ResponseStore(100))
    created: int = field(default_factory=lambda: int(time.time()))
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(APIS, 0))  # accepted, per API
    busy: int = 0  # answers being generated or written now
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


def _shape(path: str) -> Callable[..., dict]:
    """The error shape of the API a path belongs to."""
    return anthropic.error_body if path.startswith("/v1/messages") else error_body


def _json(status: int, body: Any, headers: dict | None = None) -> Response:
    # As the old transport did: json.dumps' own spacing, which clients and tests compare byte for byte.
    return Response(json.dumps(body), status, headers, media_type="application/json")


def _error(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> Response:
    return _json(status, _shape(path)(message, status, param, code), headers)


async def _read_body(request: HttpRequest) -> bytes:
    """The request body (chunked or not), refused with a 413 before it is read when it is too big."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}")
    chunks, size = [], 0
    try:
        with anyio.fail_after(READ_SECONDS):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise RequestError(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {READ_SECONDS:.0f} seconds") from None
    return b"".join(chunks)


class Routes:
    """The endpoints, over one ``App``."""

    def __init__(self, app: App):
        self.app = app

    def _ready(self) -> ServerInfo:
        app = self.app
        if app.info is None or app.worker.state != "ready":
            raise RequestError(503, app.worker.error or f"the model is {app.worker.state}")
        return app.info

    async def health(self, request: HttpRequest) -> Response:
        worker = self.app.worker
        if worker.state == "ready":
            return _json(200, {"status": "ok"})
        return _json(503, {"status": worker.state, "error": worker.error})

    async def models(self, request: HttpRequest) -> Response:
        app = self.app
        # OpenAI's model list and Anthropic's, in one body: each client reads its own fields.
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(app.created))
        model = {"id": app.model_id, "object": "model", "created": app.created, "owned_by": "dflash-mlx",
                 "type": "model", "display_name": app.model_id, "created_at": created}
        return _json(200, {"object": "list", "data": [model], "has_more": False, "first_id": app.model_id,
                           "last_id": app.model_id})

    async def metrics(self, request: HttpRequest) -> Response:
        app = self.app
        text = app.metrics.render(app.worker.active, app.worker.jobs.qsize())
        lines = ["# HELP dflash_api_requests_total Generation requests accepted, by API",
                 "# TYPE dflash_api_requests_total counter"]
        lines += [f'dflash_api_requests_total{{api="{api}"}} {n}' for api, n in app.requests.items()]
        return Response(text + "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _body(self, request: HttpRequest) -> bytes:
        raw = await _read_body(request)  # first, so that an error answer leaves the connection usable
        if not raw:
            raise RequestError(400, "the request body is empty: send a JSON object")
        self._ready()
        return raw

    async def _guarded(self, request: HttpRequest, handler: Callable) -> Response:
        """``handler``'s answer, or its error in the route's API shape; a bug costs this request alone."""
        path = request.url.path
        try:
            return await handler()
        except RequestError as e:
            close = {"Connection": "close"} if e.status in (408, 413) else None  # the body was not read
            return _error(path, e.status, str(e), e.param, e.code, close)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        except Exception as e:
            logging.exception("could not answer a request")
            return _error(path, 500, f"the server could not answer this request: {one_line(e)}")

    def generation(self, api: str) -> Callable:
        async def endpoint(request: HttpRequest) -> Response:
            return await self._guarded(request, lambda: self._generate(request, api))

        return endpoint

    def _parse(self, api: str, raw: bytes) -> tuple[Any, Any]:
        """(internal request, renderer) for a body of ``api``; runs in a thread."""
        info = self.app.info
        body = decode_json(raw)
        if api == "messages":
            request, thinking = anthropic.parse_messages(body, info)
            return request, anthropic.MessageReply(request, info.tokenizer, thinking)
        if api == "responses":
            return parse_response_request(body, info, self.app.store)
        request = parse_request(body, api, info)
        return request, Reply(request, info.tokenizer, self.app.fingerprint)

    async def _generate(self, http: HttpRequest, api: str) -> Response:
        app = self.app
        raw = await self._body(http)
        request, reply = await run_in_threadpool(self._parse, api, raw)
        job = Job(request.params)
        run = JobRun(app.metrics, job, http.receive)
        try:
            app.worker.submit(job)
        except Unavailable as e:
            run.finished = True
            run.close()
            raise RequestError(503, str(e)) from None
        with app.metrics.lock:
            app.metrics.requests += 1
            app.requests[api] += 1
        app.enter()
        streaming = False
        try:
            if request.stream:
                first = await self._stream_start(run, reply)
                if isinstance(first, Response):
                    return first
                streaming = True

                def end() -> None:
                    run.close()
                    app.leave()

                return EventStream(self._stream(run, reply, first), end)
            return await self._whole(run, reply, http.url.path)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not streaming:
                run.close()
                app.leave()

    async def _whole(self, run: JobRun, reply: Any, path: str) -> Response:
        while True:
            event = await run.next()
            if isinstance(event, End):  # the job ended before its reply did
                message, status = (event.error, event.status) if event.error else ("generation ended early", 500)
                return _error(path, status, message)
            if reply.feed(event.text, event.finish_reason, event.generation_tokens)[1]:
                run.stop()
                return _json(200, reply.body(run.job.cached_tokens))

    async def _stream_start(self, run: JobRun, reply: Any) -> list | Response:
        """The first events of a stream. An API without opening events (chat completions) waits for the
        first chunk, so that a job that fails before it gets its HTTP status instead of a stream."""
        opening = reply.opening()
        if opening:
            return opening
        while True:
            event = await run.next()
            if isinstance(event, End):
                message, status = (event.error, event.status) if event.error else ("generation ended early", 500)
                return _json(status, error_body(message, status))
            chunks, done = reply.feed(event.text, event.finish_reason, event.generation_tokens)
            if done:
                run.stop()
                return chunks + reply.closing(run.job.cached_tokens)
            if chunks:
                return chunks

    async def _stream(self, run: JobRun, reply: Any, first: list) -> AsyncIterator[bytes]:
        named = reply.named_events
        try:
            for payload in first:
                yield sse(payload, named)
            while not run.finished:
                event = await run.next(PING_SECONDS)
                if event is None:
                    if (ping := reply.ping()) is not None:
                        yield sse(ping, named)
                    continue
                if isinstance(event, End):  # the job ended before its reply did
                    message, status = (event.error, event.status) if event.error else ("generation ended early", 500)
                    for payload in reply.failure(message, status):
                        yield sse(payload, named)
                    return
                chunks, done = reply.feed(event.text, event.finish_reason, event.generation_tokens)
                if done:
                    run.stop()
                    chunks += reply.closing(run.job.cached_tokens)
                for payload in chunks:
                    yield sse(payload, named)
        except ClientGone:
            return

    async def count_tokens(self, request: HttpRequest) -> Response:
        async def handler() -> Response:
            raw = await self._body(request)
            body = await run_in_threadpool(lambda: anthropic.count_tokens(decode_json(raw), self.app.info))
            return _json(200, body)

        return await self._guarded(request, handler)

    async def stored_response(self, request: HttpRequest) -> Response:
        async def handler() -> Response:
            await _read_body(request)
            response_id = request.path_params["response_id"]
            if request.method == "DELETE":
                self.app.store.delete(response_id)
                return _json(200, {"id": response_id, "object": "response", "deleted": True})
            return _json(200, self.app.store.get(response_id, param=None)[0])

        return await self._guarded(request, handler)


class KeyCheck:
    """ASGI middleware: every route but /health (and CORS preflights, answered outside it) needs the API key,
    as ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)."""

    def __init__(self, app: Any, key: str):
        self.app, self.key = app, key.encode()

    def _given(self, headers: list[tuple[bytes, bytes]]) -> list[bytes]:
        given = []
        for name, value in headers:
            if name == b"x-api-key":
                given.append(value.strip())
            elif name == b"authorization" and value[:7].lower() == b"bearer ":
                given.append(value[7:].strip())
        return given

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        # compare_digest takes as long whatever the key's prefix: the time says nothing about the key.
        if any(hmac.compare_digest(value, self.key) for value in self._given(scope["headers"])):
            await self.app(scope, receive, send)
            return
        message = ("a wrong API key" if self._given(scope["headers"]) else "no API key") + (
            ": send the server's --api-key as 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        headers = {"WWW-Authenticate": "Bearer"}
        if scope.get("http_version") == "1.0" or any(n == b"content-length" and v.strip() not in (b"", b"0")
                                                     for n, v in scope["headers"]):
            headers["Connection"] = "close"  # the body is not read: the connection cannot carry another request
        await _error(scope["path"], 401, message, headers=headers)(scope, receive, send)


def asgi(app: App) -> Starlette:
    """The ASGI application serving ``app``."""
    routes = Routes(app)
    table = [
        Route("/health", routes.health, methods=["GET"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
        Route("/v1/messages", routes.generation("messages"), methods=["POST"]),
        Route("/v1/responses", routes.generation("responses"), methods=["POST"]),
        Route("/v1/responses/{response_id}", routes.stored_response, methods=["GET", "DELETE"]),
    ]
    for path, api in [("/v1/chat/completions", "chat"), ("/chat/completions", "chat"), ("/v1/completions", "text"),
                      ("/completions", "text")]:
        table.append(Route(path, routes.generation(api), methods=["POST"]))

    async def http_error(request: HttpRequest, e: HTTPException) -> Response:
        path, method = request.url.path, request.method
        shown = path if len(path) <= 200 else path[:200] + "..."
        message = f"{shown} does not take {method}" if e.status_code == 405 else f"no route {method} {shown}"
        return _error(path, e.status_code, message, headers=e.headers)

    middleware = [Middleware(CORSMiddleware, allow_origins=app.allowed_origins, allow_headers=["*"],
                             allow_methods=["GET", "POST", "DELETE", "HEAD", "OPTIONS"], max_age=86400)]
    if app.api_key:
        middleware.append(Middleware(KeyCheck, key=app.api_key))
    return Starlette(routes=table, middleware=middleware, exception_handlers={HTTPException: http_error})


class _HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, with a bound on the time a client takes to send a request head: a connection
    that has not begun a request within READ_SECONDS of connecting, or of its last answer, is closed (uvicorn
    times out only idle keep-alive connections: one stalled mid-head would hold its socket forever)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        self.loop.call_later(READ_SECONDS, self._expire, self.cycle)

    def _expire(self, cycle: Any) -> None:
        if self.cycle is cycle and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


class Server:
    """A bound socket and the uvicorn server that serves ``app`` on it.

    Binding happens here, before the model loads, so that a busy port is
    reported at once. ``serve_forever`` runs uvicorn on the calling thread (its
    own event loop; signals stay with the main thread); ``shutdown`` stops
    accepting, and ``server_close`` waits for the answers in flight and
    releases the socket.
    """

    def __init__(self, address: tuple[str, int], app: App):
        host, port = address
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.socket = socket.create_server((host, port), family=family, backlog=64)
        self.server_address = self.socket.getsockname()
        self.app = app
        config = uvicorn.Config(
            asgi(app), http=_HeadDeadline, lifespan="off", log_config=None, timeout_keep_alive=KEEP_ALIVE_SECONDS,
            timeout_graceful_shutdown=int(DRAIN_SECONDS), server_header=False, headers=[("Server", "dflash-mlx")],
        )
        self.uvicorn = uvicorn.Server(config)
        self.started, self.stopped = threading.Event(), threading.Event()

    def serve_forever(self) -> None:
        self.started.set()
        try:
            asyncio.run(self.uvicorn.serve(sockets=[self.socket]))
        finally:
            self.stopped.set()

    def shutdown(self) -> None:
        """Stop accepting connections; idle ones close, answers in flight go on."""
        self.uvicorn.should_exit = True

    def server_close(self) -> None:
        self.uvicorn.should_exit = True
        if self.started.is_set() and not self.stopped.wait(DRAIN_SECONDS + 5):
            logging.warning("the HTTP server did not stop within %.0f seconds", DRAIN_SECONDS + 5)
        self.socket.close()

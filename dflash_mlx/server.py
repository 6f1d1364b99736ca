"""``dflash-mlx serve``: an OpenAI-compatible HTTP server with DFlash decoding.

Requests and responses follow mlx_lm.server where they overlap
(``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``). Every sampling
parameter is either honoured exactly or refused with a 400 naming it.

Threads: HTTP handlers only parse, tokenize and write; all MLX work runs on
one ``Worker`` thread (MLX streams are per thread), which serves queued
requests one at a time and keeps the caches of the last conversation so the
next turn prefills only its new tokens. A handler whose client goes away
cancels its request, queued or running.

MLX-backed modules are imported inside functions: the CLI imports this module
to build its parser, and ``dflash-mlx --help`` should not load MLX.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import select
import socket
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

from .errors import DFlashError
from .protocol import Request, RequestError, StopMatcher, parse_request
from .worker import Job, Metrics, Worker

MAX_BODY_BYTES = 16 * 2**20
POLL_SECONDS = 0.2  # how often a waiting handler checks that its client is still there
_NOTHING_YET = object()


@dataclass
class App:
    """What the request handlers share."""

    worker: Worker
    metrics: Metrics
    defaults: argparse.Namespace
    model_id: str
    max_prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.worker.model.target.vocab_size

    @property
    def model_names(self) -> set[str]:
        names = {self.model_id, "default_model"}
        path = Path(self.model_id)
        if path.exists():
            names |= {str(path.resolve()), path.name}
        return names


# -- HTTP ---------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    server_version = "dflash-mlx"
    timeout = 120  # socket timeout: a client that stalls mid-body cannot pin a thread forever

    @property
    def app(self) -> App:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args) -> None:
        logging.info("%s - %s", self.address_string(), format % args)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str, content_type: str = "text/plain; version=0.0.4") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            model = {"id": self.app.model_id, "object": "model", "created": self.app.created, "owned_by": "dflash-mlx"}
            self._send_json(200, {"object": "list", "data": [model]})
        elif path == "/metrics":
            w = self.app.worker
            self._send_text(200, self.app.metrics.render(w.active, w.jobs.qsize()))
        else:
            self._send_json(404, RequestError(404, f"no route {path}").body())

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        kinds = {
            "/v1/chat/completions": "chat",
            "/chat/completions": "chat",
            "/v1/completions": "text",
            "/completions": "text",
        }
        try:
            if path not in kinds:
                raise RequestError(404, f"no route {path}")
            request = parse_request(self._read_json(), kinds[path], self.app)
        except RequestError as e:
            self._send_json(e.status, e.body())
            return
        with self.app.metrics.lock:
            self.app.metrics.requests += 1
        try:
            self._complete(request)
        except (BrokenPipeError, ConnectionResetError):
            self._cancel(request.job)
        except Exception:  # a bug here must cost one request, not the server
            logging.exception("request failed")
            request.job.cancelled.set()

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "a Content-Length header is required")
        try:
            length = int(length)
        except ValueError:
            raise RequestError(400, "invalid Content-Length header") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read, so the connection cannot be reused
            raise RequestError(413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(400, f"invalid JSON in the request body: {e}") from None

    def _cancel(self, job: Job) -> None:
        """The client went away: stop generating for it."""
        with self.app.metrics.lock:
            self.app.metrics.cancelled += 1
        job.cancelled.set()

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _events(self, job: Job) -> Iterator[Any]:
        """The worker's responses for ``job``; cancels it if the client disconnects while waiting."""
        self.app.worker.jobs.put(job)
        checked = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                event = _NOTHING_YET
            # Checked while tokens flow too: a non-streaming client is never written to until the end.
            if time.monotonic() - checked >= POLL_SECONDS:
                checked = time.monotonic()
                if self._client_gone():
                    self._cancel(job)
                    return
            if event is None:
                return
            if event is not _NOTHING_YET:
                yield event

    def _complete(self, request: Request) -> None:
        job = request.job
        chat = request.kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}"
        base = {
            "id": rid,
            "system_fingerprint": self.app.defaults.fingerprint,
            "model": request.model,
            "created": int(time.time()),
        }
        obj = ("chat.completion.chunk" if request.stream else "chat.completion") if chat else "text_completion"
        matcher = StopMatcher(request.stop)

        def choice(text: str, finish: str | None) -> dict:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if not chat:
                c["text"] = text
            elif request.stream:
                c["delta"] = {"role": "assistant", **({"content": text} if text else {})}
            else:
                c["message"] = {"role": "assistant", "content": text}
            return c

        def usage(completion_tokens: int) -> dict:
            n = len(job.prompt)
            return {
                "prompt_tokens": n,
                "completion_tokens": completion_tokens,
                "total_tokens": n + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
            }

        if request.stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()

        def send(payload: dict) -> None:
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        text, finish, tokens, failure = "", None, 0, None
        for event in self._events(job):
            if isinstance(event, Exception):
                failure = event
                break
            tokens = event.generation_tokens
            piece, stopped = matcher.feed(event.text)
            finish = "stop" if stopped else event.finish_reason
            if finish is not None and not stopped:
                piece += matcher.flush()
            if request.stream and (piece or finish):
                send({**base, "object": obj, "choices": [choice(piece, finish)]})
            text += piece
            if stopped:
                job.cancelled.set()  # a stop string ended the answer: free the worker
                break
        if job.cancelled.is_set() and finish is None:
            return  # the client went away mid-request
        if failure is not None:
            message = f"generation failed: {failure}"
            error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
            if request.stream:
                send(error)
                self.wfile.write(b"data: [DONE]\n\n")
            else:
                self._send_json(400 if isinstance(failure, DFlashError) else 500, error)
            return
        if request.stream:
            if request.include_usage:
                send({**base, "object": obj, "choices": [], "usage": usage(tokens)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        else:
            body = {**base, "object": obj, "choices": [choice(text, finish)], "usage": usage(tokens)}
            self._send_json(200, body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], app: App):
        super().__init__(address, Handler)
        self.app = app


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .flags import add_block_arguments

    p.add_argument("--model", required=True, help="Target model: local folder or Hub repo id")
    p.add_argument("--draft", required=True, help="DFlash drafter: local folder or Hub repo id")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on")
    p.add_argument("--port", type=int, default=8080, help="Port to listen on (0: any free port)")
    p.add_argument("--max-tokens", type=int, default=512, help="Default max_tokens of a request")
    p.add_argument("--temp", type=float, default=0.0, help="Default sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="Default sampling top-p")
    p.add_argument("--top-k", type=int, default=0, help="Default sampling top-k")
    p.add_argument("--min-p", type=float, default=0.0, help="Default sampling min-p")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="Refuse longer prompts (default: the target's max_position_embeddings)")
    add_block_arguments(p)


def make_server(args: argparse.Namespace) -> Server:
    """Load the model on the worker thread and bind the HTTP server (not yet serving)."""
    import mlx.core as mx

    metrics = Metrics()
    worker = Worker(args, metrics)
    worker.start()
    worker.ready.wait()
    if worker.error is not None:
        if isinstance(worker.error, DFlashError):
            raise worker.error
        raise DFlashError(f"could not load the model: {worker.error}")
    limit = args.max_prompt_tokens or getattr(worker.model.target.model.args, "max_position_embeddings", None) or 32768
    args.fingerprint = f"dflash-mlx-mlx-{mx.__version__}"
    app = App(worker, metrics, args, args.model, limit)
    try:
        return Server((args.host, args.port), app)
    except OSError as e:
        worker.stop()
        raise DFlashError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = make_server(args)
    host, port = server.server_address[:2]
    logging.info("dflash-mlx serving %s on http://%s:%d", args.model, host, port)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        server.app.worker.stop()

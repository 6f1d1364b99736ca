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
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

from .errors import DFlashError

MAX_BODY_BYTES = 16 * 2**20
POLL_SECONDS = 0.2  # how often a waiting handler checks that its client is still there
_NOTHING_YET = object()

# Request keys refused outright, with why (anything else unknown is refused too).
UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "tool calling is not supported",
    "response_format": "structured output is not supported",
    "adapters": "adapters are not supported",
    "draft_model": "the drafter is fixed at start-up (--draft)",
    "role_mapping": "only the model's chat template is supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported",
}
COMMON_KEYS = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "stop", "seed", "stream", "stream_options", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size",
    "logit_bias", "xtc_probability", "xtc_threshold", "n", "logprobs", "top_logprobs",
    "num_draft_tokens", "user",
}


class RequestError(Exception):
    """A client error: the HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


# -- request parsing ----------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{name} must be a number", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(400, f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def _integer(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{name} must be an integer", name)
    if lo is not None and value < lo:
        raise RequestError(400, f"{name} must be at least {lo}, got {value}", name)
    return value


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


@dataclass
class Request:
    kind: str  # "chat" or "text"
    model: str
    stream: bool
    include_usage: bool
    stop: list[str]
    job: Job


def parse_request(body: Any, kind: str, app: "App") -> Request:
    """Validate a completion request body into a Job, or raise RequestError (4xx)."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from .model import MAX_BLOCK_SIZE
    from .sampling import SamplingParams

    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not given"
    allowed = COMMON_KEYS | ({"messages", "chat_template_kwargs"} if kind == "chat" else {"prompt"})
    for key in body:
        if key in UNSUPPORTED:
            raise RequestError(400, f"unsupported parameter {key!r}: {UNSUPPORTED[key]}", key)
        if key not in allowed:
            raise RequestError(400, f"unsupported parameter {key!r}", key)

    model = body.get("model", "default_model")
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string", "model")
    if model not in app.model_names:
        message = f"model {model!r} not found: this server serves {app.model_id!r}"
        raise RequestError(404, message, "model", "model_not_found")
    if _integer(body, "n", 1, lo=1) != 1:
        raise RequestError(400, "n > 1 is not supported: send one request per completion", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise RequestError(400, "logprobs is not supported", "logprobs")
    if body.get("top_logprobs") not in (None, -1, 0):
        raise RequestError(400, "top_logprobs is not supported", "top_logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be a boolean", "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(400, "stream_options must be {\"include_usage\": bool}", "stream_options")

    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop must be a non-empty string or a list of them", "stop")

    d = app.defaults
    max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
    max_tokens = _integer(body, "max_tokens", max_tokens or d.max_tokens, lo=1)
    temp = _number(body, "temperature", d.temp, lo=0)
    top_p = _number(body, "top_p", d.top_p, lo=0, hi=1)
    top_k = _integer(body, "top_k", d.top_k, lo=0)
    min_p = _number(body, "min_p", d.min_p, lo=0, hi=1)
    xtc_probability = _number(body, "xtc_probability", 0.0, lo=0, hi=1)
    xtc_threshold = _number(body, "xtc_threshold", 0.1, lo=0, hi=0.5)
    if top_p == 0:
        raise RequestError(400, "top_p must be > 0", "top_p")
    try:
        SamplingParams(temp, top_p, top_k, min_p)
    except DFlashError as e:
        raise RequestError(400, str(e), "temperature") from None
    sampling: dict[str, Any] = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    if xtc_probability > 0 and temp > 0:
        # XTC is an opaque sampler: still exact (the match strategy), but it accepts fewer drafts.
        specials = app.tokenizer.encode("\n", add_special_tokens=False) + list(app.tokenizer.eos_token_ids)
        sampling["sampler"] = make_sampler(temp, top_p, min_p, 1, top_k, xtc_probability, xtc_threshold, specials)

    num_draft = _integer(body, "num_draft_tokens", None, lo=0)
    if num_draft is not None:
        if num_draft + 1 > MAX_BLOCK_SIZE:
            raise RequestError(400, f"num_draft_tokens must be at most {MAX_BLOCK_SIZE - 1}", "num_draft_tokens")
        sampling["block_size"] = num_draft + 1

    penalties = {}
    for name, lo in (("repetition_penalty", 0), ("presence_penalty", None), ("frequency_penalty", None)):
        value = _number(body, name, 0.0, lo=lo)
        if value:
            penalties[name] = value
            context = name.split("_")[0] + "_context_size"
            penalties[context] = _integer(body, context, 20, lo=0)
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            bias = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError):
            raise RequestError(400, "logit_bias must map token ids to numbers", "logit_bias") from None
        if any(not 0 <= k < app.vocab_size for k in bias):
            raise RequestError(400, f"logit_bias token ids must be in [0, {app.vocab_size})", "logit_bias")
        penalties["logit_bias"] = bias
    if penalties:
        sampling["logits_processors"] = make_logits_processors(**penalties)

    prompt = _chat_prompt(body, app) if kind == "chat" else _text_prompt(body, app)
    if len(prompt) > app.max_prompt_tokens:
        raise RequestError(
            400,
            f"the prompt is {len(prompt)} tokens; this server takes at most {app.max_prompt_tokens} "
            "(--max-prompt-tokens)",
            "messages" if kind == "chat" else "prompt",
            "context_length_exceeded",
        )
    job = Job(prompt, max_tokens, sampling, _integer(body, "seed", None))
    return Request(kind, model, stream, options.get("include_usage", False), stop, job)


def _chat_prompt(body: dict, app: "App") -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    clean = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, "each message needs a role and content", "messages")
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(400, "only text content parts are supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RequestError(400, "message content must be a string or text parts", "messages")
        clean.append({"role": m["role"], "content": content})
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise RequestError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    if app.tokenizer.chat_template is None:
        raise RequestError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        text = app.tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # a template can raise anything (e.g. on an unexpected role)
        raise RequestError(400, f"the chat template failed on these messages: {e}", "messages") from None
    # The template writes any special tokens itself, as mlx_lm.server's tokenized template does.
    return app.tokenizer.encode(text, add_special_tokens=False)


def _text_prompt(body: dict, app: "App") -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "prompt must be a non-empty string", "prompt")
    bos = app.tokenizer.bos_token
    return app.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


class StopMatcher:
    """Cuts generated text at the first stop string, holding back possible stop prefixes."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop string ended the output."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# -- the generation worker ----------------------------------------------------


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

        # Under mlx.launch only rank 0 returns (and serves); the other ranks follow it inside load.
        pipeline = getattr(self.args, "pipeline", False)  # an argparse.Namespace built in code may lack it
        self.model, self.tokenizer = load(self.args.model, self.args.draft, pipeline=pipeline)
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
    from .flags import add_block_arguments, add_sharding_arguments

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
    add_sharding_arguments(p)


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

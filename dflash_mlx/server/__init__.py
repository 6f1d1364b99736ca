"""``dflash-mlx serve``: an HTTP server with DFlash decoding for OpenAI's and Anthropic's clients.

OpenAI chat and text completions follow mlx_lm.server where they overlap
(``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, tool calls,
``--allowed-origins``, ``--chat-template``); Anthropic's Messages API
(``/v1/messages``) and OpenAI's Responses API (``/v1/responses``) share their
pipeline (docs/serving.md). This module is the command: its flags, start-up
(bind first, then load the model on the worker thread) and shutdown. SIGINT/SIGTERM end the jobs in flight (their clients get a 503 or an
error event), join the worker (an MLX thread must not meet interpreter
teardown) and exit 130 or 0; a second signal exits at once.

MLX-backed modules are imported inside functions: the CLI imports this module
to build its parser, and ``dflash-mlx --help`` should not load MLX.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import DFlashError, one_line
from ..flags import (add_block_arguments, add_sampling_arguments, add_sharding_arguments, byte_size, non_negative_int,
                     port_arg, positive_int, resolve_pair)
from .http import DRAIN_SECONDS, App, Server
from .protocol import ServerInfo, check_flags
from .responses import ResponseStore
from .worker import Metrics, Worker

API_KEY_VARIABLE = "DFLASH_MLX_API_KEY"
SIGNALS = {signal.SIGINT, signal.SIGTERM}


def start_thread(thread: threading.Thread) -> None:
    """Start ``thread`` with SIGINT/SIGTERM blocked in it and in every thread it starts.

    Python runs signal handlers on the main thread only, and a signal the kernel
    hands to another thread (the busy worker, say) waits until the main thread
    wakes up by itself; blocked elsewhere, it goes to the main thread at once.
    """
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def chat_template_arg(text: str) -> str:
    """A Jinja chat template, given inline or as a file."""
    path = Path(text).expanduser()
    try:
        return path.read_text() if path.is_file() else text
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {text}: {one_line(e)}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Target model: local folder or Hub repo id (default, with no --draft: the built-in pair)")
    p.add_argument("--draft", default=None, help="DFlash drafter: local folder or Hub repo id")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on")
    p.add_argument("--api-key", default=None,
                   help=f"Require this key on every route but /health (Authorization: Bearer KEY, or x-api-key: KEY); "
                        f"default: the {API_KEY_VARIABLE} environment variable, else no key")
    p.add_argument("--response-store-size", type=non_negative_int, default=100,
                   help="Most responses /v1/responses keeps for previous_response_id and GET (least recently used "
                        "out first; 0: none)")
    p.add_argument("--port", type=port_arg, default=8080, help="Port to listen on (0: any free port)")
    p.add_argument("--allowed-origins", type=lambda s: s.split(","), default=["*"],
                   help="Comma-separated origins browsers may call from (CORS; default: *)")
    p.add_argument("--chat-template", type=chat_template_arg, default=None,
                   help="Chat template (Jinja source, or a file holding it) replacing the model's")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="Default max_tokens of a request")
    add_sampling_arguments(p, "Default sampling temperature of a request (0: greedy)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="Refuse longer prompts (default: the target's max_position_embeddings)")
    p.add_argument("--decode-concurrency", type=positive_int, default=8,
                   help="Decode up to this many requests together; 1 serves one at a time")
    p.add_argument("--prefill-step-size", type=positive_int, default=None,
                   help="Most prompt tokens per prefill forward (default: chunks of the size this machine "
                        "prefills fastest, measured once and kept, per request, at most 512 tokens per step "
                        "while requests decode, where a joining prompt holds them up)")
    p.add_argument("--prompt-cache-size", type=non_negative_int, default=10,
                   help="Most finished requests whose caches later requests may start from (0: none)")
    p.add_argument("--prompt-cache-bytes", type=byte_size, default=None,
                   help="Most bytes those caches may hold in RAM (default: an eighth of physical memory, "
                        "at most 8 GiB)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="Also keep them as files in DIR, written in the background and found again after a "
                        "restart (default: RAM only)")
    p.add_argument("--prompt-cache-disk-bytes", type=byte_size, default=None, metavar="N",
                   help="Most bytes the files in --prompt-cache-dir may hold, oldest used evicted first "
                        "(default: 10 GiB; never more than half the free space)")
    add_block_arguments(p)
    add_sharding_arguments(p)


def resolve_api_key(flag: str | None) -> str | None:
    """The key requests must carry: ``--api-key``, else the environment variable, else none."""
    key = flag if flag is not None else os.environ.get(API_KEY_VARIABLE) or None
    if key is not None and (not key or not key.isascii() or not key.isprintable() or key != key.strip()):
        raise DFlashError("the API key must be printable ASCII without surrounding spaces (an HTTP header carries it)")
    return key


def make_server(args: argparse.Namespace) -> Server:
    """Bind, then load the model on the worker thread; the server is ready but not yet serving."""
    import mlx.core as mx

    from ..model import MAX_BLOCK_SIZE

    check_flags(args)
    resolve_pair(args)
    api_key = resolve_api_key(args.api_key)
    if args.block_size is None:  # coupled sampling keeps a seeded request's text at every block size
        args.block_size = "auto"
    defaults = {"temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    metrics = Metrics()
    worker = Worker(args, metrics)
    app = App(worker, metrics, args.model, args.allowed_origins, fingerprint=f"dflash-mlx-mlx-{mx.__version__}",
              api_key=api_key, store=ResponseStore(args.response_store_size))
    try:  # before loading: a busy port is reported at once, and no MLX thread is left behind
        server = Server((args.host, args.port), app)
    except OSError as e:
        reason = e.strerror or one_line(e)
        raise DFlashError(f"cannot listen on {args.host}:{args.port}: {reason}; fix: pick another --host or --port") from None
    start_thread(worker)
    try:
        worker.ready.wait()
        if worker.state != "ready":
            raise DFlashError(worker.error or "the model did not load")
        target = worker.model.target
        context = getattr(target.model.args, "max_position_embeddings", None) or 32768
        if args.max_tokens > context:
            raise DFlashError(f"--max-tokens {args.max_tokens} is more than the model's context length {context}")
        app.info = ServerInfo(
            args.model, worker.tokenizer, target.vocab_size, args.max_prompt_tokens or context, context, MAX_BLOCK_SIZE,
            args.max_tokens, defaults,
        )
    except BaseException:  # a load error, or a signal while loading: the worker finishes loading, then stops
        stop_worker(worker)
        server.server_close()
        raise
    return server


def stop_worker(worker: Worker) -> None:
    """End the worker's jobs, join it, and free what it held, here on the calling thread.

    Left to interpreter teardown, the worker's garbage (reference cycles holding
    MLX arrays) is collected on whichever thread runs then, and exiting aborts
    with "terminate called without an active exception" (7 exits in 8 here).
    """
    worker.close()  # queued and running jobs end; their clients get a 503 or an error event
    worker.join()
    worker.model = worker.engine = worker.prompt_cache = None
    gc.collect()


def close(server: Server) -> None:
    """End what is in flight, join the worker, and release the socket."""
    server.shutdown()
    stop_worker(server.app.worker)
    if not server.app.wait_idle(DRAIN_SECONDS):
        logging.warning("%d answers were still being written at exit", server.app.busy)
    server.server_close()


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_signals: list[int] = []


def _on_signal(signum: int, frame: Any) -> None:
    if _signals:  # a second signal: stop waiting for the worker
        os._exit(128 + signum)
    _signals.append(signum)
    raise Interrupted(signum)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    previous = {signum: signal.signal(signum, _on_signal) for signum in SIGNALS}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # in case whoever started us blocked them
    server = thread = None
    try:
        server = make_server(args)
        thread = threading.Thread(target=server.serve_forever, name="dflash-http", daemon=True)
        start_thread(thread)
        host, port = server.server_address[:2]
        logging.info("dflash-mlx serving %s on http://%s:%d", args.model, host, port)
        while True:
            time.sleep(3600)
    except Interrupted as e:
        logging.info("%s: shutting down", e)
        if server is not None:
            if thread is not None and thread.is_alive():
                server.shutdown()  # stop accepting
            close(server)
        if e.signum == signal.SIGINT:
            raise KeyboardInterrupt from None  # the CLI exits 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

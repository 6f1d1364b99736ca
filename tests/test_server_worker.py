"""The generation worker without a model: jobs that fail, a loop that fails, /health telling the truth."""

import argparse
import http.client
import json
import threading

from types import SimpleNamespace

import pytest

from dflash_mlx.request import TokenEvent
from dflash_mlx.server.request import GenerationParams
from dflash_mlx.stats import EngineStats, SpeculativeStats
from dflash_mlx.server.http import App, Server
from dflash_mlx.server.worker import End, Job, Metrics, Unavailable, Worker


class Detokenizer:
    def __init__(self):
        self.last_segment = ""

    def add_token(self, token):
        self.last_segment = str(token)

    def finalize(self):
        pass


class Tokenizer:  # what the worker reads of mlx_lm's TokenizerWrapper
    eos_token_ids = [0]

    @property
    def detokenizer(self):
        return Detokenizer()


class Engine:
    """Runs one request per step: ``generate(prompt)`` gives its tokens, or raises."""

    def __init__(self, generate):
        self.generate, self.stats = generate, EngineStats(batched=True)
        self.pending, self.rows, self.max_rows, self._uids = [], [], 8, iter(range(10**6))

    @property
    def idle(self):
        return not self.pending and not self.rows

    def add(self, prompt, **kwargs):
        self.pending.append(SimpleNamespace(uid=next(self._uids), prompt=prompt, stats=SpeculativeStats(4, "mlx")))
        return self.pending[-1].uid

    def cached_tokens(self, uid):
        return 0

    def cancel(self, uid):
        self.rows = [r for r in self.rows if r.uid != uid]
        self.pending = [r for r in self.pending if r.uid != uid]

    def step(self):
        if not self.rows:
            self.rows.append(self.pending.pop(0))
        row = self.rows.pop(0)
        tokens = self.generate(row.prompt)
        return [TokenEvent(row.uid, t, False, "length" if i == len(tokens) - 1 else None, None,
                           row.stats if i == len(tokens) - 1 else None) for i, t in enumerate(tokens)]


def worker(monkeypatch, generate, load=None):
    """A Worker whose engine is ``Engine(generate)``."""
    def loaded(self):
        self.tokenizer = Tokenizer()
        self.engine = self._engine()

    monkeypatch.setattr(Worker, "_load", load or loaded)
    monkeypatch.setattr(Worker, "_engine", lambda self: Engine(generate))
    w = Worker(argparse.Namespace(block_size=4), Metrics())
    w.start()
    w.ready.wait(10)
    return w


def events(job, timeout=10):
    out = []
    while not isinstance(out[-1:] and out[-1], End):
        out.append(job.events.get(timeout=timeout))
    return out


def test_a_failing_step_ends_its_jobs_and_the_next_is_served(monkeypatch):
    def generate(prompt):
        if prompt == [666]:
            raise RuntimeError("boom")
        return [7]

    w = worker(monkeypatch, generate)
    bad, good = Job(GenerationParams([666], 4)), Job(GenerationParams([1], 4))
    w.submit(bad)
    assert events(bad) == [End("generation failed: boom", 500)]
    w.submit(good)  # the worker goes on with a fresh engine
    got = events(good)
    assert got[0].text == "7" and got[0].finish_reason == "length" and got[1] == End()
    assert w.state == "ready" and w.metrics.failed == 1
    w.close()
    w.join(10)
    assert w.state == "stopped" and not w.is_alive()
    with pytest.raises(Unavailable, match="shutting down"):
        w.submit(Job(GenerationParams([1], 4)))


def test_close_ends_running_and_queued_jobs(monkeypatch):
    started, release = threading.Event(), threading.Event()

    def generate(prompt):
        started.set()
        release.wait(10)
        return [7]

    w = worker(monkeypatch, generate)
    running, queued = Job(GenerationParams([1], 4)), Job(GenerationParams([2], 4))
    w.submit(running)
    w.submit(queued)
    started.wait(10)
    w.close()
    release.set()
    w.join(10)
    assert events(running) == [End("the server is shutting down", 503)]
    assert events(queued) == [End("the server is shutting down", 503)]


def test_a_broken_loop_is_reported(monkeypatch):
    w = worker(monkeypatch, lambda prompt: [7])
    monkeypatch.setattr(Worker, "_step", lambda self: (_ for _ in ()).throw(SystemExit("bug")))
    w.submit(Job(GenerationParams([1], 4)))
    w.join(10)
    assert w.state == "failed" and "the generation worker stopped: bug" in w.error
    with pytest.raises(Unavailable, match="worker stopped"):
        w.submit(Job(GenerationParams([1], 4)))


@pytest.mark.parametrize("state", ["failed-load", "stopped"])
def test_health_says_503_when_the_worker_cannot_serve(monkeypatch, state):
    def load(self):
        raise OSError("no weights")

    w = worker(monkeypatch, lambda prompt: [7], load if state == "failed-load" else None)
    if state == "stopped":
        w.close()
    w.join(10)
    server = Server(("127.0.0.1", 0), App(w, w.metrics, "m", ["*"]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("GET", "/health")
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 503 and body["status"] == state.split("-")[0]
    assert body["error"] == ("could not load the model: no weights" if state == "failed-load" else "the server is shutting down")
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    r = conn.getresponse()
    assert r.status == 503 and json.loads(r.read())["error"]["type"] == "server_error"
    server.shutdown()
    server.server_close()

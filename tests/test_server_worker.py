"""The generation worker without a model: jobs that fail, a loop that fails, /health telling the truth."""

import argparse
import http.client
import json
import threading

import pytest

from dflash_mlx.server.request import GenerationParams
from dflash_mlx.server.http import App, Server
from dflash_mlx.server.worker import End, Job, Metrics, Unavailable, Worker


class Response:  # the fields of a GenerationResponse the worker reads
    def __init__(self, text):
        self.text = text


def worker(monkeypatch, generate, load=lambda self: None):
    """A Worker whose model is a function: ``generate(job)`` puts responses or raises."""
    monkeypatch.setattr(Worker, "_load", load)
    monkeypatch.setattr(Worker, "_generate", lambda self, job: generate(job))
    w = Worker(argparse.Namespace(), Metrics())
    w.start()
    w.ready.wait(10)
    return w


def events(job, timeout=10):
    out = []
    while not isinstance(out[-1:] and out[-1], End):
        out.append(job.events.get(timeout=timeout))
    return out


def test_a_failing_job_ends_alone(monkeypatch):
    def generate(job):
        if job.params.prompt == [666]:
            raise RuntimeError("boom")
        job.events.put(Response("fine"))

    w = worker(monkeypatch, generate)
    bad, good = Job(GenerationParams([666], 4)), Job(GenerationParams([1], 4))
    w.submit(bad)
    w.submit(good)
    assert events(bad) == [End("generation failed: boom", 500)]
    got = events(good)
    assert got[0].text == "fine" and got[1] == End()
    assert w.state == "ready" and w.metrics.failed == 1
    w.close()
    w.join(10)
    assert w.state == "stopped" and not w.is_alive()
    with pytest.raises(Unavailable, match="shutting down"):
        w.submit(Job(GenerationParams([1], 4)))


def test_close_ends_running_and_queued_jobs(monkeypatch):
    started, release = threading.Event(), threading.Event()

    def generate(job):
        started.set()
        release.wait(10)

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
    w = worker(monkeypatch, lambda job: None)
    monkeypatch.setattr(Worker, "_run", lambda self, job: (_ for _ in ()).throw(SystemExit("bug")))
    w.submit(Job(GenerationParams([1], 4)))
    w.join(10)
    assert w.state == "failed" and "the generation worker stopped: bug" in w.error
    with pytest.raises(Unavailable, match="worker stopped"):
        w.submit(Job(GenerationParams([1], 4)))


@pytest.mark.parametrize("state", ["failed-load", "stopped"])
def test_health_says_503_when_the_worker_cannot_serve(monkeypatch, state):
    def load(self):
        raise OSError("no weights")

    w = worker(monkeypatch, lambda job: None, load if state == "failed-load" else lambda self: None)
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

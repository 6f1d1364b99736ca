"""``dflash-mlx serve`` as a process: signals, a busy port, bad flags (tiny models)."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dflash_mlx.cli import main

# Real server processes and signals, ~15 s together: outside the default run.
pytestmark = pytest.mark.slow
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


class Serve:
    """A ``dflash-mlx serve`` subprocess; its stderr is collected as it comes."""

    def __init__(self, *argv, blocked=(), env=ENV):
        # A child inherits its parent's blocked signals: ``blocked`` plays a parent that blocks SIGINT.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dflash_mlx", "serve", *argv], stderr=subprocess.PIPE, text=True, env=env
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()

    def port(self, timeout=120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in list(self.lines):
                if match := re.search(r"serving .* on http://[\d.]+:(\d+)", line):
                    return int(match.group(1))
            time.sleep(0.05)
        raise AssertionError("no server: " + "".join(self.lines))

    def wait(self, timeout=60) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        return code, "".join(self.lines)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return list(map(str, tiny_pair("qwen3")))


def stream_until_first_token(port):
    """A long streaming request; returns its connection, response and the first bytes once tokens flow."""
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "stream": True,
            "logit_bias": {"2": -100}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    r = conn.getresponse()
    assert r.status == 200
    return conn, r, r.readline()


def test_sigint_ends_in_flight_requests_and_exits_130(pair):
    server = Serve("--model", pair[0], "--draft", pair[1], "--port", "0", blocked={signal.SIGINT})
    port = server.port()
    # A second server on the same port: one line, exit 1, before any model is loaded.
    tic = time.monotonic()
    busy = subprocess.run([sys.executable, "-m", "dflash_mlx", "serve", "--model", pair[0], "--draft", pair[1],
                           "--port", str(port)], capture_output=True, text=True, env=ENV, timeout=60)
    assert busy.returncode == 1 and busy.stderr.startswith(f"dflash-mlx serve: error: cannot listen on 127.0.0.1:{port}")
    assert len(busy.stderr.strip().splitlines()) == 1 and time.monotonic() - tic < 30
    conn, r, first = stream_until_first_token(port)
    assert first.startswith(b"data: ")
    idle = socket.create_connection(("127.0.0.1", port))  # an idle keep-alive connection must not hold up the exit
    server.proc.send_signal(signal.SIGINT)
    rest = r.read().decode()  # the in-flight stream ends, with an error event and [DONE]
    code, log = server.wait()
    events = [line[6:] for line in rest.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2]).get("error", {}).get("message") == "the server is shutting down", (
        events[-3:], log)
    assert code == 130, log
    assert "Traceback" not in log and "terminate called" not in log and "SIGINT: shutting down" in log
    idle.close()
    conn.close()


def test_sigterm_exits_0(pair):
    server = Serve("--model", pair[0], "--draft", pair[1], "--port", "0", "--block-size", "auto")
    port = server.port()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b'{"status": "ok"}'  # and the connection stays open
    server.proc.send_signal(signal.SIGTERM)
    code, log = server.wait()
    assert code == 0 and "Traceback" not in log and "terminate called" not in log, log
    conn.close()


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "argument --port: 99999 is not a TCP port"),
    (["--port", "http"], "argument --port: 'http' is not an integer"),
    (["--max-tokens", "0"], "argument --max-tokens: 0 is not a positive integer"),
    (["--max-tokens", "100000"], "--max-tokens 100000 is more than the model's context length 4096"),
    (["--temp", "nan"], "argument --temp: 'nan' is not a finite number"),
    (["--temp", "1e-40"], "--temp 1e-40: temperature=1e-40 is too small"),
    (["--top-p", "0"], "--top-p 0.0: top_p must be in (0, 1]"),
    (["--block-size", "big"], "argument --block-size: 'big' is not a block size"),
    (["--draft-window", "4"], "argument --draft-window: '4' is not KEEP:RECENT"),
    (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid:"),
    (["--model", "/no/such/model"], "model not found: /no/such/model does not exist"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_serve_flags_are_one_line(pair, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", pair[0], "--draft", pair[1], "--port", "0", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and message in err, err
    assert err.startswith("dflash-mlx serve: error:") and len(err.strip().splitlines()) == 1


def test_serve_process_with_a_key_from_the_environment(pair):
    """A real ``dflash-mlx serve`` process keyed by DFLASH_MLX_API_KEY, called by the anthropic and openai clients."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    server = Serve("--model", pair[0], "--draft", pair[1], "--port", "0", env={**ENV, "DFLASH_MLX_API_KEY": "k3y"})
    base = f"http://127.0.0.1:{server.port()}"
    try:
        message = anthropic.Anthropic(base_url=base, api_key="k3y", max_retries=0).messages.create(
            model="default_model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert message.usage.output_tokens == 4
        response = openai.OpenAI(base_url=base + "/v1", api_key="k3y", max_retries=0).responses.create(
            model="default_model", input="hi", max_output_tokens=4)
        assert response.usage.output_tokens == 4
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model="default_model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    finally:
        server.proc.send_signal(signal.SIGTERM)
    code, log = server.wait()
    assert code == 0 and "Traceback" not in log, log

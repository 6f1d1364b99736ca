"""A hostile client against one real server (tiny models on 127.0.0.1).

Every probe gets its 2xx/4xx; after each one the server answers a normal
request exactly as ``stream_generate`` does and its log holds no traceback.
Probes go through ``http.client``, raw sockets and the ``openai`` package.
"""

import argparse
import http.client
import json
import logging
import socket
import threading
import time

import pytest
import tiny
from tiny import leave_mid_answer

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.server import add_arguments, close, make_server
from dflash_mlx.server.http import MAX_BODY_BYTES

NORMAL = [{"role": "user", "content": "Say something."}]
CHAT = "/v1/chat/completions"


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def problems(self):
        return [r.getMessage() for r in self.records if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]


@pytest.fixture(scope="module")
def env(tiny_pair):
    target, draft = map(str, tiny_pair("qwen3"))
    model, tokenizer = dflash_mlx.load(target, draft)
    text = tokenizer.apply_chat_template(NORMAL, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = "".join(r.text for r in stream_generate(model, tokenizer, ids, 6))
    del model
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--model", target, "--draft", draft, "--port", "0", "--max-prompt-tokens", "300", "--block-size", "4",
        "--allowed-origins", "http://editor.example,http://other.example",
    ])
    records = Records()
    root = logging.getLogger()
    level, root.level = root.level, logging.INFO
    root.addHandler(records)
    server = make_server(args)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield argparse.Namespace(port=server.server_address[1], expected=expected, log=records, server=server)
    server.shutdown()
    close(server)
    root.removeHandler(records)
    root.level = level


@pytest.fixture
def port(env):
    """The server's port; afterwards the server must still answer a normal request correctly, without tracebacks."""
    env.log.records.clear()
    yield env.port
    status, body = request(env.port, "POST", CHAT, {"messages": NORMAL, "max_tokens": 6})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == env.expected
    assert env.log.problems() == []


def request(port, method, path, body=None, headers=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    return r.status, raw


def chat(port, **fields):
    return request(port, "POST", CHAT, {"messages": NORMAL, "max_tokens": 4, **fields})


class Reader:
    """A socket whose responses are read through one buffer (pipelined answers arrive together)."""

    def __init__(self, sock):
        self.file = sock.makefile("rb")

    def makefile(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return getattr(self.file, name)

    def close(self):  # each response closes its file when read; the next one needs it
        pass


def read_response(sock, method="POST"):
    r = http.client.HTTPResponse(sock if isinstance(sock, Reader) else Reader(sock), method=method)
    r.begin()
    return r.status, r.read(), r


def raw_exchange(port, data, timeout=10):
    """Send raw bytes on a new connection; the status and body of the one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        status, body, r = read_response(sock)
        return status, body, r


NAN = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
DEEP = b'{"messages": [{"role": "user", "content": "hi"}], "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BODIES = [
    # (id, body, status, param)
    ("nan", NAN, 400, None),
    ("infinity", NAN.replace(b"NaN", b"Infinity"), 400, None),
    ("minus-infinity", NAN.replace(b"NaN", b"-Infinity"), 400, None),
    ("overflowing-float", NAN.replace(b"NaN", b"1e400"), 400, None),
    ("huge-integer", NAN.replace(b"NaN", b"9" * 5000), 400, None),
    ("deep-nesting", DEEP, 400, None),
    ("nesting-past-the-limit", NAN.replace(b"NaN", b"[" * 40 + b"]" * 40), 400, None),
    ("invalid-utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("lone-surrogate", b'{"messages": [{"role": "user", "content": "cut \\ud83d"}]}', 400, "messages"),
    ("lone-surrogate-key", b'{"messages": [{"role": "user", "content": "hi", "\\udc00": 1}]}', 400, "messages"),
    ("not-json", b"{not json", 400, None),
    ("empty", b"", 400, None),
    ("array", b"[1, 2]", 400, None),
    ("string", b'"hello"', 400, None),
    ("null", b"null", 400, None),
    ("no-messages", b'{"max_tokens": 3}', 400, "messages"),
]
FIELD_PROBES = [
    ("seed-too-big", {"seed": 2**63}, 400, "seed"),
    ("seed-float", {"seed": 1.5}, 400, "seed"),
    ("seed-string", {"seed": "1"}, 400, "seed"),
    ("seed-bool", {"seed": True}, 400, "seed"),
    ("temperature-negative", {"temperature": -1}, 400, "temperature"),
    ("temperature-underflow", {"temperature": 1e-40}, 400, "temperature"),
    ("temperature-string", {"temperature": "0.5"}, 400, "temperature"),
    ("top-p-zero", {"top_p": 0}, 400, "top_p"),
    ("top-p-underflow", {"top_p": 1e-50}, 400, "top_p"),
    ("role-list", {"messages": [{"role": ["user"], "content": "hi"}]}, 400, "messages"),
    ("role-object", {"messages": [{"role": {"user": 1}, "content": "hi"}]}, 400, "messages"),
    ("top-p-above-one", {"top_p": 1.5}, 400, "top_p"),
    ("top-k-negative", {"top_k": -1}, 400, "top_k"),
    ("top-k-float", {"top_k": 1.5}, 400, "top_k"),
    ("min-p-above-one", {"min_p": 2}, 400, "min_p"),
    ("max-tokens-zero", {"max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-huge", {"max_tokens": 10**12}, 400, "max_tokens"),
    ("max-completion-tokens-negative", {"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    # The tiny target's context is 4096 tokens: a prompt and 4096 more do not fit.
    ("max-tokens-past-context", {"max_tokens": 4096}, 400, "max_tokens"),
    ("max-completion-tokens-past-context", {"max_tokens": None, "max_completion_tokens": 4096}, 400,
     "max_completion_tokens"),
    ("max-tokens-differ", {"max_tokens": 4, "max_completion_tokens": 3}, 400, "max_tokens"),
    ("repetition-penalty-underflow", {"repetition_penalty": 1e-40}, 400, "repetition_penalty"),
    ("presence-penalty-range", {"presence_penalty": 5}, 400, "presence_penalty"),
    ("context-size-huge", {"repetition_penalty": 1.1, "repetition_context_size": 10**9}, 400, "repetition_context_size"),
    ("xtc-threshold-range", {"xtc_threshold": 0.9}, 400, "xtc_threshold"),
    ("num-draft-tokens-range", {"num_draft_tokens": 100}, 400, "num_draft_tokens"),
    ("num-draft-tokens-negative", {"num_draft_tokens": -1}, 400, "num_draft_tokens"),
    ("n", {"n": 2}, 400, "n"),
    ("logprobs", {"logprobs": True}, 400, "logprobs"),
    ("top-logprobs", {"top_logprobs": 5}, 400, "top_logprobs"),
    ("tool-choice-required", {"tool_choice": "required"}, 400, "tool_choice"),
    ("parallel-tool-calls-false", {"parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ("tools-without-a-parser", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("response-format", {"response_format": {"type": "json_object"}}, 400, "response_format"),
    ("functions", {"functions": [{"name": "f"}]}, 400, "functions"),
    ("unknown-field", {"mirostat": 2}, 400, "mirostat"),
    ("completions-field", {"prompt": "hi"}, 400, "prompt"),
    ("stream-not-bool", {"stream": "yes"}, 400, "stream"),
    ("stream-options-int", {"stream_options": {"include_usage": 1}}, 400, "stream_options"),
    ("stream-options-unknown", {"stream_options": {"anything": True}}, 400, "stream_options"),
    ("stop-int", {"stop": 5}, 400, "stop"),
    ("stop-empty", {"stop": [""]}, 400, "stop"),
    ("stop-too-many", {"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("stop-too-long", {"stop": "x" * 2000}, 400, "stop"),
    ("logit-bias-key", {"logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", {"logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("logit-bias-negative-id", {"logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("logit-bias-long-key", {"logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
    ("logit-bias-superscript-key", {"logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ("logit-bias-value", {"logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("logit-bias-string", {"logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ("logit-bias-list", {"logit_bias": [1, 2]}, 400, "logit_bias"),
    ("template-from-request", {"chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}},
     400, "chat_template_kwargs"),
    ("template-argument", {"chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("template-kwargs-string", {"chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
    ("model-not-string", {"model": 5}, 400, "model"),
    ("model-unknown", {"model": "gpt-4"}, 404, "model"),
    ("user-not-string", {"user": {"id": 1}}, 400, "user"),
    ("messages-empty", {"messages": []}, 400, "messages"),
    ("messages-not-list", {"messages": "hi"}, 400, "messages"),
    ("messages-too-many", {"messages": NORMAL * 5000}, 400, "messages"),
    ("message-not-object", {"messages": ["hi"]}, 400, "messages"),
    ("message-no-role", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("message-bad-role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("content-int", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("content-object", {"messages": [{"role": "user", "content": {"text": "hi"}}]}, 400, "messages"),
    ("text-part-not-string", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages"),
    ("text-part-missing", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages"),
    ("image-part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("part-not-object", {"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages"),
    ("message-unknown-field", {"messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}]}, 400, "messages"),
    ("tool-call-arguments", {"messages": [*NORMAL, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400, "messages"),
    ("tool-call-no-function", {"messages": [*NORMAL, {"role": "assistant", "tool_calls": [{"id": "1"}]}]}, 400, "messages"),
    ("prompt-too-long", {"messages": [{"role": "user", "content": "x" * 400}]}, 400, "messages"),
]
ACCEPTED = [
    ("seed-minus-one", {"seed": -1, "temperature": 1.0}),
    ("seed-int64-min", {"seed": -(2**63), "temperature": 1.0}),
    ("seed-int64-max", {"seed": 2**63 - 1, "temperature": 1.0}),
    ("nulls-mean-absent", {"temperature": None, "stop": None, "seed": None, "tools": None}),
    ("template-kwarg", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("text-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say "},
                                                              {"type": "text", "text": "hi"}]}]}),
    ("null-content-and-refusal", {"messages": [*NORMAL, {"role": "assistant", "content": None, "refusal": None}, *NORMAL]}),
    ("xtc", {"xtc_probability": 0.5, "temperature": 1.0}),
    ("penalties", {"repetition_penalty": 1.2, "presence_penalty": -2, "frequency_penalty": 2, "logit_bias": {"5": -100}}),
    ("num-draft-tokens", {"num_draft_tokens": 2}),
    ("max-completion-tokens", {"max_tokens": None, "max_completion_tokens": 3}),
    ("emoji", {"messages": [{"role": "user", "content": "\U0001f600 \u00e9\u4e2d"}]}),
]


@pytest.mark.parametrize("body, status, param", [b[1:] for b in BODIES], ids=[b[0] for b in BODIES])
def test_bad_bodies(port, body, status, param):
    got, raw = request(port, "POST", CHAT, body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("fields, status, param", [p[1:] for p in FIELD_PROBES], ids=[p[0] for p in FIELD_PROBES])
def test_bad_fields(port, fields, status, param):
    got, raw = chat(port, **fields)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["message"]


@pytest.mark.parametrize("fields", [p[1] for p in ACCEPTED], ids=[p[0] for p in ACCEPTED])
def test_accepted_fields(port, fields):
    got, raw = chat(port, **fields)
    assert got == 200, raw
    body = json.loads(raw)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= fields.get("max_completion_tokens", 4)


def test_seed_minus_one_is_a_seed(port):
    def sample(seed):
        return json.loads(chat(port, seed=seed, temperature=1.0, max_tokens=12)[1])["choices"][0]["message"]["content"]

    assert sample(-1) == sample(-1) != sample(-2)


def test_template_from_request_says_why(port):
    _, raw = chat(port, chat_template_kwargs={"chat_template": "{{ 'x' * 10**8 }}"})
    message = json.loads(raw)["error"]["message"]
    assert "--chat-template" in message and "CPU" in message


def test_a_template_argument_that_fails_is_named(port):
    # The chat template raises for this argument (a newer transformers', which needs it to tokenize).
    _, raw = chat(port, chat_template_kwargs={"sanitize_control_tokens": True})
    error = json.loads(raw)["error"]
    assert "with template arguments sanitize_control_tokens" in error["message"], error
    assert error["message"].endswith("drop or fix chat_template_kwargs")


@pytest.mark.parametrize("route, body, status", [
    ("/v1/completions", {"prompt": ["a", "b"]}, 400),
    ("/v1/completions", {"prompt": [1, 2, 3]}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"max_tokens": 3}, 400),
    ("/v1/completions", {"messages": NORMAL}, 400),
    ("/v1/completions", {"prompt": "hi", "tools": []}, 400),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 3, "seed": -1}, 200),
    ("/v1/nothing", {}, 404),
    ("/health", {}, 405),
])
def test_routes(port, route, body, status):
    got, raw = request(port, "POST", route, body)
    assert got == status, raw
    assert ("error" in json.loads(raw)) == (status != 200)


def test_completion_logprobs_are_refused_for_what_they_are(port):
    """/v1/completions takes logprobs as a count: refused because none are computed, not for its type."""
    for value in (5, True):
        status, raw = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": value})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "logprobs" and "not computed" in error["message"], raw
    assert request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 0})[0] == 200


def test_wrong_methods(port):
    assert request(port, "GET", CHAT)[0] == 405
    for method in ("PUT", "DELETE", "PATCH"):
        status, raw = request(port, method, CHAT, b"{}")
        assert status == 405 and json.loads(raw)["error"]["message"] == f"{CHAT} does not take {method}"


def test_head_and_options(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("HEAD", "/health")
    r = conn.getresponse()
    assert r.status == 200 and int(r.getheader("Content-Length")) == len(b'{"status": "ok"}') and r.read() == b""
    conn.request("OPTIONS", CHAT, headers={
        "Origin": "http://editor.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })
    r = conn.getresponse()
    assert r.status == 200 and r.read() == b"OK"  # Starlette's preflight answer
    assert r.getheader("Access-Control-Allow-Origin") == "http://editor.example"
    assert "POST" in r.getheader("Access-Control-Allow-Methods")
    assert r.getheader("Access-Control-Allow-Headers") == "authorization, content-type"
    conn.request("GET", "/v1/models", headers={"Origin": "http://evil.example"})  # the same connection: keep-alive
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") is None
    r.read()
    conn.request("POST", CHAT, json.dumps({"messages": NORMAL, "max_tokens": 2}), {"Origin": "http://other.example"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") == "http://other.example"
    assert r.getheader("Vary") == "Origin"
    conn.close()


def test_keep_alive_and_pipelining(port, env):
    body = json.dumps({"messages": NORMAL, "max_tokens": 6}).encode()
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    get = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"  # a GET with a body, read and ignored
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(post + get + post)  # three requests at once
        reader = Reader(sock)
        for method in ("POST", "GET", "POST"):
            status, raw, _ = read_response(reader, method)
            assert status == 200
            if method == "POST":
                assert json.loads(raw)["choices"][0]["message"]["content"] == env.expected
            else:
                assert raw == b'{"status": "ok"}'
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _, r = read_response(reader, "GET")
        assert status == 200 and r.getheader("Connection") == "close"


def test_error_answers_keep_the_connection(port):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = Reader(sock)
        normal = b'{"messages": [{"role": "user", "content": "hi"}], "seed": -1, "max_tokens": 2}'
        for body in (b"{not json", b'{"messages": [], "n": 1}', normal):
            sock.sendall(b"POST /v1/nope HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert read_response(reader)[0] == 404
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert read_response(reader)[0] in (200, 400)


def test_streams_are_framed(port, env):
    body = {"messages": NORMAL, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for _ in range(2):  # twice on one connection: the chunked framing ends each stream
        conn.request("POST", CHAT, json.dumps(body))
        r = conn.getresponse()
        assert r.getheader("Transfer-Encoding") == "chunked"
        events = [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == env.expected
        assert chunks[-1]["usage"]["completion_tokens"] == 6
    conn.close()
    # An HTTP/1.0 client reads the stream to the end of the connection.
    data = json.dumps(body).encode()
    status, out, r = raw_exchange(port, b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    assert status == 200 and r.getheader("Transfer-Encoding") is None and out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("data, status", [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n", 413),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (MAX_BODY_BYTES + 1), 413),
    (b"POST /v1/nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 404),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 404),
])
def test_raw_requests(port, data, status):
    got, body, _ = raw_exchange(port, data)
    assert got == status, body[:200]
    assert json.loads(body)["error"]["message"]


@pytest.mark.parametrize("data", [
    b"HELLO\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"GET /\x00\xff HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["garbage", "no-host", "negative-length", "text-length", "two-lengths", "nul-target"])
def test_unparsable_http(port, data):
    """What h11 cannot parse gets uvicorn's own plain-text 400 and a closed connection (no API client sends it)."""
    got, body, r = raw_exchange(port, data)
    assert got == 400 and r.getheader("Connection") == "close", body[:200]


def test_chunked_request_body(port, env):
    body = json.dumps({"messages": NORMAL, "max_tokens": 6}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7))
    data = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    status, raw, _ = raw_exchange(port, data)
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == env.expected
    huge = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # over the limit, in 1 MB chunks
        sock.sendall(huge)
        try:
            for _ in range(MAX_BODY_BYTES // 2**20 + 2):
                sock.sendall(b"100000\r\n" + b" " * 2**20 + b"\r\n")
        except OSError:  # the server answered and closed while we sent
            pass
        assert read_response(sock)[0] == 413


def test_oversized_body_refused_before_it_is_sent(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES * 4))
        assert read_response(sock)[0] == 413  # answered with no byte of the 64 MB sent


def test_expect_continue(port):
    body = json.dumps({"messages": NORMAL, "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
        assert sock.recv(100).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        assert read_response(sock)[0] == 200


@pytest.mark.parametrize("data", [
    b"",  # connect and close
    b"POST /v1/chat/co",  # half a request line
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess",  # half a body
    b"GET /health HTTP/1.1\r\nHost",  # half the headers
], ids=["nothing", "half-line", "half-body", "half-headers"])
def test_clients_that_leave(port, data):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
    time.sleep(0.1)


def test_slow_client(port, env):
    body = json.dumps({"messages": NORMAL, "max_tokens": 6}).encode()
    data = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for i in range(0, len(data), 40):
            sock.sendall(data[i : i + 40])
            time.sleep(0.01)
        status, raw, _ = read_response(sock)
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == env.expected


def test_openai_client(port, env):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="default_model", messages=NORMAL, max_tokens=6, seed=-1)
    assert r.choices[0].message.content == env.expected
    stream = client.chat.completions.create(
        model="default_model", messages=NORMAL, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == env.expected
    assert chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        client.chat.completions.create(
            model="default_model", messages=NORMAL, extra_body={"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
        )
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.chat.completions.create(model="default_model", messages=NORMAL, seed=2**64)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=NORMAL)


def test_failing_job_ends_alone(port, env, monkeypatch):
    """An exception inside generation costs the requests of that step (500, or an error event),
    not the worker."""
    from dflash_mlx.engine import Engine

    real_step = Engine.step

    def failing_step(engine):
        if engine.rows:  # a request is decoding: its first token went out with its prefill
            raise RuntimeError("injected failure")
        return real_step(engine)

    monkeypatch.setattr(Engine, "step", failing_step)
    status, raw = chat(port)
    assert status == 500 and json.loads(raw)["error"] == {
        "message": "generation failed: injected failure", "type": "server_error", "param": None, "code": None,
    }
    status, raw = chat(port, stream=True)  # failed after its first token: the stream ends with an error event
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "generation failed: injected failure"
    assert request(port, "GET", "/health") == (200, '{"status": "ok"}')
    assert len([r for r in env.log.records if r.exc_info]) == 2  # logged with their tracebacks, once each
    monkeypatch.undo()
    env.log.records.clear()


def test_concurrent_clients_some_leaving(port, env):
    """Twelve clients at once; half leave mid-stream. The others get exact answers and the worker is freed."""
    body = json.dumps({"messages": NORMAL, "max_tokens": 2000, "stream": True, "logit_bias": {"2": -100}}).encode()

    def leaver():
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            received = b""
            while b"data: " not in received:
                received += sock.recv(4096)
        return "left"

    def stayer():
        status, raw = request(port, "POST", CHAT, {"messages": NORMAL, "max_tokens": 6}, timeout=120)
        return json.loads(raw)["choices"][0]["message"]["content"] if status == 200 else raw

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: (leaver if i % 2 else stayer)(), range(12)))
    assert results == [env.expected, "left"] * 6
    deadline = time.monotonic() + 30
    while "dflash_requests_active 1" in request(port, "GET", "/metrics")[1] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "dflash_requests_active 0" in request(port, "GET", "/metrics")[1]


# -- the Anthropic Messages and OpenAI Responses endpoints ------------------------------------------------------

MESSAGES = "/v1/messages"
ASK = [{"role": "user", "content": "Say something."}]
LONG = [{"role": "user", "content": "x" * 400}]  # over --max-prompt-tokens, which counting does not refuse
CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
MESSAGE_PROBES = [
    # (id, body, status, Anthropic error type)
    ("not-json", b"{not json", 400, "invalid_request_error"),
    ("empty", b"", 400, "invalid_request_error"),
    ("array", b"[1]", 400, "invalid_request_error"),
    ("no-max-tokens", {"max_tokens": None}, 400, "invalid_request_error"),  # null is absent
    ("no-model", {"model": None}, 400, "invalid_request_error"),
    ("unknown-model", {"model": "claude-3"}, 404, "not_found_error"),
    ("max-tokens-huge", {"max_tokens": 10**12}, 400, "invalid_request_error"),
    ("max-tokens-zero", {"max_tokens": 0}, 400, "invalid_request_error"),
    ("max-tokens-past-context", {"max_tokens": 4096}, 400, "invalid_request_error"),
    ("messages-empty", {"messages": []}, 400, "invalid_request_error"),
    ("role-system", {"messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error"),
    ("role-tool", {"messages": [{"role": "tool", "content": "hi"}]}, 400, "invalid_request_error"),
    ("role-missing", {"messages": [{"content": "hi"}]}, 400, "invalid_request_error"),
    ("message-extra-key", {"messages": [{"role": "user", "content": "hi", "name": "x"}]}, 400, "invalid_request_error"),
    ("content-int", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error"),
    ("block-not-object", {"messages": [{"role": "user", "content": ["hi"]}]}, 400, "invalid_request_error"),
    ("block-no-type", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, 400, "invalid_request_error"),
    ("block-type-object", {"messages": [{"role": "user", "content": [{"type": {}, "text": "hi"}]}]}, 400,
     "invalid_request_error"),
    ("block-type-list", {"system": [{"type": ["text"], "text": "s"}]}, 400, "invalid_request_error"),
    ("cache-control-string", {"system": [{"type": "text", "text": "s", "cache_control": "ephemeral"}]}, 400,
     "invalid_request_error"),
    ("block-cache-control-list", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": []}]}]}, 400, "invalid_request_error"),
    ("block-image", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ("text-not-string", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "invalid_request_error"),
    ("block-extra-key", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]}, 400,
     "invalid_request_error"),
    ("tool-use-from-user", {"messages": [{"role": "user", "content": CALLED["content"]}]}, 400, "invalid_request_error"),
    ("tool-result-from-assistant", {"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}, *ASK]}, 400, "invalid_request_error"),
    ("tool-result-unknown-id", {"messages": [*ASK, CALLED, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]}, 400, "invalid_request_error"),
    ("tool-result-no-id", {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, 400,
     "invalid_request_error"),
    ("tool-use-input-string", {"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}, *ASK]}, 400, "invalid_request_error"),
    ("prefill", {"messages": [*ASK, {"role": "assistant", "content": "Sure"}]}, 400, "invalid_request_error"),
    ("system-int", {"system": 5}, 400, "invalid_request_error"),
    ("system-image", {"system": [{"type": "image"}]}, 400, "invalid_request_error"),
    ("temperature-above-one", {"temperature": 1.5}, 400, "invalid_request_error"),
    ("top-k-negative", {"top_k": -1}, 400, "invalid_request_error"),
    ("stop-sequence-empty", {"stop_sequences": [""]}, 400, "invalid_request_error"),
    ("stream-string", {"stream": "yes"}, 400, "invalid_request_error"),
    ("tool-choice-any", {"tool_choice": {"type": "any"}}, 400, "invalid_request_error"),
    ("tools-without-a-parser", {"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error"),
    ("server-tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error"),
    ("thinking-small-budget", {"thinking": {"type": "enabled", "budget_tokens": 10}}, 400, "invalid_request_error"),
    ("thinking-budget-over-max", {"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 4000}}, 400,
     "invalid_request_error"),
    ("thinking-omitted", {"thinking": {"type": "adaptive", "display": "omitted"}}, 400, "invalid_request_error"),
    ("output-config", {"output_config": {"effort": "high"}}, 400, "invalid_request_error"),
    ("mcp-servers", {"mcp_servers": []}, 400, "invalid_request_error"),
    ("context-management-tool-uses", {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, 400,
     "invalid_request_error"),
    ("context-management-keep-zero", {"context_management": {"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]}}, 400, "invalid_request_error"),
    ("context-management-not-edits", {"context_management": {"clear": True}}, 400, "invalid_request_error"),
    ("unknown-field", {"frequency_penalty": 1}, 400, "invalid_request_error"),
    ("prompt-too-long", {"messages": LONG}, 400, "invalid_request_error"),
    ("lone-surrogate", b'{"model": "default_model", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud83d"}]}',
     400, "invalid_request_error"),
]


GENERATION_ONLY = ("max_tokens", "stream", "stop_sequences", "temperature", "top_k")  # not count_tokens fields


@pytest.mark.parametrize("fields, status, kind", [p[1:] for p in MESSAGE_PROBES], ids=[p[0] for p in MESSAGE_PROBES])
def test_bad_messages(port, fields, status, kind):
    """Each probe on /v1/messages, and on count_tokens where it is about the conversation."""
    body = fields if isinstance(fields, bytes) else {"model": "default_model", "max_tokens": 4, "messages": ASK, **fields}
    counted = body if isinstance(body, bytes) else {k: v for k, v in body.items() if k not in GENERATION_ONLY}
    for path, data in ((MESSAGES, body), (MESSAGES + "/count_tokens", counted)):
        generation = not isinstance(fields, bytes) and (set(fields) <= {*GENERATION_ONLY, "thinking"} or
                                                         fields.get("messages") is LONG)
        if path != MESSAGES and generation:
            continue  # a probe of generation settings (a budget is checked against max_tokens only when generating)
        got, raw = request(port, "POST", path, data)
        assert got == status, (path, raw)
        error = json.loads(raw)
        assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"], raw


RESPONSES = "/v1/responses"
RESPONSE_PROBES = [
    # (id, body, status)
    ("not-json", b"{not json", 400),
    ("no-input", {"model": "default_model"}, 400),
    ("input-int", {"input": 5}, 400),
    ("input-empty-list", {"input": []}, 400),
    ("item-not-object", {"input": ["hi"]}, 400),
    ("item-unknown-type", {"input": [{"type": "computer_call"}]}, 400),
    ("message-bad-role", {"input": [{"role": "tool", "content": "hi"}]}, 400),
    ("part-image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400),
    ("call-output-unknown-id", {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400),
    ("call-no-name", {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400),
    ("call-bad-arguments", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"},
                                      {"role": "user", "content": "hi"}]}, 400),
    ("encrypted-reasoning", {"input": [{"type": "reasoning", "encrypted_content": "x", "summary": []}]}, 400),
    ("max-output-tokens-past-context", {"input": "hi", "max_output_tokens": 4096}, 400),
    ("reasoning-content-int", {"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "hi"}]}, 400),
    ("reasoning-content-string", {"input": [{"type": "reasoning", "content": "thought"},
                                            {"role": "user", "content": "hi"}]}, 400),
    ("previous-unknown", {"input": "hi", "previous_response_id": "resp_nope"}, 404),
    ("max-output-huge", {"input": "hi", "max_output_tokens": 10**12}, 400),
    ("tool-not-function", {"input": "hi", "tools": [{"type": "file_search"}]}, 400),
    ("tool-strict", {"input": "hi", "tools": [{"type": "function", "name": "f", "strict": True}]}, 400),
    ("text-format", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400),
    ("truncation-auto", {"input": "hi", "truncation": "auto"}, 400),
    ("include", {"input": "hi", "include": ["message.output_text.logprobs"]}, 400),
    ("background", {"input": "hi", "background": True}, 400),
    ("reasoning-effort", {"input": "hi", "reasoning": {"effort": "extreme"}}, 400),
    ("conversation", {"input": "hi", "conversation": "conv_1"}, 400),
    ("unknown-field", {"input": "hi", "mirostat": 2}, 400),
    ("model-unknown", {"input": "hi", "model": "gpt-5"}, 404),
    ("prompt-too-long", {"input": "x" * 400}, 400),
]


def test_a_bad_input_item_is_named_as_sent(port):
    """A Responses input item's error names it by its place in input, not in the chat messages it becomes."""
    body = {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"},
                      {"type": "function_call_output", "call_id": "c", "output": "x"}], "max_output_tokens": 4}
    status, raw = request(port, "POST", RESPONSES, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["message"].startswith("input[0].arguments") and error["param"] == "input", raw


@pytest.mark.parametrize("body, status", [p[1:] for p in RESPONSE_PROBES], ids=[p[0] for p in RESPONSE_PROBES])
def test_bad_responses(port, body, status):
    got, raw = request(port, "POST", RESPONSES, body if isinstance(body, bytes) else {"max_output_tokens": 4, **body})
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["message"] and error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_stored_response_routes(port):
    status, raw = request(port, "GET", RESPONSES + "/resp_nope")
    assert status == 404 and json.loads(raw)["error"]["param"] is None  # no previous_response_id was sent
    assert request(port, "DELETE", RESPONSES + "/resp_nope")[0] == 404
    status, raw = request(port, "PUT", RESPONSES + "/resp_nope", b"{}")
    assert status == 405 and json.loads(raw)["error"]["message"]
    status, raw = request(port, "GET", MESSAGES)
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error"  # Anthropic's shape


@pytest.mark.parametrize("path, body", [
    (MESSAGES, {"model": "default_model", "max_tokens": 3000, "messages": ASK, "stream": True, "temperature": 0}),
    (RESPONSES, {"input": "talk", "max_output_tokens": 3000, "stream": True}),
    (MESSAGES, {"model": "default_model", "max_tokens": 3000, "messages": ASK, "temperature": 0}),
], ids=["messages-stream", "responses-stream", "messages-whole"])
def test_dropped_clients_cancel_their_job(port, path, body):
    """A client that leaves mid-way (streaming or not) frees the worker; the port fixture then checks the server."""
    def metric(name):
        return tiny.metric(port, name)

    before = metric("dflash_requests_cancelled_total")
    leave_mid_answer(port, path, body, body.get("stream", False))
    deadline = time.monotonic() + 30
    while metric("dflash_requests_cancelled_total") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric("dflash_requests_cancelled_total") == before + 1


@pytest.mark.parametrize("data", [b"", b"GET /health HTTP/1.1\r\nHo"], ids=["nothing", "half-a-head"])
def test_stalled_connections_are_closed(port, data, monkeypatch):
    """A client that connects, or starts a request head, and then stalls loses its connection (slowloris)."""
    from dflash_mlx.server import http as transport

    monkeypatch.setattr(transport, "READ_SECONDS", 0.5)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        tic = time.monotonic()
        assert sock.recv(100) == b"" and time.monotonic() - tic < 5  # closed by the server, without an answer

"""dflash-mlx serve: a real HTTP client against a server on 127.0.0.1 with tiny models."""

import argparse
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.server.reply import StopMatcher
from dflash_mlx.server import add_arguments, close, make_server
import tiny
from tiny import NO_EOS, leave_mid_answer



@pytest.fixture(scope="module")
def reference(pair):
    """Greedy stream_generate output, computed before the server starts (one MLX user at a time)."""
    model, tokenizer = dflash_mlx.load(*pair)

    def chat_ids(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def run(prompt, max_tokens):
        return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens))

    messages = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(8)]
    turn2 = messages[0] + [
        {"role": "assistant", "content": run(chat_ids(messages[0]), 24)},
        {"role": "user", "content": "And times two?"},
    ]
    return {
        "messages": messages,
        "chat": [run(chat_ids(m), 24) for m in messages],
        "text": run("Once upon a time", 24),
        "turn2": turn2,
        "turn2_out": run(chat_ids(turn2), 24),
    }


@pytest.fixture(scope="module")
def server(pair, reference):
    model, draft = pair
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--model", model, "--draft", draft, "--port", "0", "--max-prompt-tokens", "400", "--block-size", "auto",
        "--draft-window", "4:64",
    ])
    srv = make_server(args)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.server_address[1]
    srv.shutdown()
    close(srv)  # joins the worker: an MLX thread killed at interpreter exit aborts the process


def post(port, path, body, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    return r.status, raw


def get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read().decode()


def sse(raw):
    events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def chat(port, messages, **kw):
    status, raw = post(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 24, **kw})
    assert status == 200, raw
    return json.loads(raw)


def test_chat_matches_stream_generate(server, reference):
    body = chat(server, reference["messages"][0])
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": reference["chat"][0]}
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] >= 1


def test_chat_stream_matches_stream_generate(server, reference):
    status, raw = post(
        server, "/v1/chat/completions",
        {"messages": reference["messages"][1], "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200
    chunks = sse(raw)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == reference["chat"][1]
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_text_completions(server, reference):
    status, raw = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24})
    assert status == 200
    body = json.loads(raw)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == reference["text"]
    status, raw = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse(raw)) == reference["text"]


def test_eight_concurrent_requests(server, reference):
    def one(i):
        stream = i % 2 == 1
        status, raw = post(
            server, "/v1/chat/completions", {"messages": reference["messages"][i], "max_tokens": 24, "stream": stream}
        )
        assert status == 200, raw
        if stream:
            return "".join(c["choices"][0]["delta"].get("content", "") for c in sse(raw))
        return json.loads(raw)["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == reference["chat"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "mirostat": 2}, 400, "mirostat"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "stop"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 500}]}, 400, "messages"),  # over --max-prompt-tokens
        ({"prompt": "hi"}, 400, "prompt"),  # a completions field on the chat route
    ],
)
def test_bad_requests_get_4xx(server, body, status, param):
    got, raw = post(server, "/v1/chat/completions", body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["message"] and error["param"] == param


def test_server_keeps_serving_after_bad_requests(server, reference):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.endheaders()  # no Content-Length: an empty body
    r = conn.getresponse()
    assert r.status == 400 and "empty" in json.loads(r.read())["error"]["message"]
    assert post(server, "/v1/nothing", {})[0] == 404
    assert get(server, "/health") == (200, '{"status": "ok"}')
    assert chat(server, reference["messages"][0])["choices"][0]["message"]["content"] == reference["chat"][0]


def test_stop_strings_cut_the_output(server, reference):
    full = reference["chat"][2]
    stop = full[5:8]
    body = chat(server, reference["messages"][2], stop=[stop, "never-appears"])
    assert body["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)
    assert m.feed("yEND tail") == ("y", True)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_request_frees_the_worker(server, reference, stream):
    def metric(name):
        return tiny.metric(server, name)

    before = metric("dflash_requests_cancelled_total")
    body = {"messages": [{"role": "user", "content": "talk forever"}], "max_tokens": 3000, "stream": stream,
            "logit_bias": NO_EOS}
    leave_mid_answer(server, "/v1/chat/completions", body, stream)
    tic = time.perf_counter()
    assert chat(server, reference["messages"][3])["choices"][0]["message"]["content"] == reference["chat"][3]
    assert time.perf_counter() - tic < 20  # not stuck behind 3000 tokens
    assert metric("dflash_requests_cancelled_total") == before + 1


def test_prefix_reuse_across_turns(server, reference):
    chat(server, reference["messages"][0])  # turn 1 leaves its caches on the worker
    body = chat(server, reference["turn2"])
    assert body["choices"][0]["message"]["content"] == reference["turn2_out"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 10


def test_seeded_sampling_is_reproducible(server, reference):
    def sample(seed):
        return chat(server, reference["messages"][4], temperature=1.0, top_k=20, seed=seed)["choices"][0]["message"]["content"]

    assert sample(3) == sample(3)


def test_models_health_metrics(server, pair):
    status, raw = get(server, "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == pair[0]
    status, text = get(server, "/metrics")
    for name in ("requests_total", "completion_tokens_total", "tau", "tokens_per_second", "speculative", "plain_steps_total"):
        assert f"\ndflash_{name} " in text
    assert get(server, "/nope")[0] == 404


def test_openai_client(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model="default_model", messages=reference["messages"][5], max_tokens=24, temperature=0)
    assert r.choices[0].message.content == reference["chat"][5] and r.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model="default_model", messages=reference["messages"][6], max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference["chat"][6]
    r = client.completions.create(model="default_model", prompt="Once upon a time", max_tokens=24, temperature=0)
    assert r.choices[0].text == reference["text"]
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model="default_model", messages=reference["messages"][0], logprobs=True)


def test_serve_command_line():
    from dflash_mlx.cli import SUBCOMMANDS

    assert SUBCOMMANDS["serve"][0] == "dflash_mlx.server"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--draft", "d", "--block-size", "auto", "--draft-window", "4:64"])
    assert (args.host, args.port, args.block_size, args.draft_window) == ("127.0.0.1", 8080, "auto", (4, 64))
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--draft", "d", "--block-size", "big"])

"""dflash-mlx serve with continuous batching: real HTTP clients, concurrent, joining and leaving."""

import argparse
import http.client
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlx_lm.sample_utils import make_logits_processors

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.server import add_arguments, close, make_server
from tiny import NO_EOS, OracleDrafter

PROMPTS = [f"Request {i}: " + "story " * (3 * i + 1) for i in range(8)]
MAX_TOKENS = [40, 12, 64, 25, 48, 9, 56, 33]
WRONG_EVERY = [0, 3, 5, 2, 0, 4, 7, 3]  # the oracle drafter's rejections: rows accept different counts
START_AFTER = [0.0, 0.0, 0.0, 0.05, 0.1, 0.2, 0.3, 0.4]  # seconds: some clients join a running batch
HANG_UP = {2, 6}  # these clients read a few chunks of their stream, then close the connection


@pytest.fixture(scope="module")
def reference(pair):
    """Each prompt's greedy output alone (stream_generate), before the server starts."""
    model, tokenizer = dflash_mlx.load(*pair)
    bias = make_logits_processors(logit_bias={int(k): v for k, v in NO_EOS.items()})
    out = {}
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        responses = list(stream_generate(model, tokenizer, prompt, n, logits_processors=bias, block_size=4))
        ids = tokenizer.encode(prompt)
        out[prompt] = ("".join(r.text for r in responses), ids + [r.token for r in responses])
    return out


def start(pair, *flags):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    srv = make_server(parser.parse_args(["--model", pair[0], "--draft", pair[1], "--port", "0", *flags]))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def server(pair, reference):
    """A batching server whose engine drafts with an oracle: proposals are each request's own
    reference, wrong every ``WRONG_EVERY``-th position, so rows accept different counts per step."""
    srv = start(pair, "--block-size", "4", "--decode-concurrency", "8")
    engine = srv.app.worker.engine
    oracle = OracleDrafter(engine.drafter)
    prompt_of = {tuple(ids[: len(ids) - n]): p for p, (_, ids), n in zip(PROMPTS, reference.values(), MAX_TOKENS)}

    class ByPrompt(dict):  # uid -> the value of the request's prompt, looked up when first asked
        def __init__(self, value):
            super().__init__()
            self.value = value

        def __missing__(self, uid):
            request = next(r for r in engine.rows if r.uid == uid)
            self[uid] = self.value(prompt_of[tuple(request.prompt)])
            return self[uid]

    oracle.refs = ByPrompt(lambda p: reference[p][1])
    oracle.wrong = ByPrompt(lambda p: WRONG_EVERY[PROMPTS.index(p)])
    oracle.engine, engine.drafter = engine, oracle
    yield srv
    srv.shutdown()
    close(srv)


def completion(port, prompt, max_tokens, stream=False, hang_up=False, **extra):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"prompt": prompt, "max_tokens": max_tokens, "logit_bias": NO_EOS, "stream": stream, **extra}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if not stream:
        text = json.loads(r.read())["choices"][0]["text"]
        conn.close()
        return text
    text, chunks = "", 0
    for line in r:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
            chunks += 1
        if hang_up and chunks == 3:
            conn.close()  # the client leaves mid-stream
            return None
    conn.close()
    return text


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^dflash_(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


def test_concurrent_clients_get_their_single_request_outputs(server, reference):
    port = server.server_address[1]
    engine = server.app.worker.engine
    step, together = engine.step, START_AFTER.count(0.0)

    deadline = time.monotonic() + 30

    def first_step_waits_for_the_clients_that_start_together():
        # On a loaded machine the first request can be well on its way before the others are
        # parsed; waiting for them makes "decoded together" a property of the engine, not of timing.
        # An empty step hands control back to the worker, which admits the requests queued meanwhile.
        if len(engine.pending) + len(engine.rows) < together and time.monotonic() < deadline:
            time.sleep(0.01)
            return []
        engine.step = step
        return step()

    engine.step = first_step_waits_for_the_clients_that_start_together

    def client(i):
        time.sleep(START_AFTER[i])
        return completion(port, PROMPTS[i], MAX_TOKENS[i], stream=i % 2 == 1 or i in HANG_UP, hang_up=i in HANG_UP)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(client, range(len(PROMPTS))))
    for i, (prompt, text) in enumerate(zip(PROMPTS, texts)):
        if i not in HANG_UP:
            assert text == reference[prompt][0], i
    deadline = time.monotonic() + 30
    while (m := metrics(port))["requests_active"] and time.monotonic() < deadline:
        time.sleep(0.1)  # the rows of clients that hung up are freed
    assert m["batched"] == 1 and m["requests_active"] == 0 and m["requests_cancelled_total"] >= len(HANG_UP)
    assert max(engine.stats.rows) >= together and m["batch_rows_mean"] > 1, m  # decoded together
    assert m["batch_ragged_steps_total"] > 0, m  # some step's rows accepted different counts
    assert m["drafted_tokens_total"] > 0
    # After all that, the next request is served as if alone.
    assert completion(port, PROMPTS[0], MAX_TOKENS[0]) == reference[PROMPTS[0]][0]


def test_seeded_sampling_does_not_depend_on_neighbours(server):
    """A seeded request's sample is its own: the same alone and batched with seven others."""
    port = server.server_address[1]
    sampled = dict(temperature=1.0, seed=1234)
    alone = completion(port, PROMPTS[3], 30, **sampled)

    def client(i):
        return completion(port, PROMPTS[i], 30, **(sampled if i == 3 else dict(temperature=0.8, seed=i)))

    with ThreadPoolExecutor(8) as pool:
        batched = list(pool.map(client, range(8)))
    assert batched[3] == alone


def test_bad_request_in_a_batch_is_refused_alone(server, reference):
    port = server.server_address[1]
    with ThreadPoolExecutor(3) as pool:
        good = pool.submit(completion, port, PROMPTS[1], MAX_TOKENS[1])
        bad = pool.submit(completion, port, PROMPTS[2], 5, num_draft_tokens=99)
        assert good.result() == reference[PROMPTS[1]][0]
        with pytest.raises(KeyError):  # a 4xx body has no choices
            bad.result()


@pytest.mark.parametrize("concurrency", ["8", "1"])
def test_prefill_step_size_reaches_the_engine(pair, reference, concurrency):
    """--prefill-step-size sets the engine's prefill chunks, one request at a time or batched."""
    srv = start(pair, "--block-size", "4", "--prefill-step-size", "3", "--decode-concurrency", concurrency)
    try:
        assert completion(srv.server_address[1], PROMPTS[2], MAX_TOKENS[2]) == reference[PROMPTS[2]][0]
        assert srv.app.worker.engine.prefill_step_size == 3 and srv.app.worker.engine.max_rows == int(concurrency)
    finally:
        srv.shutdown()
        close(srv)


def test_unbatchable_pair_says_why(pair):
    srv = start(pair, "--decode-concurrency", "1")
    try:
        m = metrics(srv.server_address[1])
        assert m["batched"] == 0
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
        conn.request("GET", "/metrics")
        assert 'dflash_batched{reason="max_rows is 1"} 0' in conn.getresponse().read().decode()
    finally:
        srv.shutdown()
        close(srv)

"""Tool calling through dflash-mlx serve, with the openai client.

The target is ``tiny.save_scripted_pair``'s: with tools it writes
``<think>hm</think>OK<tool_call>{...}</tool_call>``, after a tool result "yo".
"""

import argparse
import json
import threading

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tiny import CALL, USER, WEATHER, save_scripted_pair

from dflash_mlx.server.request import GenerationParams, Request
from dflash_mlx.server.reply import Reply
from dflash_mlx.server import add_arguments, close, make_server

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_scripted_pair(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def client(pair):
    openai = pytest.importorskip("openai")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server = make_server(parser.parse_args(["--model", pair[0], "--draft", pair[1], "--port", "0", "--block-size", "4"]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none", max_retries=0)
    server.shutdown()
    close(server)


def test_tool_call(client):
    r = client.chat.completions.create(model="default_model", messages=USER, tools=[WEATHER], tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "OK" and choice.message.model_extra["reasoning"] == "hm"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_stream(client):
    chunks = list(client.chat.completions.create(model="default_model", messages=USER, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "OK"
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "hm"
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    got = [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls]
    assert got == [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_result_turn(client):
    first = client.chat.completions.create(model="default_model", messages=USER, tools=[WEATHER]).choices[0].message
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C"}
    messages = [*USER, first.model_dump(exclude_none=True), result]
    r = client.chat.completions.create(model="default_model", messages=messages, tools=[WEATHER])
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == ("yo", None, "stop")
    assert r.usage.prompt_tokens > 40 and r.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("tools", [["get_weather"], [{"type": "function"}], [{"type": "x", "function": {"name": "f"}}],
                                   [{"type": "function", "function": {"name": "f", "parameters": []}}]])
def test_malformed_tools(client, tools):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="default_model", messages=USER, tools=tools)


def test_no_tools_no_calls(client):
    r = client.chat.completions.create(model="default_model", messages=USER)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == ("yo", None, "stop")


@pytest.fixture(scope="module")
def tokenizer(pair):
    from pathlib import Path

    return load_tokenizer(Path(pair[0]))


def reply(tokenizer, stream=False, stop=()):
    request = Request("chat", "m", stream, False, list(stop), [WEATHER], "normal", GenerationParams([1], 10))
    return Reply(request, tokenizer, "fp")


def test_reply_parses_calls_split_across_pieces(tokenizer):
    r = reply(tokenizer, stream=True)
    sent = []
    for piece in ["O", "K<tool", "_call>", CALL[:10], CALL[10:], "</tool_call>"]:
        chunks, done = r.feed(piece, None, 1)
        sent += chunks
        assert not done
    sent += r.feed("", "stop", 7)[0]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in sent) == "OK"
    calls = [tc for c in sent for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert sent[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_reply_keeps_an_unparsable_call_as_text(tokenizer):
    r = reply(tokenizer)
    r.feed("<tool_call>{not json</tool_call> after", None, 3)
    r.feed("", "stop", 4)
    body = r.body(0)
    message = body["choices"][0]["message"]
    assert message["content"] == "<tool_call>{not json</tool_call> after" and "tool_calls" not in message
    assert body["choices"][0]["finish_reason"] == "stop"


def test_reply_cut_mid_call_by_length(tokenizer):
    r = reply(tokenizer)
    r.feed('<tool_call>{"name": "get_wea', "length", 5)
    message = r.body(0)["choices"][0]["message"]
    assert message["content"] == '<tool_call>{"name": "get_wea' and r.finish_reason == "length"


def test_reply_stop_string_before_a_call(tokenizer):
    r = reply(tokenizer, stop=["K"])
    _, done = r.feed("OK<tool_call>" + CALL, None, 3)
    assert done and r.body(0)["choices"][0]["message"]["content"] == "O" and r.finish_reason == "stop"


def test_operator_chat_template(pair, tmp_path):
    """--chat-template (here a file) replaces the model's template; tool calling follows the template in use."""
    openai = pytest.importorskip("openai")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %} ")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", pair[0], "--draft", pair[1], "--port", "0", "--chat-template", str(template)])
    server = make_server(args)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none", max_retries=0)
    try:
        r = client.chat.completions.create(model="default_model", messages=USER)
        assert r.choices[0].message.content == "yo" and r.usage.prompt_tokens == len("Weather in Paris? ")
        with pytest.raises(openai.BadRequestError, match="no tool-call format"):
            client.chat.completions.create(model="default_model", messages=USER, tools=[WEATHER])
    finally:
        server.shutdown()
        close(server)

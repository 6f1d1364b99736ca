"""Anthropic's Messages API and OpenAI's Responses API through dflash-mlx serve, with the real ``anthropic``
and ``openai`` clients against a server on 127.0.0.1.

Most tests use ``tiny.save_scripted_pair``: without tools it answers "yo"; with tools it thinks "hm", says
"OK" and calls get_weather(city="Paris"); after a tool result it answers "yo". The greedy-identity test uses
the random tiny qwen3 pair, whose answers are long and arbitrary.
"""

import json

import pytest
from tiny import USER, WEATHER, metric, save_scripted_pair, start_server

from dflash_mlx.server import close
from dflash_mlx.server.protocol import RequestError
from dflash_mlx.server.responses import ResponseStore

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER["function"]["parameters"]}
FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER["function"]["parameters"]}
QUESTION = USER[0]["content"]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return save_scripted_pair(tmp_path_factory.mktemp("apis"))


@pytest.fixture(scope="module")
def port(scripted):
    target, draft = scripted
    server = start_server("--model", target, "--draft", draft, "--block-size", "4", "--response-store-size", "4")
    yield server.server_address[1]
    server.shutdown()
    close(server)


@pytest.fixture
def claude(port):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)


@pytest.fixture
def oai(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def ask(claude, messages=None, max_tokens=2000, **fields):
    return claude.messages.create(model="default_model", max_tokens=max_tokens,
                                  messages=messages or [{"role": "user", "content": QUESTION}], **fields)


# -- Anthropic Messages ----------------------------------------------------------------------------------------


def test_messages_text(claude):
    r = ask(claude)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [(b.type, b.text) for b in r.content] == [("text", "yo")]
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    counted = claude.messages.count_tokens(model="default_model", messages=[{"role": "user", "content": QUESTION}])
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == counted.input_tokens > 5
    assert u.cache_creation_input_tokens == 0 and u.output_tokens >= 2


def test_messages_stream(claude):
    with claude.messages.stream(model="default_model", max_tokens=2000, system="Be brief.",
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == "yo" and final.stop_reason == "end_turn" and final.usage.output_tokens >= 2
    # The SDK passes on what the server sent, plus its own text/message events.
    sent = [e for e in events if e not in ("text", "thinking", "input_json", "signature", "citation")]
    assert sent[0] == "message_start" and sent[-2:] == ["message_delta", "message_stop"]
    assert sent[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(sent) - 5) + ["content_block_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_round_trip(claude, stream):
    def create(messages, **fields):
        if not stream:
            return ask(claude, messages, tools=[TOOL], **fields)
        with claude.messages.stream(model="default_model", max_tokens=2000, messages=messages, tools=[TOOL],
                                    **fields) as s:
            return s.get_final_message()

    first = create([{"role": "user", "content": QUESTION}], thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"] and first.stop_reason == "tool_use"
    thinking, text, call = first.content
    assert (thinking.thinking, text.text, call.name, call.input) == ("hm", "OK", "get_weather", {"city": "Paris"})
    assert call.id.startswith("toolu_")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C"}]}
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                    {"role": "user", "content": [result]}]
    final = create(conversation)
    assert [(b.type, b.text) for b in final.content] == [("text", "yo")] and final.stop_reason == "end_turn"
    assert final.usage.cache_read_input_tokens > 0  # the first turn's prompt was reused


def test_messages_thinking_only_when_asked(claude):
    plain = ask(claude, tools=[TOOL])
    assert [b.type for b in plain.content] == ["text", "tool_use"]  # the model thought, but nobody asked to see it


def test_messages_stop_sequences(claude):
    r = ask(claude, stop_sequences=["o", "never"])
    assert (r.content[0].text, r.stop_reason, r.stop_sequence) == ("y", "stop_sequence", "o")
    r = ask(claude, max_tokens=1)
    assert (r.content[0].text, r.stop_reason) == ("y", "max_tokens")


def test_messages_sampling_fields_through_extra_body(claude):
    r = ask(claude, extra_body={"temperature": 0.0, "top_p": 0.9, "top_k": 5})
    assert r.content[0].text == "yo"


@pytest.mark.parametrize("fields, match", [
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "answers no earlier tool_use"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"tool_choice": {"type": "any"}, "tools": [TOOL]}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4000}, "max_tokens": 2000}, "less than max_tokens"),
    ({"max_tokens": 10**9, "timeout": 60}, "context length"),  # a timeout: the SDK refuses to wait that long
])
def test_messages_refusals_name_the_problem(claude, fields, match):
    with pytest.raises(anthropic.BadRequestError, match=match) as info:
        claude.messages.create(**{"model": "default_model", "max_tokens": 2000,
                                  "messages": [{"role": "user", "content": QUESTION}], **fields})
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"


def test_messages_unknown_model(claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-opus-4", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"


# -- OpenAI Responses --------------------------------------------------------------------------------------------


def test_responses_text(oai):
    r = oai.responses.create(model="default_model", input=QUESTION, instructions="Be brief.")
    assert r.object == "response" and r.status == "completed" and r.output_text == "yo"
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens > 5 and r.usage.output_tokens >= 2 and r.instructions == "Be brief."


def test_responses_stream(oai):
    events = list(oai.responses.create(model="default_model", input=QUESTION, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "yo"
    assert events[-1].response.output_text == "yo"


def test_a_response_cut_short_is_incomplete_down_to_its_message(oai):
    r = oai.responses.create(model="default_model", input=QUESTION, max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in r.output] == ["incomplete"]
    events = list(oai.responses.create(model="default_model", input=QUESTION, max_output_tokens=1, stream=True))
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete" and done == ["incomplete"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_round_trip(oai, stream):
    def create(**fields):
        if not stream:
            return oai.responses.create(model="default_model", tools=[FUNCTION], **fields)
        with oai.responses.stream(model="default_model", tools=[FUNCTION], **fields) as s:
            return s.get_final_response()

    first = create(input=QUESTION, reasoning={"effort": "low"})
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = first.output
    assert reasoning.content[0].text == "hm" and message.content[0].text == "OK"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    chained = create(previous_response_id=first.id, input=[output])
    assert chained.output_text == "yo" and chained.previous_response_id == first.id
    # The same conversation sent whole, without the store.
    whole = create(input=[{"role": "user", "content": QUESTION}, *[i.model_dump(exclude_none=True) for i in first.output],
                          output], store=False)
    assert whole.output_text == "yo" and whole.usage.input_tokens == chained.usage.input_tokens


def test_responses_store_get_delete(oai):
    r = oai.responses.create(model="default_model", input=QUESTION)
    got = oai.responses.retrieve(r.id)
    assert (got.id, got.output_text) == (r.id, "yo")
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        oai.responses.create(model="default_model", input="again", previous_response_id=r.id)
    unstored = oai.responses.create(model="default_model", input=QUESTION, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_response_store_is_bounded_lru():
    store = ResponseStore(2)
    for name in "abc":
        store.put({"id": name}, [])
        if name == "b":
            store.get("a")  # a is now the most recently used
    assert store.get("a") and store.get("c")
    with pytest.raises(RequestError) as info:
        store.get("b")
    assert info.value.status == 404
    ResponseStore(0).put({"id": "x"}, [])  # a store of size 0 keeps nothing


@pytest.mark.parametrize("fields, match", [
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "answers no earlier"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"text": {"format": {"type": "json_object"}}}, "structured output"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"max_output_tokens": 10**9}, "context length"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
])
def test_responses_refusals_name_the_problem(oai, fields, match):
    with pytest.raises(openai.BadRequestError, match=match):
        oai.responses.create(**{"model": "default_model", "input": QUESTION, **fields})


# -- the three APIs agree ------------------------------------------------------------------------------------


def test_greedy_answers_are_the_same_on_every_api(pair):
    server = start_server("--model", pair[0], "--draft", pair[1], "--block-size", "4", "--max-prompt-tokens", "400")
    port = server.server_address[1]
    try:
        system, question = "You answer questions.", "What is 7 + 5?"
        chat = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)
        expected = chat.chat.completions.create(
            model="default_model", max_tokens=24, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        ).choices[0].message.content
        assert len(expected) > 10
        r = claude.messages.create(model="default_model", max_tokens=24, system=system,
                                   messages=[{"role": "user", "content": question}], extra_body={"temperature": 0})
        assert r.content[0].text == expected
        with claude.messages.stream(model="default_model", max_tokens=24, system=[{"type": "text", "text": system}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": question}]}]) as s:
            assert s.get_final_message().content[0].text == expected
        r = chat.responses.create(model="default_model", max_output_tokens=24, instructions=system, input=question)
        assert r.output_text == expected
        events = chat.responses.create(model="default_model", max_output_tokens=24, instructions=system,
                                       input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
                                       stream=True)
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    finally:
        server.shutdown()
        close(server)


def test_metrics_count_requests_per_api(port, claude):
    before = metric(port, 'dflash_api_requests_total{api="messages"}')
    ask(claude)
    assert metric(port, 'dflash_api_requests_total{api="messages"}') == before + 1


def test_context_management_clears_earlier_thinking():
    from dflash_mlx.server.anthropic import _kept_thinking_turns, conversation

    def turn(i):
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": f"t{i}", "signature": ""},
                                                 {"type": "text", "text": f"a{i}"}]}

    messages = [{"role": "user", "content": "q"}, turn(1), {"role": "user", "content": "q"}, turn(2),
                {"role": "user", "content": "q"}, turn(3), {"role": "user", "content": "q"}]

    def kept(edits):
        kept_turns = _kept_thinking_turns({"edits": edits})
        return [m.get("reasoning_content") for m in conversation(None, messages, kept_turns) if m["role"] == "assistant"]

    assert kept([]) == ["t1", "t2", "t3"]
    assert kept([{"type": "clear_thinking_20251015", "keep": "all"}]) == ["t1", "t2", "t3"]
    assert kept([{"type": "clear_thinking_20251015"}]) == [None, None, "t3"]  # Anthropic's default: the last turn
    assert kept([{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]) == [None, "t2", "t3"]


def test_context_management_through_the_client(claude):
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert ask(claude, extra_body={"context_management": edits}).content[0].text == "yo"
    with pytest.raises(anthropic.BadRequestError, match="clear_tool_uses_20250919"):
        ask(claude, extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})


def test_messages_stream_pings_while_the_prompt_is_prefilled(scripted, monkeypatch):
    """Nothing from the worker for a while (a long prefill): the stream pings, then goes on."""
    import asyncio
    import threading
    from pathlib import Path
    from types import SimpleNamespace

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dflash_mlx.server import http
    from dflash_mlx.server.anthropic import MessageReply
    from dflash_mlx.server.jobs import End, Job
    from dflash_mlx.server.request import GenerationParams, Request
    from dflash_mlx.server.streams import JobRun
    from dflash_mlx.server.worker import Metrics

    monkeypatch.setattr(http, "PING_SECONDS", 0.05)
    params = GenerationParams([1, 2], 4)
    reply = MessageReply(Request("chat", "m", True, False, [], None, "normal", params),
                         load_tokenizer(Path(scripted[0])), thinking=False)

    async def stream():
        async def receive():  # a client that stays
            await asyncio.Event().wait()

        job = Job(params)
        run = JobRun(Metrics(), job, receive)

        def generate():  # the first token after 0.3 s
            job.events.put(SimpleNamespace(text="yo", finish_reason="stop", generation_tokens=3))
            job.events.put(End())

        threading.Timer(0.3, generate).start()
        sent = [chunk async for chunk in http.Routes(None)._stream(run, reply, reply.opening())]
        run.close()
        return b"".join(sent).decode()

    text = asyncio.run(stream())
    events = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    first_block = events.index("content_block_start")
    assert events[:2] == ["message_start", "ping"] and events[2:first_block].count("ping") >= 2
    assert events[first_block:] == ["content_block_start", "content_block_delta", "content_block_stop",
                                    "message_delta", "message_stop"]

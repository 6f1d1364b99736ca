"""OpenAI's Responses API (``/v1/responses``) on the shared pipeline, with its bounded response store.

``input`` (text, or items: messages, ``function_call``, ``function_call_output``,
``reasoning``) and ``instructions`` map onto OpenAI-shaped chat messages, the
function tools onto chat tools, and the model's chat template renders them, as
for ``/v1/chat/completions``. ``previous_response_id`` prepends the stored
conversation of an earlier response (its input and output; not its
instructions, as OpenAI's API does). The store is in memory, LRU, bounded in
entries (``--response-store-size``); ``store: false`` keeps a response out.
The answer is ``reply.Generated`` rendered as output items and stream events.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from .protocol import FIELDS, MAX_MESSAGES, MAX_TOOLS, Field, RequestError, ServerInfo, max_tokens_check, read_fields
from .reply import Generated, PartsReply
from .request import Request, chat_prompt, check_model, make_request, tool_arguments

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET``/``DELETE``: in memory, least recently used out first."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        """Keep ``response`` and its whole conversation as chat messages (instructions left out)."""
        if self.size == 0:
            return
        with self._lock:
            self._entries[response["id"]] = (response, messages)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = "previous_response_id") -> tuple[dict, list[dict]]:
        """A stored response and its conversation; ``param`` names where the id came from in a 404."""
        with self._lock:
            if response_id not in self._entries:
                raise RequestError(404, f"no stored response {response_id!r}: it was never stored, was deleted, or "
                                        "left the store (--response-store-size)", param)
            self._entries.move_to_end(response_id)
            return self._entries[response_id]

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._entries.pop(response_id, None) is None:
                raise RequestError(404, f"no stored response {response_id!r}")


def _only(name: str, allowed: dict, why: str):
    """The check of an object field whose keys may only take the given values (``None``: any of its type)."""

    def check(value: dict, info: ServerInfo) -> dict:
        for key, item in value.items():
            if key not in allowed or (item is not None and allowed[key] is not None and item not in allowed[key]):
                raise RequestError(400, f"{name}.{key}={item!r} is not supported: {why}", name)
        return value

    return check


def _input(value: str | list, info: ServerInfo) -> str | list:
    if isinstance(value, list) and not 0 < len(value) <= MAX_MESSAGES:
        raise RequestError(400, f"input must hold 1 to {MAX_MESSAGES} items", "input")
    return value


def _include(value: list, info: ServerInfo) -> list:
    if value:
        raise RequestError(400, f"include={value!r:.80} is not supported: responses carry no extra data to include",
                           "include")
    return value


def _text_field(value: dict, info: ServerInfo) -> dict:
    fmt = value.get("format")
    if set(value) - {"format", "verbosity"} or (fmt is not None and fmt != {"type": "text"}):
        raise RequestError(400, 'text must be {"format": {"type": "text"}}: structured output is not supported', "text")
    if value.get("verbosity") not in (None, "medium"):
        raise RequestError(400, "text.verbosity is not supported: the model decides how much to write", "text")
    return value


RESPONSES_FIELDS = {f.name: f for f in [
    Field("model", str, "default_model"),
    Field("input", (str, list), required=True, check=_input),
    Field("instructions", str),
    Field("tools", list, hi=MAX_TOOLS),
    FIELDS["tool_choice"],
    FIELDS["parallel_tool_calls"],
    Field("max_output_tokens", int, lo=1, check=max_tokens_check("max_output_tokens")),
    FIELDS["temperature"],
    FIELDS["top_p"],
    FIELDS["stream"],
    Field("store", bool, True),
    Field("previous_response_id", str),
    Field("metadata", dict, {}),
    FIELDS["user"],
    Field("safety_identifier", str),
    Field("prompt_cache_key", str),  # prefixes are cached without being asked
    Field("text", dict, check=_text_field),
    Field("reasoning", dict, check=_only("reasoning", {"effort": REASONING_EFFORTS, "summary": None},
                                         "reasoning effort switches thinking on or off")),
    Field("truncation", str, "disabled", only=("disabled",), why="a prompt that does not fit is refused, not cut"),
    Field("include", list, [], check=_include),
    Field("stream_options", dict, {}, check=_only("stream_options", {"include_obfuscation": (False,)},
                                                  "stream events are not padded")),
    Field("background", bool, False, only=(False,), why="background responses are not supported"),
    Field("top_logprobs", int, 0, only=(0,), why="log probabilities are not computed"),
    Field("service_tier", str, only=("auto", "default"), why="there is one tier"),
]}
RESPONSES_UNSUPPORTED = {
    "conversation": "conversations are not stored: send previous_response_id, or the whole input",
    "prompt": "prompt templates are not supported: send input and instructions",
    "max_tool_calls": "the model decides how many calls it makes",
}


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where} must be a string or a list of text parts", "input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            shown = kind if isinstance(kind, str) else type(part).__name__
            raise RequestError(400, f"{where}[{i}] is a {shown!r} part: only input_text and output_text parts with a "
                                    "text string are supported", "input")
        texts.append(part["text"])
    return "".join(texts)


def _extend(messages: list[dict], items: list, called: set[str]) -> None:
    """Append Responses input items to ``messages`` as OpenAI-shaped chat messages."""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(400, f"{where} must be an object", "input")
        kind = item.get("type", "message")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(400, f"{where}.role must be user, assistant, system or developer", "input")
            text = _content_text(item.get("content"), f"{where}.content")
            if role == "assistant" and last is not None and not last["content"] and "tool_calls" not in last:
                last["content"] = text  # the message after its reasoning item
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) and v for v in (call_id, name)) or not isinstance(arguments, str):
                raise RequestError(400, f"{where} needs call_id, name and arguments strings", "input")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": tool_arguments(arguments, f"{where}.arguments", "input")}}
            if last is None:
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            called.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise RequestError(400, f"{where}.call_id {call_id!r} answers no earlier function_call", "input")
            output = _content_text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise RequestError(400, f"{where}.encrypted_content is not supported: this server never encrypts "
                                        "reasoning", "input")
            content = item.get("content") or []
            if not isinstance(content, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                        for p in content):
                raise RequestError(400, f"{where}.content must be reasoning_text parts", "input")
            messages.append({"role": "assistant", "content": "", "reasoning_content": "".join(p["text"] for p in content)})
        else:
            raise RequestError(400, f"{where} is a {kind!r} item: only message, function_call, function_call_output "
                                    "and reasoning items are supported", "input")


def _tools(tools: list | None) -> list[dict] | None:
    """Responses function tools as chat tools."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(400, f"tools[{i}] is a {kind!r} tool: only function tools are supported", "tools")
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if extra or not isinstance(tool.get("name"), str):
            raise RequestError(400, f"tools[{i}] must be {{\"type\": \"function\", \"name\": ..., \"description\": ..., "
                                    f"\"parameters\": ...}}", "tools")
        if tool.get("strict"):
            raise RequestError(400, f"tools[{i}].strict is not supported: arguments are not constrained to the schema",
                               "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out or None


def parse_response_request(body: Any, info: ServerInfo, store: ResponseStore) -> tuple[Request, "ResponseReply"]:
    """A Responses body as the internal request, and the reply that will answer it."""
    values = read_fields(body, "chat", info, RESPONSES_FIELDS, RESPONSES_UNSUPPORTED)
    check_model(values["model"], info)
    history: list[dict] = []
    if values["previous_response_id"] is not None:
        history = store.get(values["previous_response_id"])[1]
    conversation = [dict(m, tool_calls=list(m["tool_calls"])) if "tool_calls" in m else dict(m) for m in history]
    called = {c["id"] for m in conversation for c in m.get("tool_calls", [])}
    items = values["input"] if isinstance(values["input"], list) else [{"role": "user", "content": values["input"]}]
    _extend(conversation, items, called)
    messages = conversation
    if values["instructions"]:
        messages = [{"role": "system", "content": values["instructions"]}, *conversation]
    reasoning = values["reasoning"] or {}
    kwargs = {} if reasoning.get("effort") is None else {"enable_thinking": reasoning["effort"] != "none"}
    tools = _tools(values["tools"])
    prompt = chat_prompt(messages, tools, kwargs, info, "reasoning.effort")
    values["max_tokens"] = values["max_output_tokens"]
    request = make_request("chat", values, prompt, info, where="input", stop=[], tools=tools, limit="max_output_tokens")
    thinking = reasoning.get("effort") not in (None, "none")
    return request, ResponseReply(request, info.tokenizer, values, conversation, thinking, store)


class ResponseReply(PartsReply):
    """The answer to one Responses request: a response object, or its stream events as they complete."""

    def __init__(self, request: Request, tokenizer: Any, values: dict, conversation: list[dict], thinking: bool,
                 store: ResponseStore):
        super().__init__(Generated(request, tokenizer), thinking)
        self.request, self.values, self.conversation, self.store = request, values, conversation, store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output: list[dict] = []
        self.sequence = 0

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def response(self, status: str, cached_tokens: int = 0) -> dict:
        v = self.values
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": v["instructions"], "max_output_tokens": v["max_output_tokens"], "model": self.request.model,
            "output": self.output, "parallel_tool_calls": True, "previous_response_id": v["previous_response_id"],
            "reasoning": {"effort": (v["reasoning"] or {}).get("effort"), "summary": None}, "store": v["store"],
            "temperature": self.request.params.temp, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": v["tools"] or [], "top_p": self.request.params.top_p, "truncation": "disabled",
            "metadata": v["metadata"], "user": v["user"],
        }
        if status != "in_progress":
            n, m = len(self.request.params.prompt), self.generated.completion_tokens
            body["usage"] = {"input_tokens": n, "input_tokens_details": {"cached_tokens": cached_tokens},
                             "output_tokens": m, "total_tokens": n + m}
        return body

    def opening(self) -> list[dict]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def ping(self) -> None:
        return None

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _start(self, kind: str, value: Any) -> list[dict]:
        if kind == "tool_call":
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": value["id"],
                    "name": value["name"], "arguments": value["arguments"], "status": "completed"}
            self.output.append(item)
            return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", **self._where(), delta=value["arguments"])]
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
            shown = {**item, "content": []}
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            shown = {**item, "content": [], "status": "in_progress"}
        self.output.append(item)
        events = [self._event("response.output_item.added", output_index=len(self.output) - 1, item=shown)]
        if kind == "content":
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part={**item["content"][0]}))
        return events

    def _grow(self, kind: str, text: str) -> list[dict]:
        self.output[-1]["content"][0]["text"] += text
        if kind == "reasoning":
            return [self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]
        return [self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])]

    def _end(self, kind: str) -> list[dict]:
        item = self.output[-1]
        if kind == "tool_call":
            events = [self._event("response.function_call_arguments.done", **self._where(),
                                  arguments=item["arguments"], name=item["name"])]
        elif kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **self._where(), content_index=0,
                                  text=item["content"][0]["text"])]
        else:
            if self.generated.finish_reason == "length":  # the answer was cut short by max_output_tokens
                item["status"] = "incomplete"
            part = item["content"][0]
            events = [self._event("response.output_text.done", **self._where(), content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", **self._where(), content_index=0, part=part)]
        return events + [self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def _finish(self, cached_tokens: int) -> dict:
        """The final response object, kept in the store when asked."""
        status = "incomplete" if self.generated.finish_reason == "length" else "completed"
        response = self.response(status, cached_tokens)
        if self.values["store"]:
            g = self.generated
            answer: dict[str, Any] = {"role": "assistant", "content": g.content}
            if g.reasoning:
                answer["reasoning_content"] = g.reasoning
            if g.tool_calls:
                answer["tool_calls"] = [{"id": c["id"], "type": "function",
                                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                                        for c in g.tool_calls]
            self.store.put(response, [*self.conversation, answer])
        return response

    def closing(self, cached_tokens: int) -> list[dict]:
        response = self._finish(cached_tokens)
        return [self._event(f"response.{response['status']}", response=response)]

    def failure(self, message: str, status: int) -> list[dict]:
        code = "server_error" if status >= 500 else "invalid_request_error"
        return [self._event("error", code=code, message=message, param=None)]

    def body(self, cached_tokens: int) -> dict:
        return self._finish(cached_tokens)

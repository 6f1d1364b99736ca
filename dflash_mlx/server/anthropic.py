"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the shared pipeline.

A Messages body maps onto the same internal ``Request`` as a chat completion:
``system`` and the content blocks become OpenAI-shaped messages (``tool_use``
blocks an assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages,
``thinking`` blocks the assistant's ``reasoning_content``), ``tools`` become
function tools, and the model's chat template renders them, as for
``/v1/chat/completions``. The answer is ``reply.Generated`` rendered as
Anthropic's content blocks and stream events. What cannot be honoured is
refused by name with a 400 in Anthropic's error shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .protocol import MAX_MESSAGES, MAX_TOOLS, NUMBER, Field, RequestError, ServerInfo, max_tokens_check, read_fields, stop_list
from .reply import Generated, PartsReply
from .request import Request, chat_prompt, check_model, make_request

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               411: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
MIN_THINKING_BUDGET = 1024  # Anthropic's own lower bound


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """Anthropic's error shape."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _cache_control(value: Any, info: ServerInfo | None) -> dict:
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise RequestError(400, 'cache_control must be {"type": "ephemeral"}', "cache_control")
    return value


def _tool_choice(value: dict, info: ServerInfo) -> dict:
    if value.get("type") != "auto":
        raise RequestError(400, f"tool_choice type {value.get('type')!r} is not supported: only \"auto\", "
                                "the model decides whether to call a tool", "tool_choice")
    if value.get("disable_parallel_tool_use"):
        raise RequestError(400, "tool_choice.disable_parallel_tool_use is not supported: "
                                "the model decides how many calls it makes", "tool_choice")
    return value


def _thinking(value: dict, info: ServerInfo) -> dict:
    kind = value.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise RequestError(400, 'thinking.type must be "enabled", "adaptive" or "disabled"', "thinking")
    if value.get("display") not in (None, "summarized"):
        raise RequestError(400, "thinking.display \"omitted\" is not supported: thinking is returned as the model "
                                "writes it", "thinking")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
            raise RequestError(400, f"thinking.budget_tokens must be an integer of at least {MIN_THINKING_BUDGET}",
                               "thinking")
    return value


CLEAR_THINKING = "clear_thinking_20251015"


def _context_management(value: dict, info: ServerInfo) -> dict:
    """Context editing: the thinking-clearing edit is applied (``keep``: "all", or the last N thinking turns,
    default 1); clearing tool uses is refused."""
    edits = value.get("edits")
    if set(value) - {"edits"} or not isinstance(edits, list):
        raise RequestError(400, 'context_management must be {"edits": [...]}', "context_management")
    for edit in edits:
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != CLEAR_THINKING:
            raise RequestError(400, f"context_management edit {kind!r} is not supported: only {CLEAR_THINKING} "
                                    "(the client sends the context it wants)", "context_management")
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        turns = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
        if set(edit) - {"type", "keep"} or not (keep == "all" or (isinstance(turns, int) and not isinstance(turns, bool)
                                                                   and turns >= 1)):
            raise RequestError(400, f'{CLEAR_THINKING} takes keep: "all" or {{"type": "thinking_turns", "value": N}}',
                               "context_management")
    return value


def _kept_thinking_turns(context: dict | None) -> int | None:
    """How many of the latest assistant turns keep their thinking (None: all)."""
    kept = None
    for edit in (context or {}).get("edits", []):
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep != "all":
            kept = keep["value"] if kept is None else min(kept, keep["value"])
    return kept


MESSAGES_FIELDS = {f.name: f for f in [
    Field("model", str, required=True),
    Field("max_tokens", int, lo=1, required=True, check=max_tokens_check("max_tokens")),
    Field("messages", list, lo=1, hi=MAX_MESSAGES, required=True),
    Field("system", (str, list)),
    Field("stop_sequences", list, [], check=stop_list("stop_sequences")),
    Field("temperature", NUMBER, lo=0, hi=1, tiny=1e-6),
    Field("top_p", NUMBER, lo=0, hi=1, above=True),
    Field("top_k", int, lo=0),
    Field("stream", bool, False),
    Field("tools", list, hi=MAX_TOOLS),
    Field("tool_choice", dict, check=_tool_choice),
    Field("thinking", dict, check=_thinking),
    Field("metadata", dict),
    Field("cache_control", dict, check=_cache_control),  # prefixes are cached without being asked
    Field("service_tier", str, only=("auto", "standard_only"), why="there is one tier"),
    Field("context_management", dict, check=_context_management),
]}
COUNT_FIELDS = {name: MESSAGES_FIELDS[name] for name in ("model", "messages", "system", "tools", "tool_choice",
                                                          "thinking", "cache_control", "context_management")}
MESSAGES_UNSUPPORTED = {
    "output_config": "effort levels and structured output are not supported",
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported: run the tools in the client",
}
BLOCK_KEYS = {  # the keys each content block may carry
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}
BLOCK_STRINGS = {  # the string fields each block needs, and whether they must be non-empty
    "text": {"text": False}, "tool_use": {"id": True, "name": True}, "tool_result": {"tool_use_id": True},
    "thinking": {"thinking": False},
}


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined by blank lines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(400, f"{where} must be a string or a list of text blocks", "messages")
    return "\n\n".join(_block(block, f"{where}[{i}]", {"text"})["text"] for i, block in enumerate(value))


def _block(block: Any, where: str, kinds: set[str]) -> dict:
    """One content block, checked: a kind in ``kinds`` with its fields of the right types and no others."""
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str) or kind not in BLOCK_KEYS:
        shown = kind if isinstance(kind, str) else type(block).__name__
        raise RequestError(400, f"{where} is a {shown!r} block: this server serves a text model and takes only text, "
                                "tool_use, tool_result and thinking blocks", "messages")
    if kind not in kinds:
        raise RequestError(400, f"{where}: a {kind} block cannot appear here (only {', '.join(sorted(kinds))})", "messages")
    extra = sorted(k for k, v in block.items() if k not in BLOCK_KEYS[kind] and v is not None)
    if extra:
        raise RequestError(400, f"{where}.{extra[0]} is not supported on a {kind} block", "messages")
    if block.get("citations"):
        raise RequestError(400, f"{where}.citations are not supported", "messages")
    if block.get("cache_control") is not None:
        _cache_control(block["cache_control"], None)
    for name, non_empty in BLOCK_STRINGS[kind].items():
        if not isinstance(block.get(name), str) or (non_empty and not block[name]):
            raise RequestError(400, f"{where}.{name} must be a {'non-empty ' if non_empty else ''}string", "messages")
    if kind == "tool_use" and not isinstance(block.get("input"), dict):
        raise RequestError(400, f"{where}.input must be an object", "messages")
    if kind == "tool_result" and not isinstance(block.get("is_error", False), bool):
        raise RequestError(400, f"{where}.is_error must be a boolean", "messages")
    return block


def conversation(system: Any, messages: list, kept_thinking: int | None = None) -> list[dict]:
    """``system`` and Anthropic messages as the OpenAI-shaped messages a chat template takes; only the latest
    ``kept_thinking`` assistant turns keep their thinking (None: all)."""
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    called: set[str] = set()  # tool_use ids so far: a tool_result must answer one of them
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(400, f"{where}.role must be \"user\" or \"assistant\" (the system prompt goes in system)",
                               "messages")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise RequestError(400, f"{where}.{extra[0]} is not supported on a message", "messages")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise RequestError(400, f"{where}.content must be a string or a list of content blocks", "messages")
        if m["role"] == "assistant":
            out.append(_assistant(content, where, called))
        else:
            out += _user(content, where, called)
    if out and out[-1]["role"] == "assistant":
        raise RequestError(400, "the last message is the assistant's: continuing a prefilled answer is not supported; "
                                "end with a user message", "messages")
    if kept_thinking is not None:
        turns = [m for m in out if m["role"] == "assistant"]
        for m in turns[: max(len(turns) - kept_thinking, 0)]:
            m.pop("reasoning_content", None)
    return out


def _assistant(content: list, where: str, called: set[str]) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(content):
        block = _block(block, f"{where}.content[{j}]", {"text", "tool_use", "thinking"})
        if block["type"] == "text":
            texts.append(block["text"])
        elif block["type"] == "thinking":
            thoughts.append(block["thinking"])
        else:
            called.add(block["id"])
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
    message["content"] = "\n\n".join(texts)
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: list, where: str, called: set[str]) -> list[dict]:
    out, texts = [], []
    for j, block in enumerate(content):
        block = _block(block, f"{where}.content[{j}]", {"text", "tool_result"})
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        if block["tool_use_id"] not in called:
            raise RequestError(400, f"{where}.content[{j}].tool_use_id {block['tool_use_id']!r} answers no earlier "
                                    "tool_use block", "messages")
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
            texts = []
        # is_error has no place in chat templates: the result's text says what failed.
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                    "content": _text(block.get("content", ""), f"{where}.content[{j}].content")})
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tools(tools: list | None) -> list[dict] | None:
    """Anthropic tool definitions as OpenAI function tools."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(400, f"tools[{i}] is a {kind!r} tool: only custom tools (name, description, "
                                    "input_schema) are supported", "tools")
        extra = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
        if extra:
            raise RequestError(400, f"tools[{i}].{extra[0]} is not supported", "tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict) or not isinstance(
                tool.get("description", ""), str):
            raise RequestError(400, f"tools[{i}] needs a name, an input_schema object and a string description", "tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _prompt(values: dict, info: ServerInfo) -> tuple[list[int], list[dict] | None]:
    check_model(values["model"], info)
    thinking = values["thinking"]
    kwargs = {} if thinking is None else {"enable_thinking": thinking["type"] != "disabled"}
    tools = _tools(values["tools"])
    messages = conversation(values["system"], values["messages"], _kept_thinking_turns(values["context_management"]))
    return chat_prompt(messages, tools, kwargs, info, "thinking"), tools


def parse_messages(body: Any, info: ServerInfo) -> tuple[Request, bool]:
    """A Messages body as the internal request, and whether thinking blocks were asked for."""
    values = read_fields(body, "chat", info, MESSAGES_FIELDS, MESSAGES_UNSUPPORTED)
    thinking = values["thinking"]
    if thinking is not None and thinking["type"] == "enabled" and thinking["budget_tokens"] >= values["max_tokens"]:
        raise RequestError(400, "thinking.budget_tokens must be less than max_tokens", "thinking")
    prompt, tools = _prompt(values, info)
    request = make_request("chat", values, prompt, info, where="messages", stop=values["stop_sequences"], tools=tools)
    return request, thinking is not None and thinking["type"] != "disabled"


def count_tokens(body: Any, info: ServerInfo) -> dict:
    """``/v1/messages/count_tokens``: the prompt's length as this server's chat template renders it."""
    values = read_fields(body, "chat", info, COUNT_FIELDS, MESSAGES_UNSUPPORTED)
    return {"input_tokens": len(_prompt(values, info)[0])}


class MessageReply(PartsReply):
    """The answer to one Messages request: content blocks, or Anthropic's stream events as they complete."""

    def __init__(self, request: Request, tokenizer: Any, thinking: bool):
        super().__init__(Generated(request, tokenizer, call_id=lambda: f"toolu_{uuid.uuid4().hex[:24]}"), thinking)
        self.request = request
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks: list[dict] = []

    def _message(self, usage: dict, stop_reason: str | None = None, stop_sequence: str | None = None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.request.model,
                "content": self.blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def usage(self, cached_tokens: int) -> dict:
        # Anthropic counts input_tokens after the cache: the three input counts add up to the prompt.
        return {"input_tokens": len(self.request.params.prompt) - cached_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens,
                "output_tokens": self.generated.completion_tokens}

    def opening(self) -> list[dict]:
        start = self._message(self.usage(0))
        return [{"type": "message_start", "message": {**start, "content": []}}, self.ping()]

    def ping(self) -> dict:
        return {"type": "ping"}

    def _start(self, kind: str, value: Any) -> list[dict]:
        if kind == "tool_call":
            block = {"type": "tool_use", "id": value["id"], "name": value["name"], "input": {}}
        elif kind == "reasoning":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        self.blocks.append(block)
        events = [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": {**block}}]
        if kind == "tool_call":
            block["input"] = _arguments(value["arguments"])
            events.append(self._delta({"type": "input_json_delta", "partial_json": value["arguments"]}))
        return events

    def _grow(self, kind: str, text: str) -> list[dict]:
        key = "thinking" if kind == "reasoning" else "text"
        self.blocks[-1][key] += text
        return [self._delta({"type": f"{key}_delta", key: text})]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _end(self, kind: str) -> list[dict]:
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _stop(self) -> tuple[str, str | None]:
        reason = STOP_REASONS[self.generated.finish_reason]
        if reason == "end_turn" and self.generated.stop_string is not None:
            return "stop_sequence", self.generated.stop_string
        return reason, None

    def closing(self, cached_tokens: int) -> list[dict]:
        reason, sequence = self._stop()
        return [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": self.usage(cached_tokens)}, {"type": "message_stop"}]

    def failure(self, message: str, status: int) -> list[dict]:
        return [error_body(message, status)]

    def body(self, cached_tokens: int) -> dict:
        return self._message(self.usage(cached_tokens), *self._stop())


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # parsers give JSON text; anything else is passed on as it is
        return text

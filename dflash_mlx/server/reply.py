"""The answer side of ``dflash-mlx serve``: what the model wrote, split once, rendered per API.

``Generated`` takes the generated text piece by piece and splits it the one way
all three APIs share: stop strings cut the raw text first (so they end the
reply wherever they appear); then mlx_lm's text state machine splits what is
left into content, reasoning and tool calls exactly as mlx_lm.server does, and
the tokenizer's tool parser reads each call. A call the parser cannot read is
kept as text in the content, so nothing the model wrote is lost. Each API's
renderer (``Reply`` here for OpenAI chat and text completions, ``anthropic`` and
``responses`` for the others) turns the ordered segments into its own shapes.
No sockets and no MLX arrays.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Callable

from ..errors import one_line
from .protocol import error_body
from .request import Request

Segment = tuple[str, Any]  # ("content" | "reasoning", text) or ("tool_call", {"id", "name", "arguments"})


class StopMatcher:
    """Cuts generated text at the first stop string, holding back possible stop prefixes."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = stops, ""
        self.matched: str | None = None  # the stop string that ended the output

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop string ended the output."""
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Generated:
    """What the model wrote so far: content, reasoning and tool calls, in the order written.

    ``finish_reason`` ends as "stop" (end of text or a stop string; ``stop_string``
    says which), "length", or "tool_calls" when the model called a tool and stopped.
    """

    def __init__(self, request: Request, tokenizer: Any, call_id: Callable[[], str] = new_call_id):
        self.request, self.tokenizer, self.call_id = request, tokenizer, call_id
        self.stops = StopMatcher(request.stop)
        self.state = self.machine = None
        if request.kind != "text":
            from mlx_lm.generate import TextStateMachine, make_text_state_machine

            self.machine = TextStateMachine
            self.state = make_text_state_machine(tokenizer).make_state(request.initial_state)
        self.where = request.initial_state if self.machine else "normal"  # the state the last text was in
        self.content = self.reasoning = self.tool_text = ""
        self.tool_calls: list[dict] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self._segments: list[Segment] = []

    @property
    def stop_string(self) -> str | None:
        return self.stops.matched

    def feed(self, text: str, finish_reason: str | None, completion_tokens: int) -> tuple[list[Segment], bool]:
        """Take one generated piece: the segments it completed (adjacent text of one kind merged), and whether it ended."""
        self.completion_tokens = completion_tokens
        piece, stopped = self.stops.feed(text)
        done = stopped or finish_reason is not None
        if done and not stopped:
            piece += self.stops.flush()
        self._split(piece, done)
        if done:
            ended = stopped or finish_reason == "stop"
            self.finish_reason = "tool_calls" if ended and self.tool_calls else ("stop" if stopped else finish_reason)
        segments, self._segments = self._segments, []
        return segments, done

    def _split(self, piece: str, final: bool) -> None:
        if self.machine is None:
            self._add("content", piece)
            return
        self.state, segments = self.machine.split(self.state, piece)
        if final:
            self.state, rest, where = self.machine.flush(self.state)
            segments.append((where, rest))
        for where, text in segments:
            if self.where == "tool" and where != "tool":
                self._close_tool(closed=True)
            if where == "tool":
                self.tool_text += text
            else:
                self._add("reasoning" if where == "reasoning" else "content", text)
            self.where = where
        if final and self.where == "tool":
            self._close_tool(closed=False)

    def _add(self, kind: str, text: str) -> None:
        if not text:
            return
        setattr(self, kind, getattr(self, kind) + text)
        if self._segments and self._segments[-1][0] == kind:
            text = self._segments.pop()[1] + text
        self._segments.append((kind, text))

    def _close_tool(self, closed: bool) -> None:
        text, self.tool_text = self.tool_text, ""
        try:
            calls = self.tokenizer.tool_parser(text, self.request.tools)
            calls = [self._call(call) for call in (calls if isinstance(calls, list) else [calls])]
        except Exception as e:  # parsers raise what they like on what a model writes
            logging.warning("a tool call could not be parsed (%s): kept as text", one_line(e))
            end = self.tokenizer.tool_call_end if closed and self.tokenizer.tool_call_end else ""
            self._add("content", self.tokenizer.tool_call_start + text + end)
            return
        self.tool_calls += calls
        self._segments += [("tool_call", call) for call in calls]

    def _call(self, call: Any) -> dict:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a call with a name: {call!r:.80}")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return {"id": call.get("id") or self.call_id(), "name": call["name"], "arguments": arguments}


class PartsReply:
    """A renderer whose answer is a list of typed parts (Anthropic's content blocks, the Responses API's output
    items): a part opens when the kind of text changes, each tool call is a part of its own, and a part closes
    when the next one opens or the answer ends. Subclasses say what opening (``_start``), growing (``_grow``)
    and closing (``_end``) a part sends; reasoning is left out unless ``thinking`` asks for it."""

    named_events = True

    def __init__(self, generated: Generated, thinking: bool):
        self.generated, self.thinking = generated, thinking
        self.open: str | None = None  # the segment kind of the last part while it may still grow

    def feed(self, text: str, finish_reason: str | None, completion_tokens: int) -> tuple[list[dict], bool]:
        segments, done = self.generated.feed(text, finish_reason, completion_tokens)
        events: list[dict] = []
        for kind, value in segments:
            if kind == "reasoning" and not self.thinking:
                continue
            if kind != self.open or kind == "tool_call":
                events += self._close()
                self.open = kind
                events += self._start(kind, value)
            if kind != "tool_call":
                events += self._grow(kind, value)
        if done:
            events += self._close()
        return (events if self.generated.request.stream else []), done

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        return self._end(kind)

    def _start(self, kind: str, value: Any) -> list[dict]:
        raise NotImplementedError

    def _grow(self, kind: str, text: str) -> list[dict]:
        raise NotImplementedError

    def _end(self, kind: str) -> list[dict]:
        raise NotImplementedError


class Reply:
    """The answer to one OpenAI chat or text completion request, built from the generated text as it arrives.

    Every API's renderer answers the HTTP layer the same way: ``opening`` (stream
    events to send at once), ``feed``, ``closing`` (the last stream events),
    ``failure`` (the events of a stream that fails), ``ping``, ``body`` (the
    whole answer), and ``named_events`` (whether SSE events carry an event name).
    """

    named_events = False

    def __init__(self, request: Request, tokenizer: Any, fingerprint: str):
        self.request, self.chat, self.fingerprint = request, request.kind == "chat", fingerprint
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.generated = Generated(request, tokenizer)
        self.delta: dict[str, Any] = {}  # what the next stream chunk carries
        self.tool_calls: list[dict] = []

    @property
    def finish_reason(self) -> str | None:
        return self.generated.finish_reason

    def feed(self, text: str, finish_reason: str | None, completion_tokens: int) -> tuple[list[dict], bool]:
        """Take one generated piece: the stream chunks to send now (none when not streaming), and whether it ended."""
        segments, done = self.generated.feed(text, finish_reason, completion_tokens)
        for kind, value in segments:
            if kind == "tool_call":
                call = {"id": value["id"], "type": "function",
                        "function": {"name": value["name"], "arguments": value["arguments"]}}
                if self.request.stream:
                    call["index"] = len(self.tool_calls)
                self.tool_calls.append(call)
                self.delta.setdefault("tool_calls", []).append(call)
            else:
                self.delta[kind] = self.delta.get(kind, "") + value
        chunks = []
        if self.request.stream and (done or (self.delta and self.generated.where != "tool")):
            chunks.append(self._chunk(self.finish_reason))
        return chunks, done

    def opening(self) -> list:
        return []  # no opening event: the stream starts with the first chunk

    def ping(self) -> None:
        return None

    def closing(self, cached_tokens: int) -> list:
        return ([self.usage_chunk(cached_tokens)] if self.request.include_usage else []) + ["[DONE]"]

    def failure(self, message: str, status: int) -> list:
        return [error_body(message, status), "[DONE]"]

    def _base(self, object_type: str) -> dict:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.request.model,
                "system_fingerprint": self.fingerprint}

    def _chunk(self, finish_reason: str | None) -> dict:
        delta, self.delta = self.delta, {}
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", **delta}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice["text"] = delta.get("content", "")
        return {**self._base("text_completion"), "choices": [choice]}

    def usage(self, cached_tokens: int) -> dict:
        n, m = len(self.request.params.prompt), self.generated.completion_tokens
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def usage_chunk(self, cached_tokens: int) -> dict:
        """The last stream chunk when the client asked for usage (stream_options.include_usage)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(kind), "choices": [], "usage": self.usage(cached_tokens)}

    def body(self, cached_tokens: int) -> dict:
        """The whole completion object (not streaming)."""
        content = self.generated.content
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
        if not self.chat:
            choice["text"] = content
            return {**self._base("text_completion"), "choices": [choice], "usage": self.usage(cached_tokens)}
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if self.tool_calls else "")}
        if self.generated.reasoning:
            message["reasoning"] = self.generated.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        choice["message"] = message
        return {**self._base("chat.completion"), "choices": [choice], "usage": self.usage(cached_tokens)}

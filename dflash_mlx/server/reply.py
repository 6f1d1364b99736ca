"""The answer side of ``dflash-mlx serve``: stop strings, tool calls, reasoning, OpenAI response objects.

A ``Reply`` takes the generated text piece by piece and gives back what to send:
stream chunks as they complete, or the whole completion object at the end. No
sockets and no MLX arrays. Stop strings cut the raw text first (so they end the
reply wherever they appear); then mlx_lm's text state machine splits what is
left into content, reasoning and tool calls exactly as mlx_lm.server does, and
the tokenizer's tool parser reads each call. A call the parser cannot read is
kept as text in the content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from ..errors import one_line
from .request import Request


class StopMatcher:
    """Cuts generated text at the first stop string, holding back possible stop prefixes."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop string ended the output."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Reply:
    """The answer to one completion request, built from the generated text as it arrives."""

    def __init__(self, request: Request, tokenizer: Any, fingerprint: str):
        self.request, self.chat, self.fingerprint = request, request.kind == "chat", fingerprint
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.stops = StopMatcher(request.stop)
        self.tokenizer = tokenizer
        self.state = self.machine = None
        if self.chat:
            from mlx_lm.generate import TextStateMachine, make_text_state_machine

            self.machine = TextStateMachine
            self.state = make_text_state_machine(tokenizer).make_state(request.initial_state)
        self.where = request.initial_state if self.chat else "normal"  # the state the last text was in
        self.content = self.reasoning = self.tool_text = ""
        self.tool_calls: list[dict] = []
        self.delta: dict[str, Any] = {}  # what the next stream chunk carries
        self.finish_reason: str | None = None
        self.completion_tokens = 0

    def feed(self, text: str, finish_reason: str | None, completion_tokens: int) -> tuple[list[dict], bool]:
        """Take one generated piece: the stream chunks to send now (none when not streaming), and whether it ended."""
        self.completion_tokens = completion_tokens
        piece, stopped = self.stops.feed(text)
        done = stopped or finish_reason is not None
        if done and not stopped:
            piece += self.stops.flush()
        self._split(piece, done)
        if done:
            self.finish_reason = "tool_calls" if (stopped or finish_reason == "stop") and self.tool_calls else (
                "stop" if stopped else finish_reason
            )
        chunks = []
        if self.request.stream and (done or (self.delta and self.where != "tool")):
            chunks.append(self._chunk(self.finish_reason))
        return chunks, done

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

    def _add(self, key: str, text: str) -> None:
        if text:
            setattr(self, key, getattr(self, key) + text)
            self.delta[key] = self.delta.get(key, "") + text

    def _close_tool(self, closed: bool) -> None:
        text, self.tool_text = self.tool_text, ""
        try:
            calls = self.tokenizer.tool_parser(text, self.request.tools)
            calls = [self._format(call) for call in (calls if isinstance(calls, list) else [calls])]
        except Exception as e:  # parsers raise what they like on what a model writes
            logging.warning("a tool call could not be parsed (%s): kept as text", one_line(e))
            end = self.tokenizer.tool_call_end if closed and self.tokenizer.tool_call_end else ""
            self._add("content", self.tokenizer.tool_call_start + text + end)
            return
        self.tool_calls += calls
        self.delta.setdefault("tool_calls", []).extend(calls)

    def _format(self, call: Any) -> dict:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a call with a name: {call!r:.80}")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out = {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": call["name"], "arguments": arguments}}
        if self.request.stream:
            out["index"] = len(self.tool_calls) + len(self.delta.get("tool_calls", []))
        return out

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
        n, m = len(self.request.params.prompt), self.completion_tokens
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def usage_chunk(self, cached_tokens: int) -> dict:
        """The last stream chunk when the client asked for usage (stream_options.include_usage)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(kind), "choices": [], "usage": self.usage(cached_tokens)}

    def body(self, cached_tokens: int) -> dict:
        """The whole completion object (not streaming)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
        if not self.chat:
            choice["text"] = self.content
            return {**self._base("text_completion"), "choices": [choice], "usage": self.usage(cached_tokens)}
        message: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning:
            message["reasoning"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        choice["message"] = message
        return {**self._base("chat.completion"), "choices": [choice], "usage": self.usage(cached_tokens)}


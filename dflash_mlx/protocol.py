"""The OpenAI-compatible protocol of ``dflash-mlx serve``: request fields, prompts, stop strings.

Pure functions over parsed JSON: no sockets and no threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import DFlashError
from .worker import Job


# Request keys refused outright, with why (anything else unknown is refused too).
UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "tool calling is not supported",
    "response_format": "structured output is not supported",
    "adapters": "adapters are not supported",
    "draft_model": "the drafter is fixed at start-up (--draft)",
    "role_mapping": "only the model's chat template is supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported",
}
COMMON_KEYS = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "stop", "seed", "stream", "stream_options", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size",
    "logit_bias", "xtc_probability", "xtc_threshold", "n", "logprobs", "top_logprobs",
    "num_draft_tokens", "user",
}


class RequestError(Exception):
    """A client error: the HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


# -- request parsing ----------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{name} must be a number", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(400, f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def _integer(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{name} must be an integer", name)
    if lo is not None and value < lo:
        raise RequestError(400, f"{name} must be at least {lo}, got {value}", name)
    return value


@dataclass
class Request:
    kind: str  # "chat" or "text"
    model: str
    stream: bool
    include_usage: bool
    stop: list[str]
    job: Job


def parse_request(body: Any, kind: str, app: Any) -> Request:
    """Validate a completion request body into a Job, or raise RequestError (4xx)."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from .model import MAX_BLOCK_SIZE
    from .sampling import SamplingParams

    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not given"
    allowed = COMMON_KEYS | ({"messages", "chat_template_kwargs"} if kind == "chat" else {"prompt"})
    for key in body:
        if key in UNSUPPORTED:
            raise RequestError(400, f"unsupported parameter {key!r}: {UNSUPPORTED[key]}", key)
        if key not in allowed:
            raise RequestError(400, f"unsupported parameter {key!r}", key)

    model = body.get("model", "default_model")
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string", "model")
    if model not in app.model_names:
        message = f"model {model!r} not found: this server serves {app.model_id!r}"
        raise RequestError(404, message, "model", "model_not_found")
    if _integer(body, "n", 1, lo=1) != 1:
        raise RequestError(400, "n > 1 is not supported: send one request per completion", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise RequestError(400, "logprobs is not supported", "logprobs")
    if body.get("top_logprobs") not in (None, -1, 0):
        raise RequestError(400, "top_logprobs is not supported", "top_logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be a boolean", "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(400, "stream_options must be {\"include_usage\": bool}", "stream_options")

    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop must be a non-empty string or a list of them", "stop")

    d = app.defaults
    max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
    max_tokens = _integer(body, "max_tokens", max_tokens or d.max_tokens, lo=1)
    temp = _number(body, "temperature", d.temp, lo=0)
    top_p = _number(body, "top_p", d.top_p, lo=0, hi=1)
    top_k = _integer(body, "top_k", d.top_k, lo=0)
    min_p = _number(body, "min_p", d.min_p, lo=0, hi=1)
    xtc_probability = _number(body, "xtc_probability", 0.0, lo=0, hi=1)
    xtc_threshold = _number(body, "xtc_threshold", 0.1, lo=0, hi=0.5)
    if top_p == 0:
        raise RequestError(400, "top_p must be > 0", "top_p")
    try:
        SamplingParams(temp, top_p, top_k, min_p)
    except DFlashError as e:
        raise RequestError(400, str(e), "temperature") from None
    sampling: dict[str, Any] = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    if xtc_probability > 0 and temp > 0:
        # XTC is an opaque sampler: still exact (the match strategy), but it accepts fewer drafts.
        specials = app.tokenizer.encode("\n", add_special_tokens=False) + list(app.tokenizer.eos_token_ids)
        sampling["sampler"] = make_sampler(temp, top_p, min_p, 1, top_k, xtc_probability, xtc_threshold, specials)

    num_draft = _integer(body, "num_draft_tokens", None, lo=0)
    if num_draft is not None:
        if num_draft + 1 > MAX_BLOCK_SIZE:
            raise RequestError(400, f"num_draft_tokens must be at most {MAX_BLOCK_SIZE - 1}", "num_draft_tokens")
        sampling["block_size"] = num_draft + 1

    penalties = {}
    for name, lo in (("repetition_penalty", 0), ("presence_penalty", None), ("frequency_penalty", None)):
        value = _number(body, name, 0.0, lo=lo)
        if value:
            penalties[name] = value
            context = name.split("_")[0] + "_context_size"
            penalties[context] = _integer(body, context, 20, lo=0)
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            bias = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError):
            raise RequestError(400, "logit_bias must map token ids to numbers", "logit_bias") from None
        if any(not 0 <= k < app.vocab_size for k in bias):
            raise RequestError(400, f"logit_bias token ids must be in [0, {app.vocab_size})", "logit_bias")
        penalties["logit_bias"] = bias
    if penalties:
        sampling["logits_processors"] = make_logits_processors(**penalties)

    prompt = _chat_prompt(body, app) if kind == "chat" else _text_prompt(body, app)
    if len(prompt) > app.max_prompt_tokens:
        raise RequestError(
            400,
            f"the prompt is {len(prompt)} tokens; this server takes at most {app.max_prompt_tokens} "
            "(--max-prompt-tokens)",
            "messages" if kind == "chat" else "prompt",
            "context_length_exceeded",
        )
    job = Job(prompt, max_tokens, sampling, _integer(body, "seed", None))
    return Request(kind, model, stream, options.get("include_usage", False), stop, job)


def _chat_prompt(body: dict, app: Any) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    clean = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, "each message needs a role and content", "messages")
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(400, "only text content parts are supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RequestError(400, "message content must be a string or text parts", "messages")
        clean.append({"role": m["role"], "content": content})
    kwargs = body.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise RequestError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    if app.tokenizer.chat_template is None:
        raise RequestError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        text = app.tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # a template can raise anything (e.g. on an unexpected role)
        raise RequestError(400, f"the chat template failed on these messages: {e}", "messages") from None
    # The template writes any special tokens itself, as mlx_lm.server's tokenized template does.
    return app.tokenizer.encode(text, add_special_tokens=False)


def _text_prompt(body: dict, app: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "prompt must be a non-empty string", "prompt")
    bos = app.tokenizer.bos_token
    return app.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


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


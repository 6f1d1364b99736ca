"""The wire format of ``dflash-mlx serve``: strict JSON, the table of request fields, the error shape.

Pure functions: no sockets, threads or MLX. Every field a client may send is
one row of ``FIELDS`` (type, default, range, what restricts it); anything else
is refused by name. All of it is checked before it reaches the tokenizer or
MLX: JSON literals (no NaN or Infinity), nesting depth, lone UTF-16 surrogates,
sizes, ranges. Failures are ``RequestError``: an HTTP status and OpenAI's
``{"error": {...}}`` body.

Chat templates come from the model folder or the operator (``--chat-template``),
never from a request: a Jinja sandbox blocks attribute tricks but bounds neither
CPU nor memory, and the template runs on the server's threads.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import DFlashError, one_line
from ..flags import INT64, mlx_seed

MAX_DEPTH = 32  # JSON nesting; tool schemas are the deepest part of a real request
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's limit
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
MAX_CONTEXT_SIZE = 2**20  # the penalties' *_context_size
ROLES = {"system", "developer", "user", "assistant", "tool"}


class RequestError(Exception):
    """A client error: the HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return error_body(str(self), self.status, self.param, self.code)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The one error shape every failure answers with (OpenAI's)."""
    kind = "not_found_error" if status == 404 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- JSON ---------------------------------------------------------------------


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a 64-bit float")
    return value


def decode_json(raw: bytes | str, what: str = "the request body", param: str | None = None) -> Any:
    """Strict JSON: finite numbers only, bounded nesting, valid Unicode in every string."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:
        raise RequestError(400, f"{what} is nested more than {MAX_DEPTH} levels deep", param) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, over-long integers
        raise RequestError(400, f"{what} is not valid JSON: {one_line(e)}", param) from None
    check_json(value, what)
    return value


def check_json(value: Any, what: str) -> None:
    """Refuse deep nesting and lone surrogates (JS clients cut inside emoji) anywhere in ``value``."""
    stack = [(value, 0, what)]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(400, f"{what} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict):
            for key, item in node.items():
                _check_text(key, path)
                stack.append((item, depth + 1, f"{path}.{key}" if path != what else key))
        elif isinstance(node, list):
            stack.extend((item, depth + 1, f"{path}[{i}]") for i, item in enumerate(node))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        field_name = path.split(".")[0].split("[")[0]
        raise RequestError(
            400, f"{path} holds a lone UTF-16 surrogate ({text[e.start]!r} at {e.start}): send valid Unicode",
            field_name if field_name in FIELDS else None,
        ) from None


# -- the field table ----------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One request field: its JSON type, default, range, and what restricts it.

    ``lo``/``hi`` bound numbers (and the length of lists); ``above`` makes the
    lower bound exclusive; ``tiny`` is the smallest positive value allowed (a
    smaller one underflows in float32). ``only`` lists the only values served,
    with ``why`` the others are refused. ``route`` limits a field to "chat" or
    "text" (where ``required`` makes it so); ``check`` converts or checks what
    the type alone cannot.
    """

    name: str
    type: type | tuple[type, ...]
    default: Any = None
    lo: float | None = None
    hi: float | None = None
    above: bool = False
    tiny: float | None = None
    only: tuple = ()
    why: str = ""
    route: str = ""
    required: bool = False
    check: Callable[[Any, "ServerInfo"], Any] | None = None


def stop_list(name: str) -> Callable[[Any, "ServerInfo"], list[str]]:
    """The check of a field holding stop strings (a string, or a list of them, where the API allows)."""

    def check(value: Any, info: "ServerInfo") -> list[str]:
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise RequestError(400, f"{name} must be a string or up to {MAX_STOPS} strings of 1-{MAX_STOP_CHARS} characters", name)
        return stops

    return check


def _stream_options(value: dict, info: "ServerInfo") -> dict:
    if set(value) - {"include_usage"} or not isinstance(value.get("include_usage", False), bool):
        raise RequestError(400, 'stream_options must be {"include_usage": true or false}', "stream_options")
    return value


def _logit_bias(value: dict, info: "ServerInfo") -> dict[int, float]:
    bias = {}
    for key, item in value.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= token < info.vocab_size:
            raise RequestError(400, f"logit_bias key {key!r} is not a token id in [0, {info.vocab_size})", "logit_bias")
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not -100 <= item <= 100:
            raise RequestError(400, f"logit_bias[{key!r}] must be a number in [-100, 100]", "logit_bias")
        bias[token] = float(item)
    return bias


def max_tokens_check(name: str) -> Callable[[int, "ServerInfo"], int]:
    """The check of a field bounding the generated tokens: no more than the model's context length."""

    def check(value: int, info: "ServerInfo") -> int:
        if info is not None and value > info.context_length:
            raise RequestError(400, f"{name} must be at most {info.context_length}, the model's context length", name)
        return value

    return check


def _num_draft_tokens(value: int, info: "ServerInfo") -> int:
    if value + 1 > info.max_block_size:
        raise RequestError(400, f"num_draft_tokens must be at most {info.max_block_size - 1}", "num_draft_tokens")
    return value


def _seed(value: int, info: "ServerInfo") -> int:
    return mlx_seed(value)  # -1 ("random" to many clients) is as good a seed as any other


def _template_kwargs(value: dict, info: "ServerInfo") -> dict:
    if "chat_template" in value:
        raise RequestError(
            400,
            "chat_template_kwargs.chat_template is refused: a template is code, and a Jinja sandbox bounds neither "
            "its CPU nor its memory; the operator sets one with dflash-mlx serve --chat-template",
            "chat_template_kwargs",
        )
    reserved = sorted(set(value) & TEMPLATE_ARGUMENTS)
    if reserved:
        message = f"chat_template_kwargs.{reserved[0]} is set by the server, not by a request"
        raise RequestError(400, message, "chat_template_kwargs")
    return value


# apply_chat_template's own parameters: a request may not override them through chat_template_kwargs.
TEMPLATE_ARGUMENTS = {
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
}
NUMBER = (int, float)
FIELDS = {f.name: f for f in [
    Field("model", str, "default_model"),
    Field("messages", list, lo=1, hi=MAX_MESSAGES, route="chat", required=True),
    Field("prompt", (str, list), route="text", required=True),
    Field("max_tokens", int, lo=1, check=max_tokens_check("max_tokens")),
    Field("max_completion_tokens", int, lo=1, check=max_tokens_check("max_completion_tokens")),
    Field("temperature", NUMBER, 0.0, lo=0, hi=100, tiny=1e-6),
    Field("top_p", NUMBER, 1.0, lo=0, hi=1, above=True, tiny=1e-30),
    Field("top_k", int, 0, lo=0),
    Field("min_p", NUMBER, 0.0, lo=0, hi=1),
    Field("xtc_probability", NUMBER, 0.0, lo=0, hi=1),
    Field("xtc_threshold", NUMBER, 0.1, lo=0, hi=0.5),
    Field("repetition_penalty", NUMBER, 0.0, lo=0, hi=10, tiny=1e-3),
    Field("repetition_context_size", int, 20, lo=0, hi=MAX_CONTEXT_SIZE),
    Field("presence_penalty", NUMBER, 0.0, lo=-2, hi=2),
    Field("presence_context_size", int, 20, lo=0, hi=MAX_CONTEXT_SIZE),
    Field("frequency_penalty", NUMBER, 0.0, lo=-2, hi=2),
    Field("frequency_context_size", int, 20, lo=0, hi=MAX_CONTEXT_SIZE),
    Field("logit_bias", dict, check=_logit_bias),
    Field("stop", (str, list), [], check=stop_list("stop")),
    Field("seed", int, None, lo=INT64[0], hi=INT64[1], check=_seed),
    Field("stream", bool, False),
    Field("stream_options", dict, {}, check=_stream_options),
    Field("n", int, 1, only=(1,), why="send one request per completion"),
    # A boolean for chat, the number of top log probabilities for text completions.
    Field("logprobs", (bool, int), False, only=(False, 0), why="log probabilities are not computed"),
    Field("top_logprobs", int, 0, only=(0, -1), why="log probabilities are not computed"),
    Field("num_draft_tokens", int, None, lo=0, check=_num_draft_tokens),
    Field("user", str),
    Field("tools", list, hi=MAX_TOOLS, route="chat"),
    Field("tool_choice", (str, dict), "auto", only=("auto",), why="the model decides whether to call a tool", route="chat"),
    Field("parallel_tool_calls", bool, True, only=(True,), why="the model decides how many calls it makes", route="chat"),
    Field("chat_template_kwargs", dict, {}, route="chat", check=_template_kwargs),
]}

# Fields of the API (or of mlx_lm.server) that this server refuses, with why.
UNSUPPORTED = {
    "functions": "the legacy functions API is not supported: send tools",
    "function_call": "the legacy functions API is not supported: send tools and tool_choice",
    "response_format": "structured output is not supported",
    "adapters": "adapters are not supported",
    "draft_model": "the drafter is fixed at start-up (--draft)",
    "role_mapping": "only the model's chat template is supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported",
}


def _type_name(t: type | tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    types = t if isinstance(t, tuple) else (t,)
    return "a number" if types == NUMBER else " or ".join(names[x] for x in types)


def _bounds(f: Field) -> str:
    if f.lo is None:
        return f"at most {f.hi}"
    if f.hi is None:
        return f"above {f.lo}" if f.above else f"at least {f.lo}"
    return f"in {'(' if f.above else '['}{f.lo}, {f.hi}]"


def check_field(f: Field, value: Any, info: "ServerInfo") -> Any:
    """One field's value checked against its row (``info`` may be None for command-line settings)."""
    types = f.type if isinstance(f.type, tuple) else (f.type,)
    # bool is an int in Python, not in JSON
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise RequestError(400, f"{f.name} must be {_type_name(f.type)}", f.name)
    if f.only and value not in f.only:
        raise RequestError(400, f"{f.name}={json.dumps(value)[:80]} is not supported: {f.why}", f.name)
    sized = isinstance(value, (list, dict, str))
    size = len(value) if sized else value
    if (f.lo is not None and (size < f.lo or (f.above and size == f.lo))) or (f.hi is not None and size > f.hi):
        raise RequestError(400, f"{f.name} must be {_bounds(f)}{' entries' if sized else ''}, got {size}", f.name)
    if f.tiny is not None and 0 < value < f.tiny:
        raise RequestError(400, f"{f.name}={value} is too small to compute in float32: use "
                                f"{'' if f.above else '0 or '}at least {f.tiny}", f.name)
    return f.check(value, info) if f.check else value


SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p"}


def check_flags(args: Any, flags: dict[str, str] = SAMPLING_FLAGS) -> None:
    """Command-line settings checked by the same rows as a request's fields (a ``DFlashError`` names the flag)."""
    for name, flag in flags.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        try:
            check_field(FIELDS[name], value, None)
        except RequestError as e:
            raise DFlashError(f"{flag} {value}: {e}") from None


def read_fields(body: Any, kind: str, info: "ServerInfo", table: dict[str, Field] = FIELDS,
                unsupported: dict[str, str] = UNSUPPORTED) -> dict[str, Any]:
    """Every field of ``body`` checked against ``table`` (OpenAI's completion fields unless given), with defaults
    filled in; a field in ``unsupported`` is refused with its reason, one in neither table by its name."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not given"
    for key in body:
        if key in unsupported:
            raise RequestError(400, f"unsupported parameter {key!r}: {unsupported[key]}", key)
        f = table.get(key)
        if f is None or f.route not in ("", kind):
            where = f" on /v1/{'chat/' if kind == 'chat' else ''}completions" if f else ""
            raise RequestError(400, f"unsupported parameter {key!r}{where}", key)
    values = {}
    for name, f in table.items():
        if f.route in ("", kind):
            if f.required and name not in body:
                raise RequestError(400, f"{name} is required", name)
            values[name] = check_field(f, body[name], info) if name in body else info.defaults.get(name, f.default)
    return values


@dataclass
class ServerInfo:
    """What request parsing needs from the loaded model and the operator's settings."""

    model_id: str
    tokenizer: Any  # mlx_lm TokenizerWrapper
    vocab_size: int
    max_prompt_tokens: int
    context_length: int  # the target's max_position_embeddings: no request generates more
    max_block_size: int
    max_tokens: int = 512  # the operator's default max_tokens
    defaults: dict[str, Any] = field(default_factory=dict)  # the operator's sampling defaults, by field name
    # Fast tokenizers raise "Already borrowed" when threads share one: tokenize one request at a time.
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model_names(self) -> set[str]:
        names = {self.model_id, "default_model"}
        path = Path(self.model_id)
        if path.exists():
            names |= {str(path.resolve()), path.name}
        return names

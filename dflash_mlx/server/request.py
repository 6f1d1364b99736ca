"""A completion request of ``dflash-mlx serve``, checked: messages, tools, the prompt, what to generate.

Pure functions over a body that ``protocol.read_fields`` has checked field by
field; the chat template runs here, on the request's thread, and is the model's
or the operator's, never the client's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import DFlashError, one_line
from .protocol import FIELDS, ROLES, RequestError, ServerInfo, decode_json, read_fields


def render_chat(tokenizer: Any, messages: list[dict], tools: list | None = None, **kwargs) -> str:
    """The chat template's text for ``messages``; a template that raises is a ``DFlashError``."""
    if not tokenizer.has_chat_template:
        raise DFlashError("this model has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # a template raises what it likes (TemplateError, TypeError, ...)
        given = f" with template arguments {', '.join(sorted(kwargs))}" if kwargs else ""
        raise DFlashError(f"the chat template failed on these messages{given} ({type(e).__name__}: {one_line(e)})") from None


def _text_parts(content: list, where: str) -> str:
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(400, f"{where}.content[{i}] is a {kind!r} part: only text parts are supported", "messages")
        if not isinstance(part.get("text"), str):
            raise RequestError(400, f"{where}.content[{i}].text must be a string", "messages")
        texts.append(part["text"])
    return "".join(texts)


def tool_arguments(arguments: Any, where: str, param: str) -> dict:
    """A tool call's arguments as an object: a JSON string is decoded (an empty one is ``{}``)."""
    if isinstance(arguments, str):
        arguments = decode_json(arguments or "{}", where, param)
    if not isinstance(arguments, dict):
        raise RequestError(400, f"{where} must be a JSON object", param)
    return arguments


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool calls, arguments as objects (what chat templates expect)."""
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", "messages")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f"{where}.tool_calls[{i}] needs a function with a name", "messages")
        arguments = tool_arguments(function.get("arguments", {}), f"{where}.tool_calls[{i}].function.arguments",
                                   "messages")
        out.append({**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def _messages(messages: list) -> list[dict]:
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise RequestError(400, f"{where} needs a role, one of {', '.join(sorted(ROLES))}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            content = _text_parts(content, where)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(400, f"{where}.content must be a string or a list of text parts", "messages")
        message = {"role": m["role"], "content": content}
        for key, value in m.items():
            if key in ("role", "content") or value in (None, "", [], {}):
                continue
            if key == "tool_calls" and m["role"] == "assistant":
                message[key] = _tool_calls(value, where)
            elif key in ("name", "tool_call_id", "reasoning", "reasoning_content") and isinstance(value, str):
                message[key] = value
            else:
                raise RequestError(400, f"{where}.{key} is not supported on a {m['role']} message", "messages")
        clean.append(message)
    return clean


def _tools(tools: list, tokenizer: Any) -> list[dict] | None:
    if not tools:
        return None
    if not tokenizer.has_tool_calling:
        raise RequestError(
            400, "this model's tokenizer has no tool-call format mlx_lm can parse: send the request without tools", "tools"
        )
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not isinstance(function.get("name"), str):
            raise RequestError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
        if not isinstance(function.get("parameters", {}), dict) or not isinstance(function.get("description", ""), str):
            raise RequestError(400, f"tools[{i}].function.parameters must be an object and description a string", "tools")
    return tools


def chat_prompt(messages: list, tools: list | None, template_kwargs: dict, info: ServerInfo,
                source: str = "chat_template_kwargs") -> list[int]:
    """OpenAI-shaped ``messages`` and ``tools`` (checked here) rendered by the chat template and tokenized;
    ``source`` names the request field that ``template_kwargs`` came from."""
    messages, tools = _messages(messages), _tools(tools, info.tokenizer)
    try:
        with info.lock:
            text = render_chat(info.tokenizer, messages, tools, **template_kwargs)
            # The template writes any special tokens itself, as mlx_lm.server's tokenized template does.
            return info.tokenizer.encode(text, add_special_tokens=False)
    except DFlashError as e:
        fix = ("use /v1/completions" if not info.tokenizer.has_chat_template else
               "check the roles and contents" + (f" and drop or fix {source}" if template_kwargs else ""))
        raise RequestError(400, f"{e}: {fix}", "messages") from None


def _text_prompt(values: dict, info: ServerInfo) -> list[int]:
    prompt = values["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "prompt must be a non-empty string", "prompt")
    bos = info.tokenizer.bos_token
    with info.lock:
        return info.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))


# -- the request --------------------------------------------------------------


@dataclass(frozen=True)
class GenerationParams:
    """What to generate, as plain data: the worker turns it into ``stream_generate`` arguments."""

    prompt: list[int]
    max_tokens: int
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logits: dict = field(default_factory=dict)  # mlx_lm make_logits_processors arguments, {} for none
    seed: int | None = None  # in MLX's range already
    block_size: int | None = None  # None: the server's --block-size


@dataclass
class Request:
    """A checked completion request: what to generate and how to answer."""

    kind: str  # "chat" or "text"
    model: str
    stream: bool
    include_usage: bool
    stop: list[str]
    tools: list[dict] | None
    initial_state: str  # where the reply's text starts: "normal", or "reasoning" inside a think block
    params: GenerationParams


def _logits_arguments(values: dict) -> dict:
    arguments = {}
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if values.get(name):
            context = name.split("_")[0] + "_context_size"
            arguments[name], arguments[context] = values[name], values[context]
    if values.get("logit_bias"):
        arguments["logit_bias"] = values["logit_bias"]
    return arguments


def _initial_state(prompt: list[int], tokenizer: Any) -> str:
    """As mlx_lm.server: a prompt that ends inside a think block makes the reply start reasoning."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        state = "reasoning"
    return tokenizer.response_initial_state or state


def check_model(name: str, info: ServerInfo) -> None:
    if name not in info.model_names:
        raise RequestError(404, f"model {name!r} not found: this server serves {info.model_id!r}", "model", "model_not_found")


def make_request(kind: str, values: dict, prompt: list[int], info: ServerInfo, *, where: str, stop: list[str],
                 tools: list[dict] | None = None, include_usage: bool = False, limit: str = "max_tokens") -> Request:
    """The internal request every API maps to: ``values`` holds the sampling fields by their OpenAI names
    (absent ones take the operator's defaults) and ``max_tokens``; ``where`` names the prompt's field in errors,
    ``limit`` the request's own name for ``max_tokens``. Prompt and answer must fit in the model's context
    length: an answer asked for past it is refused, as OpenAI's and Anthropic's APIs refuse it, and the
    operator's default is cut to the room left."""
    if not prompt:
        raise RequestError(400, "the prompt is empty after tokenization", where)
    if len(prompt) > info.max_prompt_tokens:
        raise RequestError(
            400,
            f"the prompt is {len(prompt)} tokens; this server takes at most {info.max_prompt_tokens} (--max-prompt-tokens)",
            where, "context_length_exceeded",
        )
    room = info.context_length - len(prompt)
    asked = values.get("max_tokens")
    if room < 1 or (asked is not None and asked > room):
        raise RequestError(
            400,
            f"the prompt is {len(prompt)} tokens and the model's context length {info.context_length}: "
            + (f"{limit}={asked} does not fit, ask for at most {room}" if room > 0 else "no room is left for an answer"),
            where if room < 1 else limit, "context_length_exceeded",
        )

    def value(name: str) -> Any:
        given = values.get(name)
        return given if given is not None else info.defaults.get(name, FIELDS[name].default)

    draft = values.get("num_draft_tokens")
    params = GenerationParams(
        prompt, asked or min(info.max_tokens, room), value("temperature"), value("top_p"), value("top_k"),
        value("min_p"), value("xtc_probability"), value("xtc_threshold"), _logits_arguments(values), values.get("seed"),
        None if draft is None else draft + 1,
    )
    state = _initial_state(prompt, info.tokenizer) if kind == "chat" else "normal"
    return Request(kind, values.get("model") or "default_model", bool(values.get("stream")), include_usage, stop, tools,
                   state, params)


def parse_request(body: Any, kind: str, info: ServerInfo) -> Request:
    """Check an OpenAI completion request body (parsed JSON) and tokenize its prompt; ``RequestError`` if it is bad."""
    values = read_fields(body, kind, info)
    check_model(values["model"], info)
    tools = None
    if kind == "chat":
        tools = values["tools"] or None
        prompt = chat_prompt(values["messages"], tools, values["chat_template_kwargs"], info)
    else:
        prompt = _text_prompt(values, info)
    limit = "max_tokens"
    if values["max_completion_tokens"] is not None:
        if values["max_tokens"] not in (None, values["max_completion_tokens"]):
            raise RequestError(400, "max_tokens and max_completion_tokens differ: send one of them", "max_tokens")
        values["max_tokens"], limit = values["max_completion_tokens"], "max_completion_tokens"
    include_usage = values["stream_options"].get("include_usage", False)
    return make_request(kind, values, prompt, info, where="messages" if kind == "chat" else "prompt",
                        stop=values["stop"], tools=tools, include_usage=include_usage, limit=limit)

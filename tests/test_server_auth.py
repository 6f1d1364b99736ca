"""Who may call dflash-mlx serve: --api-key (or DFLASH_MLX_API_KEY) on every route but /health, in each API's
error shape; and a first ``dflash-mlx serve`` with no --model/--draft serving the built-in pair."""

import http.client
import json

import pytest
from tiny import start_server

from dflash_mlx.errors import DFlashError
from dflash_mlx.server import close, resolve_api_key

KEY = "sk-local-test-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {"model": "default_model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
# (method, path, body, the API whose error shape answers)
ROUTES = [
    ("GET", "/v1/models", None, "openai"),
    ("GET", "/metrics", None, "openai"),
    ("POST", "/v1/chat/completions", CHAT, "openai"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, "openai"),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}, "openai"),
    ("GET", "/v1/responses/resp_none", None, "openai"),
    ("DELETE", "/v1/responses/resp_none", None, "openai"),
    ("POST", "/v1/messages", MESSAGES, "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"model": "default_model", "messages": MESSAGES["messages"]}, "anthropic"),
]


@pytest.fixture(scope="module")
def port(pair):
    server = start_server("--model", pair[0], "--draft", pair[1], "--api-key", KEY)
    yield server.server_address[1]
    server.shutdown()
    close(server)


def call(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, None if body is None else json.dumps(body), headers or {})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, raw, r


@pytest.mark.parametrize("method, path, body, api", ROUTES, ids=[f"{r[0]} {r[1]}" for r in ROUTES])
@pytest.mark.parametrize("given", [None, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]},
                                   {"Authorization": KEY}], ids=["none", "wrong-bearer", "wrong-x-api-key", "no-scheme"])
def test_every_route_needs_the_key(port, method, path, body, api, given):
    status, raw, r = call(port, method, path, body, given)
    assert status == 401 and r.getheader("WWW-Authenticate") == "Bearer"
    error = json.loads(raw)
    if api == "anthropic":
        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    else:
        assert error["error"]["type"] == "invalid_request_error" and "--api-key" in error["error"]["message"]


@pytest.mark.parametrize("method, path, body, api", ROUTES, ids=[f"{r[0]} {r[1]}" for r in ROUTES])
@pytest.mark.parametrize("header", ["Authorization", "x-api-key"])
def test_the_key_opens_every_route(port, method, path, body, api, header):
    status, raw, _ = call(port, method, path, body, {header: f"Bearer {KEY}" if header == "Authorization" else KEY})
    assert status == (404 if path.startswith("/v1/responses/") else 200), raw[:300]


def test_health_and_preflight_need_no_key(port):
    assert call(port, "GET", "/health")[:2] == (200, b'{"status": "ok"}')
    status, _, r = call(port, "OPTIONS", "/v1/messages", headers={
        "Origin": "http://editor.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-api-key, content-type"})
    assert status == 200 and r.getheader("Access-Control-Allow-Headers") == "x-api-key, content-type"
    status, _, r = call(port, "GET", "/v1/models", headers={"Origin": "http://editor.example"})
    assert status == 401 and r.getheader("Access-Control-Allow-Origin") == "*"  # a browser can read the refusal


def test_clients_with_and_without_the_key(port):
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    base = f"http://127.0.0.1:{port}"
    assert anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0).messages.create(**MESSAGES).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="nope", max_retries=0).messages.create(**MESSAGES)
    assert openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="default_model", **CHAT).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).responses.create(
            model="default_model", input="hi")


def test_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
    monkeypatch.setenv("DFLASH_MLX_API_KEY", "")
    assert resolve_api_key(None) is None
    for bad in ("", " padded ", "caf\u00e9", "new\nline"):
        with pytest.raises(DFlashError, match="printable ASCII"):
            resolve_api_key(bad)


def test_serve_without_model_flags_serves_the_built_in_pair(pair, monkeypatch):
    import dflash_mlx.default

    monkeypatch.setattr(dflash_mlx.default, "default_pair", lambda: tuple(pair))  # the tiny pair stands in for it
    server = start_server()
    try:
        status, raw, _ = call(server.server_address[1], "GET", "/v1/models")
        assert status == 200 and json.loads(raw)["data"][0]["id"] == pair[0]
    finally:
        server.shutdown()
        close(server)
    with pytest.raises(DFlashError, match="pass both --model and --draft"):
        start_server("--model", pair[0])

"""A web page reading through memproxy on the operator's key (issue 37, items 1 and 2).

Item 1: an upstream that answers CORS (vLLM and LiteLLM do) made every relayed answer
readable by any page: memproxy relays no `access-control-*` header on any path (chats of
every format, streamed or not, errors, the pass-through), and refuses a read from a page
of another origin of anything under /v1 or /mcp, GETs included.
Item 2: with only an admin key set, keyless chats are still served, so the Host check
(DNS rebinding) stays on; only a configuration where every request needs a proxy key
opens every name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support import formats
from tests.support.memory import QUIET, Starter, assert_error
from tests.support.scripted_upstream import (
    ErrorReply,
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)

CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Credentials": "true",
    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
    "Access-Control-Allow-Headers": "*",
    "Access-Control-Expose-Headers": "x-request-id",
    "Access-Control-Max-Age": "86400",
    "Timing-Allow-Origin": "*",
}
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}


def cors_upstream(req: Received) -> Reply:
    """Every answer carries CORS headers, as a vLLM or LiteLLM upstream's do."""
    body = req.json if isinstance(req.json, dict) else {}
    if req.path == "/v1/chat/completions" and req.method == "POST":
        if body.get("stream"):
            return SSEReply(chat_chunks("hi there"), headers=CORS)
        return JSONReply(chat_completion("hi there"), headers=CORS)
    if req.path == "/v1/responses" and req.method == "POST":
        return JSONReply(formats.response_object("hi there"), headers=CORS)
    if req.path == "/v1/messages":
        return JSONReply(formats.message_object("hi there"), headers=CORS)
    if req.path.endswith("/missing"):
        return ErrorReply(404, "no such object", headers=CORS)
    return JSONReply({"object": "list", "data": [{"id": "chatcmpl-1", "memory": "block"}]},
                     headers=CORS)


# Every way a relayed answer comes back: (method, path, body).
RELAYED: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/responses", {"model": "gpt-4o-mini", "input": "hello"}),
    ("POST", "/v1/messages", {**CHAT, "max_tokens": 10}),
    ("GET", "/v1/chat/completions", None),
    ("GET", "/v1/chat/completions/chatcmpl-1/messages", None),
    ("GET", "/v1/files", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/files/missing", None),
    ("OPTIONS", "/v1/chat/completions", None),
]


@pytest.fixture
def keyless(start_proxy: Starter, upstream: ScriptedUpstream) -> RunningProxy:
    """No proxy keys, the operator's upstream key, memory on: the issue's setup."""
    upstream.respond_with(cors_upstream)
    return start_proxy(memory=True, upstream_api_key="sk-operator", **QUIET)


@pytest.fixture
def http(keyless: RunningProxy) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyless.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("method", "path", "body"), RELAYED,
                         ids=[f"{m} {p}{' stream' if b and b.get('stream') else ''}"
                              for m, p, b in RELAYED])
def test_no_cors_header_is_relayed_on_any_path(
    http: httpx.Client, upstream: ScriptedUpstream, method: str, path: str,
    body: dict[str, Any] | None,
) -> None:
    response = http.request(method, path, json=body)
    assert upstream.history, "the request reached the upstream"
    assert response.status_code < 500, response.text
    leaked = [name for name in response.headers
              if name.lower().startswith("access-control-") or name.lower() == "timing-allow-origin"]
    assert leaked == [], (response.status_code, dict(response.headers))


# Reads a page can make: what the operator's key pays for, or what holds memory.
READS = ["/v1/chat/completions", "/v1/chat/completions/chatcmpl-1/messages", "/v1/files",
         "/v1/models", "/v1/responses/resp_1/input_items", "/v1/memory/facts",
         "/v1/memory/export", "/v1/memory/stats", "/mcp"]
# How a browser marks a request from another page (and the spellings that must mean it too).
CROSS_ORIGIN: list[dict[str, str]] = [
    {"Origin": "http://evil.example"},
    {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"},
    {"Origin": "null", "Sec-Fetch-Mode": "cors"},
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"},
    {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors"},
    {"Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Site": "garbage"},
    {"Origin": "http://localhost:1", "Sec-Fetch-Site": "same-site"},
]


@pytest.mark.parametrize("path", READS)
def test_a_read_from_another_origin_is_refused(
    keyless: RunningProxy, http: httpx.Client, upstream: ScriptedUpstream, path: str,
) -> None:
    for method in ("GET", "HEAD", "OPTIONS"):
        for headers in CROSS_ORIGIN:
            response = http.request(method, path, headers=headers)
            assert response.status_code == 403, (method, headers, response.text)
            if method == "GET":
                assert assert_error(response, 403)["code"] == "cross_origin_request"
            assert not any(name.startswith("access-control-") for name in response.headers)
    assert upstream.history == []


def test_own_pages_typed_urls_and_clients_still_read(
    keyless: RunningProxy, http: httpx.Client, upstream: ScriptedUpstream,
) -> None:
    own = f"127.0.0.1:{keyless.port}"
    for headers in (
        {},  # an SDK, curl
        {"Sec-Fetch-Mode": "cors"},  # Node's fetch (openai-node, the MCP TypeScript SDK)
        {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"},  # the panel's fetch
        {"Origin": f"http://{own}", "Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"},
        {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"},  # a URL typed in
    ):
        for path in ("/v1/models", "/v1/memory/facts", "/v1/chat/completions"):
            assert http.get(path, headers=headers).status_code == 200, (path, headers)
    # Liveness, and the panel's own files, stay public.
    for path in ("/healthz", "/ui/"):
        response = http.get(path, headers={"Origin": "http://evil.example",
                                           "Sec-Fetch-Site": "cross-site"})
        assert response.status_code == 200, path


def rebound(port: int, name: str) -> dict[str, str]:
    """A page at `name`, which DNS now points at 127.0.0.1: same-origin with itself."""
    return {"Host": f"{name}:{port}", "Origin": f"http://{name}:{port}",
            "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json"}


@pytest.mark.parametrize("keys", [{"admin_key": "admin-key-000001"}, {}])
def test_an_admin_key_alone_keeps_the_host_check(
    start_proxy: Starter, upstream: ScriptedUpstream, keys: dict[str, str],
) -> None:
    proxy = start_proxy(memory=True, upstream_api_key="sk-operator", **keys, **QUIET)
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        for name in ("attacker.example", "rebind.attacker.example.", "ATTACKER.example"):
            headers = rebound(proxy.port, name)
            for method, path, body in (("POST", "/v1/chat/completions", CHAT),
                                       ("GET", "/v1/files", None), ("GET", "/v1/models", None),
                                       ("POST", "/v1/responses", {"model": "m", "input": "x"})):
                response = http.request(method, path, content=json.dumps(body) if body else None,
                                        headers=headers)
                assert assert_error(response, 400, "Host")["code"] == "host_not_allowed"
        assert upstream.history == []
        # The operator's own names still work.
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("keys", [{"api_keys": "edge-key-0003"}, {"auth": "keys"}])
def test_where_every_request_needs_a_key_any_name_is_served(
    start_proxy: Starter, upstream: ScriptedUpstream, keys: dict[str, str],
) -> None:
    proxy = start_proxy(memory=True, upstream_api_key="sk-operator", **keys, **QUIET)
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        # The rebound page has no key: 401 under any name, never the upstream.
        response = http.post("/v1/chat/completions", json=CHAT, headers={"Host": "lb.example"})
        assert_error(response, 401)
    assert upstream.history == []

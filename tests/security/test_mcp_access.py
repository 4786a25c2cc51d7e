"""/mcp under attack: identity comes from the key and the X-Memory-* headers only, through
proxy/access/decision.py's `decide`, exactly as on /v1/memory. A prompt that writes tool arguments
(or `_meta`) cannot name another user or organisation; another user's ids are not found; a
remote client without keys is refused; the rate limit counts tool calls. The app runs
in-process through httpx's ASGI transport so a remote address can be set, answering JSON
and SSE, in both protocol eras (the 2025-11-25 handshake era, 2026-07-28 per request)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from config import Settings
from memory.index.embeddings import LocalEmbedder
from proxy.app import create_app
from proxy.mcp.schemas import PROFILE_URI
from tests.support.memory import QUIET

LOOPBACK, REMOTE = "127.0.0.1", "203.0.113.9"
KEYS = ",".join([
    "key-alice-000001:alice:org=acme",
    "key-bob-0000001:bob:org=acme",
    "key-acme-reader1:org=acme",
    "key-carol-000001:carol:org=globex",
])
ALICE, BOB, CAROL = "key-alice-000001", "key-bob-0000001", "key-carol-000001"
SECRET = "Alice's locker code is 4417."
ERAS = [
    {"MCP-Protocol-Version": "2025-11-25"},
    {"MCP-Protocol-Version": "2026-07-28"},
]
ACCEPTS = ["application/json", "application/json, text/event-stream"]


@asynccontextmanager
async def running(settings: Settings, embedder: LocalEmbedder) -> AsyncIterator[Starlette]:
    app = create_app(settings, with_memory=True, embedder=embedder)
    async with app.router.lifespan_context(app):
        yield app


def mcp_client(app: Starlette, host: str = LOOPBACK, key: str | None = None,
               **headers: str) -> httpx.AsyncClient:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    transport = httpx.ASGITransport(app=app, client=(host, 50000))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080",
                             headers={"Content-Type": "application/json", **headers}, timeout=60)


def envelope(era: dict[str, str], method: str, params: dict[str, Any]) -> dict[str, Any]:
    """A JSON-RPC request of `era` (2026-07-28 carries its envelope in `_meta`)."""
    if era["MCP-Protocol-Version"] == "2026-07-28":
        meta = dict(params.get("_meta", {}))
        meta.update({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                     "io.modelcontextprotocol/clientCapabilities": {},
                     "io.modelcontextprotocol/clientInfo": {"name": "attacker", "version": "1"}})
        params = {**params, "_meta": meta}
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


async def call_tool(http: httpx.AsyncClient, era: dict[str, str], accept: str, name: str,
                    arguments: dict[str, Any], meta: dict[str, Any] | None = None,
                    **headers: str) -> dict[str, Any]:
    """The JSON-RPC answer to one tools/call (from JSON or from the SSE event)."""
    params: dict[str, Any] = {"name": name, "arguments": arguments}
    if meta:
        params["_meta"] = meta
    extra = {"Mcp-Method": "tools/call", "Mcp-Name": name} if "2026" in era["MCP-Protocol-Version"] else {}
    response = await http.post("/mcp", content=json.dumps(envelope(era, "tools/call", params)),
                               headers={**era, **extra, "Accept": accept, **headers})
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        data = [line[5:] for line in response.text.splitlines() if line.startswith("data:")]
        answer: dict[str, Any] = json.loads(data[-1])
        return answer
    answer = response.json()
    return answer


def facts(result: dict[str, Any]) -> list[str]:
    return [item["text"] for item in result["result"]["structuredContent"]["items"]]


FORGED_ARGUMENTS: list[dict[str, Any]] = [
    {"user_id": "bob"}, {"user": "bob"}, {"X-Memory-User-Id": "bob"}, {"org_id": "globex"},
    {"metadata": {"user_id": "bob"}}, {"safety_identifier": "bob"},
]


@pytest.mark.both_backends
@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("accept", ACCEPTS)
async def test_identity_in_tool_arguments_or_meta_is_never_used(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder, era: dict[str, str],
    accept: str,
) -> None:
    settings = make_settings(api_keys=KEYS, **QUIET)
    async with running(settings, embedder) as app, mcp_client(app, key=ALICE) as alice:
        for forged in FORGED_ARGUMENTS:
            answer = await call_tool(alice, era, accept, "add_memory", {"text": SECRET, **forged})
            assert answer["result"]["isError"] is True, forged
        # `_meta` is the client's to fill too: it names nobody.
        meta = {"user_id": "bob", "X-Memory-User-Id": "bob", "org_id": "globex"}
        stored = await call_tool(alice, era, accept, "add_memory", {"text": SECRET}, meta)
        assert stored["result"]["isError"] is False
        listed = await call_tool(alice, era, accept, "list_memories", {}, meta)
        assert facts(listed) == [SECRET]
        async with mcp_client(app, key=BOB) as bob:
            for arguments in ({}, {"shared": True}):
                assert SECRET not in facts(await call_tool(bob, era, accept, "list_memories", arguments))
            found = await call_tool(bob, era, accept, "search_memory", {"query": "locker code"},
                                    {"user_id": "alice"})
            assert "4417" not in found["result"]["structuredContent"]["block"]
            fact_id = listed["result"]["structuredContent"]["items"][0]["id"]
            refused = await call_tool(bob, era, accept, "delete_memory", {"id": fact_id})
            assert refused["result"]["isError"] is True
        assert facts(await call_tool(alice, era, accept, "list_memories", {})) == [SECRET]


async def test_headers_cannot_move_a_bound_key_to_another_memory(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> None:
    settings = make_settings(api_keys=KEYS, **QUIET)
    era = ERAS[0]
    body = json.dumps(envelope(era, "tools/call", {"name": "list_memories", "arguments": {}}))
    async with running(settings, embedder) as app:
        for key, headers in [
            (ALICE, {"X-Memory-User-Id": "bob"}),
            (ALICE, {"X-Memory-Org-Id": "globex"}),
            (CAROL, {"X-Memory-Org-Id": "acme"}),
            ("key-acme-reader1", {"X-Memory-User-Id": "carol"}),  # not an acme member
        ]:
            async with mcp_client(app, key=key, **headers) as http:
                refused = await http.post("/mcp", content=body,
                                          headers={**era, "Accept": "application/json"})
                assert refused.status_code == 403, (key, headers)
        async with mcp_client(app, key="key-wrong-00001") as http:
            wrong = await http.post("/mcp", content=body, headers={**era, "Accept": "application/json"})
            assert wrong.status_code == 401


async def test_without_keys_only_loopback_reaches_memory_unless_opened(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> None:
    era = ERAS[0]
    for remote_allowed, status in ((False, 403), (True, 200)):
        settings = make_settings(management_remote=remote_allowed, **QUIET)
        async with running(settings, embedder) as app:
            for accept in ACCEPTS:
                async with mcp_client(app, REMOTE, **{"X-Memory-User-Id": "victim"}) as remote:
                    body = json.dumps(envelope(era, "tools/call", {
                        "name": "add_memory", "arguments": {"text": SECRET}}))
                    answer = await remote.post("/mcp", content=body, headers={**era, "Accept": accept})
                    assert answer.status_code == status
            async with mcp_client(app, LOOPBACK, **{"X-Memory-User-Id": "victim"}) as local:
                listed = await call_tool(local, era, "application/json", "list_memories", {})
                # Both adds (one per answer format) land; the second merges into the first.
                assert facts(listed) == ([SECRET] if remote_allowed else [])


async def test_tool_calls_count_against_the_keys_rate_limit(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> None:
    settings = make_settings(api_keys=KEYS, rate_limit=2, **QUIET)
    era = ERAS[0]
    async with running(settings, embedder) as app, mcp_client(app, key=ALICE) as alice:
        for _ in range(2):
            ok = await call_tool(alice, era, "application/json", "read_profile", {})
            assert ok["result"]["isError"] is False
        limited = await alice.post("/mcp", content=json.dumps(envelope(
            era, "tools/call", {"name": "add_memory", "arguments": {"text": SECRET}})),
            headers={**era, "Accept": "application/json"})
        assert limited.status_code == 429 and "rate" in limited.json()["error"]["message"]
        # The same bucket as the key's memory API and chat requests.
        api = await alice.get("/v1/memory/facts")
        assert api.status_code == 429


MCP_METHODS: list[tuple[str, dict[str, Any]]] = [
    ("resources/read", {"uri": PROFILE_URI}),
    ("resources/list", {}),
    ("resources/templates/list", {}),
    ("tools/list", {}),
]


@pytest.mark.parametrize(("method", "params"), MCP_METHODS)
async def test_every_mcp_method_counts_against_the_rate_limit(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder, method: str,
    params: dict[str, Any],
) -> None:
    """Issue 37, item 10: a resource read (or any message) is a request like a tool call:
    past the key's rate it is 429, before the SDK or the database sees it."""
    settings = make_settings(api_keys=KEYS, rate_limit=3, **QUIET)
    era = ERAS[1]
    extra = {"Mcp-Method": method}
    if method == "resources/read":
        extra["Mcp-Name"] = PROFILE_URI
    body = json.dumps(envelope(era, method, params))
    async with running(settings, embedder) as app, mcp_client(app, key=ALICE) as alice:
        statuses = []
        for _ in range(5):
            answer = await alice.post("/mcp", content=body,
                                      headers={**era, **extra, "Accept": "application/json"})
            statuses.append(answer.status_code)
            if answer.status_code == 200:
                assert "error" not in answer.json(), answer.text
        assert statuses == [200, 200, 200, 429, 429]
        refused = await alice.post("/mcp", content=body,
                                   headers={**era, **extra, "Accept": "application/json"})
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1


async def test_a_cross_origin_write_to_mcp_is_refused(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> None:
    settings = make_settings(**QUIET)
    era = ERAS[0]
    body = json.dumps(envelope(era, "tools/call", {"name": "add_memory", "arguments": {"text": SECRET}}))
    async with running(settings, embedder) as app, mcp_client(app) as local:
        for headers, status in (
            ({"Origin": "https://evil.example"}, 403), ({"Sec-Fetch-Site": "cross-site"}, 403),
            ({"Host": "evil.example:8080"}, 400), ({"Content-Type": "text/plain"}, 415),
        ):
            answer = await local.post("/mcp", content=body,
                                      headers={**era, "Accept": "application/json", **headers})
            assert answer.status_code == status, headers
        listed = await call_tool(local, era, "application/json", "list_memories", {})
        assert facts(listed) == []


@pytest.mark.both_backends
async def test_an_undo_token_restores_only_its_owner_s_memory(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> None:
    """A deletion's undo token is a capability of its owner: another user, a key of another
    organisation or a forged `_meta` identity gets "no deletion", and nothing comes back."""
    settings = make_settings(api_keys=KEYS, **QUIET)
    era, accept = ERAS[0], ACCEPTS[0]
    async with running(settings, embedder) as app, mcp_client(app, key=ALICE) as alice:
        await call_tool(alice, era, accept, "add_memory", {"text": SECRET})
        fact_id = (await call_tool(alice, era, accept, "list_memories", {}))[
            "result"]["structuredContent"]["items"][0]["id"]
        deleted = await call_tool(alice, era, accept, "delete_memory", {"id": fact_id})
        token = deleted["result"]["structuredContent"]["undo_token"]
        for key, headers in [(BOB, {}), (CAROL, {}), ("key-acme-reader1", {"X-Memory-User-Id": "bob"})]:
            async with mcp_client(app, key=key, **headers) as other:
                for arguments, meta in [({"undo_token": token}, None),
                                        ({"undo_token": token}, {"user_id": "alice"})]:
                    refused = await call_tool(other, era, accept, "undo_delete", arguments, meta)
                    assert refused["result"]["isError"] is True
                    assert "no deletion" in refused["result"]["content"][0]["text"]
                forged = await call_tool(other, era, accept, "undo_delete",
                                         {"undo_token": token, "user_id": "alice"})
                assert forged["result"]["isError"] is True
                assert SECRET not in facts(await call_tool(other, era, accept, "list_memories", {}))
        assert facts(await call_tool(alice, era, accept, "list_memories", {})) == []
        undone = await call_tool(alice, era, accept, "undo_delete", {"undo_token": token})
        assert undone["result"]["structuredContent"] == {"restored": True, "added": {"facts": 1}}
        assert facts(await call_tool(alice, era, accept, "list_memories", {})) == [SECRET]

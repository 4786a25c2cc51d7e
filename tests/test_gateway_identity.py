"""X-Memory* headers, identity resolution and authentication."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningProxy
from tests.support.scripted_upstream import ScriptedUpstream

BODY = {"model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]}


def dry_run(client: httpx.Client, body: dict[str, Any] = BODY, /, **headers: str) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body, headers={"X-Memory-Dry-Run": "on", **headers})


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Memory", "maybe"),
        ("X-Memory-Read", "1"),
        ("X-Memory-Write", "yes"),
        ("X-Memory-Budget", "-1"),
        ("X-Memory-Budget", "lots"),
        ("X-Memory-Budget", "100001"),
        ("X-Memory-Scope", "planet"),
        ("X-Memory-Placement", "middle"),
        ("X-Memory-Dry-Run", "sure"),
        ("X-Memory-User-Id", "bad\xa0id"),
        ("X-Memory-Session-Id", "x" * 300),
        ("X-Memory-User-Id", "tab\there"),
    ],
)
def test_invalid_header_values_are_400_naming_the_header(
    client: httpx.Client, upstream: ScriptedUpstream, header: str, value: str
) -> None:
    raw = {header.encode(): value.encode("latin-1")}  # bytes: httpx would refuse non-ASCII text
    response = client.post("/v1/chat/completions", json=BODY, headers=raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == header and header in error["message"]
    assert upstream.history == []


def test_valid_headers_are_parsed(client: httpx.Client, upstream: ScriptedUpstream) -> None:
    response = dry_run(client, **{
        "X-Memory-Budget": "250", "X-Memory-Scope": "SESSION", "X-Memory-Placement": "last_user",
        "X-Memory-User-Id": "alice", "X-Memory-Session-Id": "chat-1",
    })
    assert response.status_code == 200
    result = response.json()
    assert (result["budget"], result["placement"]) == (250, "last_user")
    assert (result["user_id"], result["session_id"]) == ("alice", "chat-1")
    assert response.headers["x-memory-session-id"] == "chat-1"
    assert upstream.history == []  # a dry run never calls the upstream


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"user": "u-body", "metadata": {"user_id": "u-meta"}, "safety_identifier": "u-safe"}, "u-body"),
        ({"metadata": {"user_id": "u-meta"}, "safety_identifier": "u-safe"}, "u-meta"),
        ({"safety_identifier": "u-safe"}, "u-safe"),
        ({}, "default"),
    ],
)
def test_user_resolution_order(client: httpx.Client, extra: dict[str, Any], expected: str) -> None:
    assert dry_run(client, {**BODY, **extra}).json()["user_id"] == expected
    assert dry_run(client, {**BODY, **extra}, **{"X-Memory-User-Id": "hdr"}).json()["user_id"] == "hdr"


def test_session_fingerprint_follows_the_conversation_start(client: httpx.Client) -> None:
    first = dry_run(client).json()["session_id"]
    longer = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "yo"},
                                   {"role": "user", "content": "more"}]}
    assert dry_run(client, longer).json()["session_id"] == first
    other_prompt = {**BODY, "messages": [{"role": "system", "content": "other"}, BODY["messages"][1]]}
    assert dry_run(client, other_prompt).json()["session_id"] != first
    assert dry_run(client, {**BODY, "user": "bob"}).json()["session_id"] != first


def test_byok_forwards_the_client_key(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-users-own", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    client.models.list()
    assert [r.headers["authorization"] for r in upstream.history] == ["Bearer sk-users-own"] * 2


def test_configured_upstream_key_replaces_the_client_key(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(upstream_api_key="sk-operator")
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-users-own", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert upstream.history[-1].headers["authorization"] == "Bearer sk-operator"


def test_proxy_keys(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> None:
    proxy = start_proxy(api_keys="team-key-0001,alice-key-001:alice", upstream_api_key="sk-operator")
    messages = [{"role": "user", "content": "x"}]
    missing = httpx.post(f"{proxy.base_url}/chat/completions", json={"model": "m", "messages": messages})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    for key in ("wrong-key-123", "team-key-0001x"):
        bad = openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert upstream.history == []
    team = openai.OpenAI(base_url=proxy.base_url, api_key="team-key-0001", max_retries=0)
    team.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
    team.models.list()
    assert all(r.headers["authorization"] == "Bearer sk-operator" for r in upstream.history)
    http = httpx.Client(base_url=proxy.url)
    bound = {"authorization": "Bearer alice-key-001"}
    assert dry_run(http, {**BODY, "user": "mallory"}, **bound).json()["user_id"] == "alice"
    forbidden = dry_run(http, **bound, **{"X-Memory-User-Id": "bob"})
    assert forbidden.status_code == 403 and forbidden.json()["error"]["param"] == "X-Memory-User-Id"
    assert dry_run(http, **{"authorization": "Bearer team-key-0001", "X-Memory-User-Id": "bob"}).json()[
        "user_id"] == "bob"
    http.close()


def test_health_ready_and_metrics(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ok"
    client.post("/v1/chat/completions", json=BODY)
    text = client.get("/metrics").text
    assert 'memproxy_requests_total{route="chat",status="200"}' in text
    assert "memproxy_request_seconds_bucket" in text and "memproxy_inflight_streams" in text


def test_logs_are_json_lines_without_keys_or_content(
    start_proxy: Callable[..., RunningProxy], capfd: pytest.CaptureFixture[str]
) -> None:
    import json

    proxy = start_proxy(log_level="info", api_keys="proxy-key-SECRET-1:alice")
    httpx.post(f"{proxy.base_url}/chat/completions", headers={"authorization": "Bearer proxy-key-SECRET-1"},
               json={"model": "m", "messages": [{"role": "user", "content": "my pin is 9931-TOPSECRET"}]})
    proxy.stop()
    err = capfd.readouterr().err
    assert "SECRET" not in err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    chat = [line for line in lines if line["msg"] == "chat"]
    assert chat and chat[0]["status"] == 200 and chat[0]["user_id"] == "alice"
    assert chat[0]["model"] == "m" and chat[0]["level"] == "info"


def test_upstream_cookies_never_reach_another_request(
    proxy: RunningProxy, upstream: ScriptedUpstream, client: httpx.Client
) -> None:
    from tests.support.scripted_upstream import JSONReply, chat_completion

    upstream.enqueue(JSONReply(chat_completion("hi"), headers={"set-cookie": "__cf_bm=alice; Path=/"}))
    first = client.post("/v1/chat/completions", json=BODY, headers={"X-Memory-User-Id": "alice"})
    assert first.headers["set-cookie"].startswith("__cf_bm=alice")  # relayed to its own client
    client.cookies.clear()
    client.post("/v1/chat/completions", json=BODY, headers={"X-Memory-User-Id": "bob"})
    assert "cookie" not in upstream.history[-1].headers

"""Only an exchange that completed is remembered (docs/api-formats.md, "Errors and retries").

A request the upstream refused (its 4xx/5xx), never answered (connection refused), or
answered with something that is not a reply leaves no turn, in every API format, streamed
or not, through litellm and in memory-tool mode: a later chat must not recall a question that
never got an answer, and the client's retry, which resends it, stores it exactly once. A
stream cut midway keeps its user turn (tests/test_faults_upstream.py).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from config import Route
from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import (
    ErrorReply,
    JSONReply,
    RawReply,
    ScriptedUpstream,
    chat_completion,
)
from tests.support.sql import query
from tests.test_memory_tool import SEARCH

pytestmark = pytest.mark.both_backends

CLAUDE = "claude-scripted-1"
# Each format's request: its path and body, for one user message.
FORMATS: dict[str, tuple[str, Callable[[str, bool], dict[str, Any]]]] = {
    "chat": ("/v1/chat/completions", lambda text, stream: {
        "model": "gpt-4o-mini", "stream": stream, "messages": [{"role": "user", "content": text}]}),
    "responses": ("/v1/responses", lambda text, stream: {
        "model": "gpt-4o-mini", "stream": stream, "input": text}),
    "messages": ("/v1/messages", lambda text, stream: {
        "model": CLAUDE, "stream": stream, "max_tokens": 100,
        "messages": [{"role": "user", "content": text}]}),
}
MODES = (False, True)  # streamed or not


def send(proxy: RunningProxy, fmt: str, user: str, text: str, *, stream: bool,
         headers: dict[str, str] | None = None) -> httpx.Response:
    """One request of `fmt` from `user`, read to its end."""
    path, body = FORMATS[fmt]
    with httpx.Client(timeout=60) as client:
        response = client.post(
            f"{proxy.url}{path}", json=body(text, stream),
            headers={"X-Memory-User-Id": user, "Authorization": "Bearer sk-test",
                     "x-api-key": "sk-ant-test", **(headers or {})},
        )
        response.read()
        return response


def turns(proxy: RunningProxy, user: str) -> list[tuple[str, str]]:
    """(role, content) of the user's stored turns, once the requests' work is done."""
    wait_for_jobs(proxy)
    rows = query(proxy.state.settings,
                 "SELECT role, content FROM turns WHERE user_id = ? ORDER BY id", (user,))
    return [(str(role), str(content)) for role, content in rows]


def fresh(fmt: str, stream: bool) -> tuple[str, str]:
    """A new user and the question it asks."""
    code = uuid.uuid4().hex[:8]
    return f"u-{fmt}-{int(stream)}-{code}", f"Where do I live? My locker code is {code}."


def closed_origin() -> str:
    """A loopback address nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def origin(upstream: ScriptedUpstream) -> str:
    return upstream.base_url.removesuffix("/v1")


def test_an_upstream_error_status_stores_nothing_and_the_retry_stores_once(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, anthropic_base_url=origin(upstream))
    for fmt in FORMATS:
        for stream, status in zip(MODES, (500, 400), strict=True):
            user, question = fresh(fmt, stream)
            upstream.enqueue(ErrorReply(status, "the model is down"))
            failed = send(proxy, fmt, user, question, stream=stream)
            assert failed.status_code == status, (fmt, stream, failed.text)
            assert turns(proxy, user) == [], (fmt, stream)
            retried = send(proxy, fmt, user, question, stream=stream)  # the client resends it
            assert retried.status_code == 200, (fmt, stream, retried.text)
            stored = turns(proxy, user)
            assert [role for role, _ in stored] == ["user", "assistant"], (fmt, stream, stored)
            assert stored[0][1] == question


def test_an_unreachable_upstream_stores_nothing(start_proxy: Callable[..., RunningProxy]) -> None:
    down = closed_origin()
    proxy = start_proxy(memory=True, upstream_base_url=f"{down}/v1", anthropic_base_url=down)
    for fmt in FORMATS:
        for stream in MODES:
            user, question = fresh(fmt, stream)
            answer = send(proxy, fmt, user, question, stream=stream)
            assert answer.status_code == 502, (fmt, stream, answer.text)
            assert turns(proxy, user) == [], (fmt, stream)


def test_a_body_that_is_not_a_reply_stores_nothing(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True)
    user, question = fresh("chat", False)
    upstream.enqueue(RawReply(b'{"id": "chatcmpl-1", "choices": [', content_type="application/json"))
    assert send(proxy, "chat", user, question, stream=False).status_code == 502
    assert turns(proxy, user) == []


def test_a_later_chat_does_not_recall_the_unanswered_question(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True)
    user = f"u-{uuid.uuid4().hex[:8]}"
    upstream.enqueue(ErrorReply(502, "upstream unreachable"))
    question = "Where do I live? I keep forgetting the name of my town by the river."
    assert send(proxy, "chat", user, question, stream=False).status_code == 502
    wait_for_jobs(proxy)
    later = send(proxy, "chat", user, "Which town by the river do I live in, do you remember?",
                 stream=False, headers={"X-Memory-Dry-Run": "on", "X-Memory-Session-Id": "later"})
    assert later.status_code == 200, later.text
    assert "Where do I live" not in orjson.loads(later.content)["block"]


def test_a_litellm_route_that_fails_stores_nothing(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, routes=(
        Route("via-litellm-*", base_url=upstream.base_url, api_key="sk-route", provider="openai"),
    ))
    for stream in MODES:
        user, question = fresh("litellm", stream)
        upstream.enqueue(*[ErrorReply(500, "the model is down")] * 5)  # litellm may retry
        with httpx.Client(timeout=60) as client:
            answer = client.post(f"{proxy.base_url}/chat/completions", headers={"X-Memory-User-Id": user}, json={
                "model": "via-litellm-x", "stream": stream,
                "messages": [{"role": "user", "content": question}]})
        assert answer.status_code == 500, (stream, answer.text)
        assert turns(proxy, user) == [], stream
        upstream.clear()


def test_memory_tool_mode_stores_nothing_when_a_later_round_fails(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    """The first round asked memory_search; the round after it failed: no answer reached
    the client, so nothing of the request is kept."""
    proxy = start_proxy(memory=True, memory_tool_prefetch=0)
    user, question = fresh("tool", False)
    upstream.enqueue(JSONReply(chat_completion(None, tool_calls=[SEARCH])),
                     ErrorReply(500, "the model fell over"))
    answer = send(proxy, "chat", user, question, stream=False, headers={"X-Memory-Mode": "tool"})
    assert answer.status_code == 500, answer.text
    assert answer.headers["x-memory-mode"] == "tool"
    assert turns(proxy, user) == []

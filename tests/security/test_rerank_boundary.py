"""The reranker is a new outbound surface (docs/security.md, "The reranker").

Actors: a user whose recall is reranked, another user, and a reranker that misbehaves.
Assets: each user's memory, the reranker's key, the upstream's and the client's keys. What
goes to the reranker is the requesting user's own candidates, redacted; its key goes only to
its own host; its answer can reorder the candidates and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import JSONReply, Received, Reply, ScriptedUpstream

pytestmark = pytest.mark.both_backends

RERANK_KEY = "rk-reranker-secret-0001"
UPSTREAM_KEY = "sk-upstream-secret-0002"
CLIENT_KEY = "sk-client-secret-0003"
ALICE = "Alice keeps the launch codes for Project Nightjar in the blue binder."
BOB = "Bob keeps the office plants alive with rainwater."


def every_first(received: Received) -> Reply | None:
    """A reranker that keeps the order it was given, and tries to add a text of its own."""
    documents = received.json.get("documents") or []
    return JSONReply({"results": [
        {"index": i, "relevance_score": 1.0 - i / 100, "document": {"text": "INJECTED BY RERANKER"}}
        for i in range(len(documents))
    ]})


@pytest.fixture
def reranker() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as server:
        server.respond_with(every_first)
        yield server


@pytest.fixture
def served(
    start_proxy: Callable[..., RunningProxy], reranker: ScriptedUpstream
) -> RunningProxy:
    proxy = start_proxy(
        memory=True, rerank="endpoint", rerank_base_url=f"http://127.0.0.1:{reranker.port}",
        rerank_api_key=RERANK_KEY,
    )
    chat(proxy, ALICE, session="a0", user="alice", headers={"X-Memory-Read": "off"})
    chat(proxy, BOB, session="b0", user="bob", headers={"X-Memory-Read": "off"})
    wait_for_jobs(proxy)
    reranker.clear()
    reranker.respond_with(every_first)
    return proxy


def ask(proxy: RunningProxy, user: str, question: str) -> httpx.Response:
    return httpx.post(
        f"{proxy.base_url}/chat/completions", timeout=30,
        headers={"X-Memory-User-Id": user, "Authorization": f"Bearer {CLIENT_KEY}"},
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": question}]},
    )


def test_the_reranker_gets_only_the_requesting_user_s_memory(
    served: RunningProxy, reranker: ScriptedUpstream
) -> None:
    answer = ask(served, "bob", "Who keeps the launch codes and the plants?")
    assert answer.status_code == 200 and "x-memory-error" not in answer.headers
    sent = json.dumps([r.json for r in reranker.history])
    assert reranker.history and "rainwater" in sent
    assert "Nightjar" not in sent and "launch codes for" not in sent


def test_the_reranker_s_key_goes_to_its_host_only_and_no_other_key_goes_there(
    served: RunningProxy, reranker: ScriptedUpstream, upstream: ScriptedUpstream
) -> None:
    ask(served, "alice", "Where are the launch codes?")
    assert reranker.history
    assert all(r.headers.get("authorization") == f"Bearer {RERANK_KEY}" for r in reranker.history)
    to_reranker = json.dumps([r.headers for r in reranker.history])
    assert CLIENT_KEY not in to_reranker and UPSTREAM_KEY not in to_reranker
    assert RERANK_KEY not in json.dumps([[r.headers, r.json] for r in upstream.history])


def test_a_redirect_from_the_reranker_is_not_followed(
    served: RunningProxy, reranker: ScriptedUpstream, upstream: ScriptedUpstream
) -> None:
    elsewhere = f"http://127.0.0.1:{upstream.port}/rerank"
    reranker.enqueue(JSONReply({}, status=307, headers={"location": elsewhere}), path="/rerank")
    answer = ask(served, "alice", "Where are the launch codes?")
    assert answer.headers["x-memory-error"] == "rerank: status"
    assert not [r for r in upstream.history if r.path == "/rerank"]


def test_the_reranker_s_answer_only_reorders(served: RunningProxy) -> None:
    shown = httpx.post(
        f"{served.base_url}/chat/completions", timeout=30,
        headers={"X-Memory-User-Id": "alice", "X-Memory-Dry-Run": "on"},
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "launch codes?"}]},
    ).json()
    assert shown["rerank"]["fallback"] is None
    assert "INJECTED BY RERANKER" not in shown["block"] and "Nightjar" in shown["block"]


def test_secrets_in_the_question_are_redacted_before_the_reranker(
    served: RunningProxy, reranker: ScriptedUpstream
) -> None:
    secret = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    ask(served, "alice", f"Is my token {secret} near the launch codes?")
    sent = json.dumps([r.json for r in reranker.history])
    assert reranker.history and secret not in sent and "REDACTED" in sent

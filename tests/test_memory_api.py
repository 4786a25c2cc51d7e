"""The memory API (/v1/memory) through a real running proxy: every endpoint's success and
error paths, pagination, isolation between users, auth, and the OpenAPI document."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from proxy.app import create_app
from proxy.management import routes
from proxy.management.openapi import DOCUMENT
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET, Starter, assert_error, check_schema, db_rows, memory_api

pytestmark = pytest.mark.both_backends


@pytest.fixture
def memproxy(start_proxy: Starter) -> RunningProxy:
    return start_proxy(memory=True, fact_max_pinned=2, **QUIET)


@pytest.fixture
def api(memproxy: RunningProxy) -> Iterator[httpx.Client]:
    with memory_api(memproxy) as client:
        yield client


def add(api: httpx.Client, text: str, category: str = "preference", **extra: Any) -> dict[str, Any]:
    response = api.post("/facts", json={"text": text, "category": category, **extra})
    assert response.status_code == 201, response.text
    fact: dict[str, Any] = response.json()
    check_schema("Fact", fact)
    return fact


def test_facts_add_get_edit_history_pin_delete(api: httpx.Client) -> None:
    fact = add(api, "  Prefers TypeScript  ")
    assert (fact["text"], fact["confidence"], fact["source"]) == ("Prefers TypeScript", 0.6, "manual")
    assert fact["active"] and fact["version"] == 1 and not fact["pinned"]
    assert api.get(f"/facts/{fact['id']}").json() == fact

    edited = api.patch(f"/facts/{fact['id']}", json={"text": "Prefers Rust", "importance": 9})
    assert edited.status_code == 200
    new = edited.json()
    assert (new["text"], new["version"], new["previous_id"], new["importance"]) == (
        "Prefers Rust", 2, fact["id"], 9)
    history = api.get(f"/facts/{new['id']}/history").json()
    check_schema("FactList", history)
    assert [(v["text"], v["active"]) for v in history["data"]] == [
        ("Prefers TypeScript", False), ("Prefers Rust", True)]
    assert api.get(f"/facts/{fact['id']}").json()["superseded_by"] == new["id"]

    pinned = api.post(f"/facts/{new['id']}/pin").json()
    assert pinned["pinned"] is True
    assert api.post(f"/facts/{new['id']}/unpin").json()["pinned"] is False

    deleted = api.delete(f"/facts/{new['id']}").json()
    check_schema("Deleted", deleted)
    assert {k: deleted[k] for k in ("object", "id", "deleted")} == {
        "object": "memory.fact.deleted", "id": new["id"], "deleted": True}
    assert_error(api.get(f"/facts/{fact['id']}"), 404, "fact_id")  # the whole chain went
    assert api.get("/facts", params={"include_inactive": "true"}).json()["data"] == []
    assert_error(api.delete(f"/facts/{new['id']}"), 404, "fact_id")

    # The undo token brings the chain back, history and pin state included, under new ids.
    undone = api.post("/clear/undo", json={"undo_token": deleted["undo_token"]})
    assert undone.status_code == 200 and undone.json()["added"]["facts"] == 2
    back = api.get("/facts", params={"include_inactive": "true"}).json()["data"]
    assert sorted((f["text"], f["active"], f["version"]) for f in back) == [
        ("Prefers Rust", True, 2), ("Prefers TypeScript", False, 1)]
    assert_error(api.post("/clear/undo", json={"undo_token": "x" * 32}), 404, "undo_token")


def test_fact_errors(api: httpx.Client) -> None:
    fact = add(api, "Uses vim")
    cases = [
        (api.post("/facts", json={"category": "preference"}), 400, "text"),
        (api.post("/facts", json={"text": "   ", "category": "preference"}), 400, "text"),
        (api.post("/facts", json={"text": "x" * 1001, "category": "preference"}), 400, "text"),
        (api.post("/facts", json={"text": "x"}), 400, "category"),
        (api.post("/facts", json={"text": "x", "category": "mood"}), 400, "category"),
        (api.post("/facts", json={"text": "x", "category": "todo", "confidence": 2}), 400, "confidence"),
        (api.post("/facts", json={"text": "x", "category": "todo", "importance": 2.5}), 400, "importance"),
        (api.post("/facts", json={"text": "x", "category": "todo", "pinned": "yes"}), 400, "pinned"),
        (api.post("/facts", json={"text": "x", "category": "todo", "colour": 1}), 400, "colour"),
        (api.post("/facts", content=b"{not json"), 400, None),
        (api.post("/facts", json=["a list"]), 400, None),
        (api.patch(f"/facts/{fact['id']}", json={}), 400, None),
        (api.patch(f"/facts/{fact['id']}", json={"expires_at": None}), 400, "expires_at"),
        (api.post("/facts", json={"text": None, "category": "todo"}), 400, "text"),
        (api.patch(f"/facts/{fact['id']}", json={"category": "mood"}), 400, "category"),
        (api.patch("/facts/999999", json={"text": "y"}), 404, "fact_id"),
        (api.get("/facts/999999"), 404, "fact_id"),
        (api.get("/facts/abc"), 404, "fact_id"),
        (api.delete("/facts/999999"), 404, "fact_id"),
        (api.post("/facts/999999/pin"), 404, "fact_id"),
        (api.post("/facts/999999/unpin"), 404, "fact_id"),
        (api.get("/facts/999999/history"), 404, "fact_id"),
        (api.get("/facts", params={"category": "mood"}), 400, "category"),
        (api.get("/facts", params={"pinned": "maybe"}), 400, "pinned"),
        (api.get("/facts", params={"limit": "0"}), 400, "limit"),
        (api.get("/facts", params={"limit": "501"}), 400, "limit"),
        (api.get("/facts", params={"cursor": "nope"}), 400, "cursor"),
        (api.put("/facts"), 405, None),
        (api.get("/nothing-here"), 404, None),
    ]
    for response, status, param in cases:
        check_schema("Error", response.json())
        assert_error(response, status, param)
    not_allowed = api.put("/facts")
    assert set(not_allowed.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}
    edited = api.patch(f"/facts/{fact['id']}", json={"text": "Uses neovim"}).json()
    stale = api.patch(f"/facts/{fact['id']}", json={"text": "Uses emacs"})
    assert assert_error(stale, 409, "fact_id")["code"] == "fact_superseded"  # an old version
    assert_error(api.post(f"/facts/{fact['id']}/pin"), 409, "fact_id")
    add(api, "one", pinned=True)
    assert api.post(f"/facts/{edited['id']}/pin").json()["pinned"] is True
    at_limit = assert_error(add_raw(api, "three", pinned=True), 409, "pinned")  # 2 pins here
    assert at_limit["code"] == "pin_limit"
    assert_error(api.post(f"/facts/{add(api, 'four')['id']}/pin"), 409, "pinned")


def add_raw(api: httpx.Client, text: str, **extra: Any) -> httpx.Response:
    return api.post("/facts", json={"text": text, "category": "todo", **extra})


def test_fact_listing_filters_and_pages(api: httpx.Client) -> None:
    for i in range(7):
        add(api, f"Likes tool number {i}", "preference")
    add(api, "Ships the billing service", "project", pinned=True)
    seen: list[int] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = api.get("/facts", params=params).json()
        check_schema("FactList", page)
        seen += [f["id"] for f in page["data"]]
        pages += 1
        assert page["has_more"] == (page["next_cursor"] is not None)
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert pages == 3 and len(seen) == len(set(seen)) == 8 and seen == sorted(seen, reverse=True)
    projects = api.get("/facts", params={"category": "project"}).json()["data"]
    assert [f["text"] for f in projects] == ["Ships the billing service"]
    assert api.get("/facts", params={"pinned": "true"}).json()["data"] == projects
    assert len(api.get("/facts", params={"pinned": "false"}).json()["data"]) == 7
    found = api.get("/facts", params={"q": "tool number"}).json()["data"]
    assert len(found) == 7
    assert api.get("/facts", params={"q": "billing"}).json()["data"] == projects


def test_users_are_isolated(memproxy: RunningProxy) -> None:
    with memory_api(memproxy, **{"X-Memory-User-Id": "alice"}) as alice, \
            memory_api(memproxy, **{"X-Memory-User-Id": "bob"}) as bob:
        secret = add(alice, "Alice's locker code is 4471")
        chat(memproxy, "Alice's cat is called Miso.", user="alice", session="a1")
        wait_for_jobs(memproxy)
        assert bob.get("/facts").json()["data"] == []
        assert_error(bob.get(f"/facts/{secret['id']}"), 404)
        assert_error(bob.patch(f"/facts/{secret['id']}", json={"text": "x"}), 404)
        assert_error(bob.delete(f"/facts/{secret['id']}"), 404)
        assert_error(bob.post(f"/facts/{secret['id']}/pin"), 404)
        assert_error(bob.get(f"/facts/{secret['id']}/history"), 404)
        assert bob.get("/sessions").json()["data"] == []
        assert_error(bob.get("/sessions/a1"), 404)
        assert_error(bob.get("/turns", params={"session_id": "a1"}), 404)
        assert_error(bob.delete("/sessions/a1"), 404)
        assert bob.post("/search", json={"query": "what is the cat called?"}).json()["items"] == []
        assert b"Miso" not in bob.get("/export").content
        bob_stats = bob.get("/stats").json()
        assert bob_stats["counts"]["turns"] == 0 and bob_stats["index"]["vectors"] == 0
        receipt = bob.post("/clear").json()
        assert receipt["removed"]["turns"] == 0
        assert_error(alice.post("/clear/undo", json={"undo_token": receipt["undo_token"]}), 404)
        assert alice.get(f"/facts/{secret['id']}").status_code == 200
        assert "Miso" in alice.post("/search", json={"query": "what is the cat called?"}).json()["block"]


def test_sessions_turns_and_delete(memproxy: RunningProxy, api: httpx.Client) -> None:
    for i in range(5):
        chat(memproxy, f"Session {i} is about the topic number {i}.", session=f"s{i}")
    chat(memproxy, "A second question in session zero.", session="s0")
    chat(memproxy, "Slash ids work too.", session="team/alpha 1")
    wait_for_jobs(memproxy)
    listed: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = api.get("/sessions", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        check_schema("SessionList", page)
        listed += page["data"]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert [s["session_id"] for s in listed][:2] == ["team/alpha 1", "s0"]  # most recent first
    assert len(listed) == 6 and listed == sorted(listed, key=lambda s: -s["last_active"])
    s0 = next(s for s in listed if s["session_id"] == "s0")
    assert (s0["turns"], s0["title"]) == (4, "Session 0 is about the topic number 0.")
    assert api.get("/sessions/team/alpha 1").json()["turns"] == 2
    check_schema("Session", api.get("/sessions/s0").json())

    first = api.get("/turns", params={"session_id": "s0", "limit": 3}).json()
    check_schema("TurnList", first)
    rest = api.get("/turns", params={"session_id": "s0", "cursor": first["next_cursor"]}).json()
    turns = first["data"] + rest["data"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    assert turns[0]["content"] == "Session 0 is about the topic number 0." and not rest["has_more"]

    vectors = memproxy.state.memory.vectors
    assert vectors.count({"user_id": "default", "session_id": "s0"}) == 4
    removed = api.delete("/sessions/s0").json()
    assert removed["removed"]["turns"] == 4 and removed["deleted"] is True
    wait_for_jobs(memproxy)
    assert vectors.count({"user_id": "default", "session_id": "s0"}) == 0
    assert db_rows(memproxy, "SELECT count(*) FROM chunks WHERE session_id = 's0'") == [(0,)]
    assert_error(api.get("/sessions/s0"), 404, "session_id")
    block = api.post("/search", json={"query": "topic number 0"}).json()["block"]
    assert "Session 1 is about" in block and "Session 0 is about" not in block
    assert api.delete("/sessions/team/alpha 1").status_code == 200

    for response, status, param in [
        (api.get("/turns"), 400, "session_id"),
        (api.get("/turns", params={"session_id": "s1", "cursor": "x"}), 400, "cursor"),
        (api.get("/turns", params={"session_id": "s1", "limit": "9999"}), 400, "limit"),
        (api.get("/sessions", params={"cursor": "garbage"}), 400, "cursor"),
        (api.get("/sessions", params={"limit": "-1"}), 400, "limit"),
        (api.get("/sessions/%20"), 404, "session_id"),
        (api.delete("/sessions/nope"), 404, "session_id"),
    ]:
        assert_error(response, status, param)


def test_session_delete_takes_facts_learned_only_from_it(memproxy: RunningProxy, api: httpx.Client) -> None:
    lines = [
        {"type": "turn", "id": 1, "session_id": "home", "role": "user", "content": "I moved to Porto."},
        {"type": "turn", "id": 2, "session_id": "travel", "role": "user", "content": "Porto in spring!"},
        {"type": "fact", "id": 10, "text": "Lives in Porto", "category": "identity",
         "source": "extracted", "source_session": "home", "source_turn_ids": [1]},
        {"type": "fact", "id": 11, "text": "Likes Porto", "category": "preference",
         "source": "extracted", "source_session": "home", "source_turn_ids": [1, 2]},
        {"type": "fact", "id": 12, "text": "Moved to Porto", "category": "identity"},
    ]
    imported = api.post("/import", content="\n".join(json.dumps(line) for line in lines))
    assert imported.json()["added"]["facts"] == 3
    wait_for_jobs(memproxy)
    assert memproxy.state.memory.vectors.count({"user_id": "default", "source": "fact"}) == 3
    removed = api.delete("/sessions/home").json()["removed"]
    assert removed == {"turns": 1, "chunks": 1, "summaries": 0, "fact_versions": 1,
                       "request_metrics": 0}
    remaining = sorted(f["text"] for f in api.get("/facts").json()["data"])
    assert remaining == ["Likes Porto", "Moved to Porto"]  # one cites travel; one is manual
    wait_for_jobs(memproxy)
    assert memproxy.state.memory.vectors.count({"user_id": "default", "source": "fact"}) == 2
    home = {"user_id": "default", "session_id": "home", "source": "turn"}
    assert memproxy.state.memory.vectors.count(home) == 0


def test_search_shows_what_would_be_injected(memproxy: RunningProxy, api: httpx.Client) -> None:
    chat(memproxy, "The staging cluster is called aurora-west.", session="ops")
    chat(memproxy, "Lunch today was ramen.", session="food")
    wait_for_jobs(memproxy)
    result = api.post("/search", json={"query": "what is the staging cluster called?", "budget": 300})
    assert result.status_code == 200
    body = result.json()
    check_schema("SearchResult", body)
    assert "aurora-west" in body["block"] and 0 < body["tokens"] <= 300
    top = body["items"][0]
    assert top["session_id"] == "ops" and "aurora-west" in top["text"]
    assert {"dense", "bm25"} <= set(top["signals"]) and top["score"] > 0
    dry = httpx.post(f"{memproxy.base_url}/chat/completions", headers={
        "X-Memory-Dry-Run": "on", "X-Memory-Budget": "300", "X-Memory-Session-Id": "other"},
        json={"model": "gpt-4o", "messages": [
            {"role": "user", "content": "what is the staging cluster called?"}]}).json()
    assert dry["block"] == body["block"]  # exactly what a chat request would get
    tight = api.post("/search", json={"query": "staging cluster", "budget": 0}).json()
    assert tight["tokens"] == 0 and tight["items"] == []
    scoped = api.post("/search", json={"query": "staging cluster", "scope": "session",
                                       "session_id": "food"}).json()
    assert "aurora-west" not in scoped["block"]
    for response, param in [
        (api.post("/search", json={}), "query"),
        (api.post("/search", json={"query": ""}), "query"),
        (api.post("/search", json={"query": "x", "budget": -1}), "budget"),
        (api.post("/search", json={"query": "x", "budget": 100001}), "budget"),
        (api.post("/search", json={"query": "x", "scope": "galaxy"}), "scope"),
        (api.post("/search", json={"query": "x", "scope": "session"}), "session_id"),
        (api.post("/search", json={"query": "x", "extra": True}), "extra"),
    ]:
        assert_error(response, 400, param)


def test_profile_and_consent(api: httpx.Client) -> None:
    state = api.get("/profile").json()
    check_schema("Profile", state)
    assert (state["consent"], state["profile"]) == (False, None)
    refused = api.put("/profile", json={"fields": {"name": "Ada"}, "text": "Engineer"})
    assert assert_error(refused, 409, "consent")["code"] == "consent_required"
    assert api.put("/consent", json={"consent": True}).json()["consent"] is True
    saved = api.put("/profile", json={"fields": {"name": "Ada"}, "text": "Engineer"}).json()
    assert saved["profile"]["fields"] == {"name": "Ada"} and saved["profile"]["text"] == "Engineer"
    assert api.get("/consent").json() == saved
    assert api.delete("/profile").json()["profile"] is None
    api.put("/profile", json={"fields": {}, "text": "Back"})
    revoked = api.put("/consent", json={"consent": False}).json()
    assert (revoked["consent"], revoked["profile"]) == (False, None)  # revoking deletes it
    for response, param in [
        (api.put("/consent", json={}), "consent"),
        (api.put("/consent", json={"consent": "yes"}), "consent"),
        (api.put("/profile", json={"fields": [1]}), "fields"),
        (api.put("/profile", json={"text": 5}), "text"),
        (api.put("/profile", json={"bio": "x"}), "bio"),
    ]:
        assert_error(response, 400, param)


def test_stats_and_metrics(memproxy: RunningProxy, api: httpx.Client) -> None:
    add(api, "Prefers dark mode", pinned=True)
    chat(memproxy, "Remember that the build uses Bazel.", session="b1")
    wait_for_jobs(memproxy)
    chat(memproxy, "Which build tool do we use?", session="b2")
    wait_for_jobs(memproxy)
    stats = api.get("/stats").json()
    check_schema("Stats", stats)
    assert stats["counts"] | {"sessions": 2, "turns": 4, "facts": 1, "pinned": 1} == stats["counts"]
    assert stats["index"]["vectors"] >= 5 and stats["index"]["database_bytes"] > 0
    assert stats["jobs"]["depth"] == 0 and stats["jobs"]["dead_letters"] == []
    assert stats["limits"]["clear_undo_seconds"] == 60.0

    metrics = api.get("/metrics").json()
    check_schema("Metrics", metrics)
    assert metrics["summary"]["requests"] == 2 == len(metrics["data"])
    assert [row["session_id"] for row in metrics["data"]] == ["b1", "b2"]
    assert metrics["data"][1]["injected_tokens"] > 0 and metrics["summary"]["recall_ms_p95"] >= 0
    start = metrics["data"][1]["created_at"]
    later = api.get("/metrics", params={"since": start}).json()
    assert [row["session_id"] for row in later["data"]] == ["b2"]
    one = api.get("/metrics", params={"limit": 1}).json()
    assert len(one["data"]) == 1 and one["has_more"]
    assert api.get("/metrics", params={"since": 0, "until": 1}).json()["data"] == []
    assert api.get("/metrics", params={"since": 10, "until": 5}).json()["data"] == []
    cases: list[tuple[dict[str, Any], str]] = [
        ({"since": "yesterday"}, "since"), ({"until": "-5"}, "until"), ({"limit": 0}, "limit"),
    ]
    for params, param in cases:
        assert_error(api.get("/metrics", params=params), 400, param)


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the summary of these metrics rows must say, computed here from the rows
    (percentiles by nearest rank, as memory/admin/stats.py asks the database)."""
    latencies = sorted(r["recall_ms"] for r in rows if r["recall_ms"] is not None)
    tokens = [int(r["injected_tokens"]) for r in rows]

    def percentile(pct: int) -> float | None:
        rank = min(len(latencies) - 1, max(0, round(pct / 100 * len(latencies)) - 1))
        return float(latencies[rank]) if latencies else None

    return {
        "requests": len(rows),
        "recall_ms_p50": percentile(50),
        "recall_ms_p95": percentile(95),
        "recall_ms_max": latencies[-1] if latencies else None,
        "injected_tokens_mean": round(statistics.fmean(tokens), 1) if tokens else None,
        "injected_tokens_max": max(tokens) if tokens else None,
        "truncated": sum(1 for r in rows if r["truncated"]),
        "errors": sum(1 for r in rows if r["error"]),
    }


def test_metrics_pages_by_cursor_and_summarises_the_whole_range(
    memproxy: RunningProxy, api: httpx.Client
) -> None:
    for i in range(7):
        chat(memproxy, f"Question {i}: which build tool and which database do we use?",
             session=f"m{i}")
    chat(memproxy, "Someone else's question", session="other", user="zed")
    wait_for_jobs(memproxy)
    whole = api.get("/metrics").json()
    check_schema("Metrics", whole)
    rows = whole["data"]
    assert len(rows) == 7 and whole["has_more"] is False and whole["next_cursor"] is None
    assert whole["summary"] == summarize(rows)

    pages, params = [], {"limit": 3}
    while True:
        page = api.get("/metrics", params=params).json()
        check_schema("Metrics", page)
        pages.append(page)
        # Every page summarises the whole range, not its own rows.
        assert page["summary"] == whole["summary"] and page["summary"]["requests"] == 7
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        params["cursor"] = page["next_cursor"]
    assert [len(p["data"]) for p in pages] == [3, 3, 1]
    assert [row for p in pages for row in p["data"]] == rows
    # A cursor keeps its range; a since that excludes the first rows shortens it.
    later = api.get("/metrics", params={"since": rows[4]["created_at"], "limit": 1}).json()
    assert later["summary"] == summarize(rows[4:]) and later["data"] == rows[4:5]
    for cursor in ("nope", "1.5", "1.5:", ":3", "1.5:3:4", "-1.0:3", "1e999:1"):
        assert_error(api.get("/metrics", params={"cursor": cursor}), 400, "cursor")


def test_keys_scope_users_and_admin_reaches_everyone(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, api_keys="key-alice-0001:alice,key-shared-0002",
                        admin_key="admin-key-0003", **QUIET)
    def client(key: str | None, user: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if user:
            headers["X-Memory-User-Id"] = user
        return memory_api(proxy, **headers)

    for key in (None, "wrong-key-0000"):
        with client(key) as refused:
            assert_error(refused.get("/facts"), 401)
    with client("key-alice-0001") as alice:
        mine = add(alice, "Alice likes tea")
        assert [f["id"] for f in alice.get("/facts").json()["data"]] == [mine["id"]]
    with client("key-alice-0001", "bob") as elsewhere:
        assert_error(elsewhere.get("/facts"), 403, "X-Memory-User-Id")
    with client("key-shared-0002", "bob") as bob:  # an unbound key names its user
        add(bob, "Bob likes coffee")
        assert [f["text"] for f in bob.get("/facts").json()["data"]] == ["Bob likes coffee"]
    with client("admin-key-0003", "alice") as admin:
        assert [f["id"] for f in admin.get("/facts").json()["data"]] == [mine["id"]]
        assert admin.delete(f"/facts/{mine['id']}").status_code == 200
    with client("admin-key-0003") as admin:
        assert admin.get("/stats").json()["user_id"] == "default"
    with client(None) as anonymous:  # the document that describes the API needs no key
        assert anonymous.get("/openapi.json").status_code == 200
    other = proxy.state.settings.data_dir.parent / "other"
    only_admin = start_proxy(memory=True, admin_key="admin-key-0004", data_dir=other, **QUIET)
    with memory_api(only_admin) as anonymous, \
            memory_api(only_admin, Authorization="Bearer admin-key-0004") as admin:
        assert_error(anonymous.get("/facts"), 401)
        assert admin.get("/facts").status_code == 200


async def test_without_keys_only_loopback_clients_are_served(make_settings: Any) -> None:
    # A remote address needs a second machine; the app is driven in-process with one instead.
    for remote_ok, expected in ((False, 403), (True, 503)):
        app = create_app(make_settings(management_remote=remote_ok), with_memory=False)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, client=("203.0.113.9", 50000))
            # A loopback name: without keys memproxy answers no other (proxy/access/edge.py).
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                response = await http.get("/v1/memory/facts")
        assert_error(response, expected)  # 503: let through, but this proxy has no memory
        if expected == 403:
            assert "MEMPROXY_MANAGEMENT_REMOTE" in response.json()["error"]["message"]


def test_memory_off_answers_503(proxy: RunningProxy) -> None:
    with memory_api(proxy) as api:
        response = api.get("/facts")
    assert assert_error(response, 503)["code"] == "memory_unavailable"


def test_openapi_describes_every_route(api: httpx.Client) -> None:
    document = api.get("/openapi.json").json()
    assert document == DOCUMENT and document["openapi"].startswith("3.0")
    # The admin API's paths carry their own server (/v1/admin): tests/test_admin_keys.py
    # and tests/test_usage.py.
    memory_paths = {p: item for p, item in document["paths"].items() if "servers" not in item}
    described = {(path, method) for path, item in memory_paths.items()
                 for method in item if method != "parameters"}
    served = set()
    for route in routes():
        assert isinstance(route, Route)
        path = re.sub(r"\{(\w+):path\}", r"{\1}", route.path)
        for method in route.methods or ():
            if method != "HEAD" and path != "/openapi.json":
                served.add((path, method.lower()))
    assert described == served
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method in ("parameters", "servers"):
                continue
            assert any(code.startswith("2") for code in operation["responses"]), (path, method)

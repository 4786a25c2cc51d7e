"""Export, import and clear-all with undo, through real running proxies and data dirs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from config import Settings
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import (
    QUIET,
    Starter,
    assert_error,
    canonical,
    check_schema,
    db_rows,
    export_records,
    memory_api,
    seed,
)

pytestmark = pytest.mark.both_backends

ADA = {"X-Memory-User-Id": "ada"}


@pytest.fixture
def memproxy_quiet(start_proxy: Starter) -> RunningProxy:
    return start_proxy(memory=True, **QUIET)


def body_of(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


async def test_export_then_import_into_an_empty_data_dir_is_the_same_memory(
    make_settings: Callable[..., Settings], embedder: Any, start_proxy: Starter, tmp_path: Path,
    new_database_url: Callable[[], str | None],
) -> None:
    await seed(make_settings(**QUIET), embedder)
    source = start_proxy(memory=True, **QUIET)
    exported = export_records(source, **ADA)
    meta = exported[0]
    assert meta["type"] == "meta" and meta["user_id"] == "ada"
    assert meta["counts"] == {"turn": 6, "fact": 4, "summary": 2, "profile": 1}
    for record in exported:  # each as the document declares it (what /import takes)
        check_schema(record["type"].title() + "Record", record)
    assert [r["type"] for r in exported[1:]] == ["turn"] * 6 + ["fact"] * 4 + ["summary"] * 2 + ["profile"]
    assert any("\u2028" in r.get("content", "") for r in exported)  # one record, one line

    target = start_proxy(
        memory=True, data_dir=tmp_path / "empty", database_url=new_database_url(), **QUIET
    )
    with memory_api(target, **ADA) as api:
        first = api.post("/import", content=body_of(exported))
        assert first.status_code == 200, first.text
        check_schema("ImportReport", first.json())
        assert first.json()["added"] == {"turns": 6, "facts": 4, "summaries": 2, "profile": 1}
        wait_for_jobs(target)
        again = api.post("/import", content=body_of(exported)).json()
        assert again["added"] == {"turns": 0, "facts": 0, "summaries": 0, "profile": 0}
        assert again["skipped"] == {"turns": 6, "facts": 4, "summaries": 2, "profile": 1}
        wait_for_jobs(target)
        assert canonical(export_records(target, **ADA)) == canonical(exported)
        stats = api.get("/stats").json()["counts"]
        assert (stats["turns"], stats["facts"], stats["pinned"], stats["summaries"]) == (6, 3, 1, 1)
        assert stats["profile"] and stats["consent"]
        # Imported memory is recalled like memory learned live.
        found = api.post("/search", json={"query": "which hotel near Alfama?"}).json()
        assert "Alfama" in found["block"]
    assert db_rows(target, "SELECT count(*) FROM turns") == [(6,)]


def test_import_accepts_openai_conversations_with_timestamps(memproxy_quiet: RunningProxy) -> None:
    conversations: list[dict[str, Any]] = [
        {"messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "My dog is called Biscuit.", "timestamp": "2024-03-01T10:00:00Z"},
            {"role": "assistant", "content": [{"type": "text", "text": "Biscuit, noted."}],
             "timestamp": 1709287260},
        ]},
        {"session_id": "imported-2", "created_at": 1709300000, "messages": [
            {"role": "user", "content": "I play the cello."},
            {"role": "assistant", "content": "Lovely."},
        ]},
    ]
    text = "\n".join(json.dumps(c) for c in conversations)
    with memory_api(memproxy_quiet) as api:
        report = api.post("/import", content=text).json()
        assert report["added"]["turns"] == 4 and report["records"] == 2
        assert api.post("/import", content=text).json()["added"]["turns"] == 0
        sessions = {s["session_id"]: s for s in api.get("/sessions").json()["data"]}
        assert "imported-2" in sessions and len(sessions) == 2
        fingerprint = next(s for s in sessions if s != "imported-2")
        turns = api.get("/turns", params={"session_id": fingerprint}).json()["data"]
        assert [(t["role"], t["content"], t["created_at"]) for t in turns] == [
            ("user", "My dog is called Biscuit.", 1709287200.0),
            ("assistant", "Biscuit, noted.", 1709287260.0)]
        cello = api.get("/turns", params={"session_id": "imported-2"}).json()["data"]
        assert [t["created_at"] for t in cello] == [1709300000.0, 1709300000.0]
        as_array = api.post("/import", content=json.dumps(conversations)).json()
        assert as_array["added"]["turns"] == 0 and as_array["skipped"]["turns"] == 4
    # Continuing the conversation through the proxy lands in the same session.
    dry = httpx.post(f"{memproxy_quiet.base_url}/chat/completions", headers={"X-Memory-Dry-Run": "on"},
                     json={"model": "gpt-4o", "messages": conversations[0]["messages"][:2]}).json()
    assert dry["session_id"] == fingerprint


def test_import_rejects_bad_records_and_writes_nothing(memproxy_quiet: RunningProxy) -> None:
    good = {"type": "turn", "session_id": "s", "role": "user", "content": "fine"}
    with memory_api(memproxy_quiet) as api:
        bodies: list[tuple[str | bytes, str | None]] = [
            (b"", None),
            (b"not json at all", None),
            (json.dumps(good) + "\n{broken", None),
            (json.dumps({"type": "turn", "session_id": "s", "role": "system", "content": "x"}), "role"),
            (json.dumps({"type": "turn", "session_id": "s", "role": {}, "content": "x"}), "role"),
            (json.dumps({"type": None, "messages": [{"role": "user", "content": "x"}]}), "type"),
            (json.dumps({"messages": [{"role": "user", "content": "x", "tool_calls": {}}]}),
             "messages[0].tool_calls"),
            (json.dumps({"messages": [{"role": "system", "timestamp": "soon"}]}),
             "messages[0].timestamp"),
            (json.dumps({"type": "turn", "role": "user", "content": "x"}), "session_id"),
            (json.dumps({"type": "fact", "text": "x", "category": "mood"}), "category"),
            (json.dumps({"type": "fact", "text": "x", "category": "todo", "confidence": 3}), "confidence"),
            (json.dumps({"type": "turn", "session_id": "s", "role": "user", "content": "x",
                         "created_at": "yesterday"}), "created_at"),
            (json.dumps({"type": "meta", "format": "memproxy-export", "version": 99}), "version"),
            (json.dumps({"type": "summary", "session_id": "s", "text": "t", "data": {"todos": [1]}}), "data.todos"),
            (json.dumps({"type": "profile", "consent": "yes"}), "consent"),
            (json.dumps({"messages": []}), "messages"),
            (json.dumps({"type": "photo"}), "type"),
            (json.dumps([1, 2]), None),
            (b"\xff\xfe", None),
        ]
        for body, param in bodies:
            response = api.post("/import", content=body)
            error = assert_error(response, 400, param)
            if param is not None:
                assert error["code"] == "invalid_record" and "line 1" in error["message"]
        mixed = json.dumps(good) + "\n" + json.dumps({"type": "turn", "role": "user", "content": "x"})
        assert "line 2" in assert_error(api.post("/import", content=mixed), 400, "session_id")["message"]
        assert api.get("/stats").json()["counts"]["turns"] == 0


def test_import_refuses_unknown_roles_and_empty_messages_and_counts_what_it_leaves_out(
    memproxy_quiet: RunningProxy,
) -> None:
    def conversation(*messages: dict[str, Any]) -> str:
        return json.dumps({"session_id": "chat", "messages": [
            {"role": "user", "content": "hello"}, *messages]})

    bad: list[tuple[dict[str, Any], str]] = [
        ({"role": "usr", "content": "typo"}, "messages[1].role"),
        ({"role": "User", "content": "case"}, "messages[1].role"),
        ({"role": "", "content": "blank"}, "messages[1].role"),
        ({"role": "assistant", "content": ""}, "messages[1].content"),
        ({"role": "user", "content": "   "}, "messages[1].content"),
        ({"role": "assistant"}, "messages[1].content"),
        ({"role": "assistant", "content": None}, "messages[1].content"),
        ({"role": "user", "content": []}, "messages[1].content"),
        ({"role": "user", "content": 42}, "messages[1].content"),
        ({"role": "user", "content": "hi", "name": 7}, "messages[1].name"),
    ]
    with memory_api(memproxy_quiet) as api:
        for message, param in bad:
            body = json.dumps({"type": "turn", "session_id": "s", "role": "user", "content": "ok"})
            body += "\n" + conversation(message)
            error = assert_error(api.post("/import", content=body), 400, param)
            assert error["code"] == "invalid_record" and error["message"].startswith("line 2: ")
        # A JSON array of conversations names the item.
        listed = "[" + conversation({"role": "assistant", "content": "fine"}) + ","
        listed += conversation({"role": "usr", "content": "typo"}) + "]"
        assert "line 2" in assert_error(api.post("/import", content=listed), 400, "messages[1].role")["message"]
        assert api.get("/stats").json()["counts"]["turns"] == 0

        # What is left out on purpose is counted: instructions, and messages with no text.
        body = conversation(
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": "Answer in French."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
            {"role": "system", "content": ""},
        )
        report = api.post("/import", content=body)
        assert report.status_code == 200, report.text
        check_schema("ImportReport", report.json())
        assert report.json()["added"]["turns"] == 3
        assert report.json()["ignored"] == {"system": 2, "developer": 1, "function": 0, "no_text": 1}
        again = api.post("/import", content=body).json()
        assert again["skipped"]["turns"] == 3 and again["ignored"]["system"] == 2
        records = api.post("/import", content=json.dumps(
            {"type": "fact", "text": "Likes tea", "category": "preference"})).json()
        assert records["ignored"] == {"system": 0, "developer": 0, "function": 0, "no_text": 0}


def test_clear_all_and_undo_within_the_window(memproxy_quiet: RunningProxy) -> None:
    proxy = memproxy_quiet
    with memory_api(proxy) as api:
        api.post("/facts", json={"text": "Prefers green tea", "category": "preference", "pinned": True})
        api.post("/facts", json={"text": "Ships on Fridays", "category": "decision"})
        api.put("/consent", json={"consent": True})
        api.put("/profile", json={"fields": {"name": "Kim"}, "text": "Designer"})
        chat(proxy, "The design system is called Prism.", session="d1")
        chat(proxy, "Prism uses 8px spacing.", session="d2")
        wait_for_jobs(proxy)
        before = canonical(export_records(proxy))
        counts = api.get("/stats").json()["counts"]
        asked = time.time()
        receipt = api.post("/clear")
        answered = time.time()
        assert receipt.status_code == 200
        check_schema("Clear", receipt.json())
        cleared = receipt.json()
        assert cleared["removed"] | {"facts": 2, "turns": 4, "sessions": 2, "profile": 1} == cleared["removed"]
        assert (counts["facts"], counts["turns"], counts["sessions"]) == (2, 4, 2)
        assert asked + 60 <= cleared["expires_at"] <= answered + 60  # the default window, from the clear
        assert api.get("/facts").json()["data"] == [] and api.get("/sessions").json()["data"] == []
        assert api.get("/profile").json()["profile"] is None
        assert api.post("/search", json={"query": "what is the design system called?"}).json()["items"] == []
        wait_for_jobs(proxy)
        assert proxy.state.memory.vectors.count({"user_id": "default"}) == 0
        assert api.get("/stats").json()["pending_clears"][0]["removed"] == cleared["removed"]

        undone = api.post("/clear/undo", json={"undo_token": cleared["undo_token"]})
        assert undone.status_code == 200 and undone.json()["added"]["turns"] == 4
        wait_for_jobs(proxy)
        assert canonical(export_records(proxy)) == before
        assert "Prism" in api.post("/search", json={"query": "what is the design system called?"}).json()["block"]
        assert [f["pinned"] for f in api.get("/facts", params={"pinned": "true"}).json()["data"]] == [True]
        again = api.post("/clear/undo", json={"undo_token": cleared["undo_token"]})
        assert again.status_code == 200 and again.json()["added"]["turns"] == 0  # idempotent
        assert_error(api.post("/clear/undo", json={"undo_token": "made-up"}), 404, "undo_token")
        assert_error(api.post("/clear/undo", json={}), 400, "undo_token")
        assert_error(api.post("/clear", json={"all": True}), 400, "all")
        assert db_rows(proxy, "SELECT count(*) FROM clear_records") == [(0,)]


def metrics_rows(proxy: RunningProxy, user: str) -> list[tuple[Any, ...]]:
    return db_rows(proxy, "SELECT created_at, session_id, request_id, model, items_json,"
                          " injected_tokens, truncated, recall_ms, embed_ms, error"
                          " FROM request_metrics WHERE user_id = ? ORDER BY id", (user,))


def test_clear_and_session_delete_take_the_user_s_request_metrics(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, clear_undo_seconds=3, **QUIET)
    for user, session, text in [("ada", "a1", "Our build uses Bazel."),
                                ("ada", "a1", "Which build tool do we use?"),
                                ("ada", "a2", "The office moved to Canal Street."),
                                ("bob", "b1", "Bob's team ships on Fridays.")]:
        chat(proxy, text, user=user, session=session)
    wait_for_jobs(proxy)
    ada, bob = metrics_rows(proxy, "ada"), metrics_rows(proxy, "bob")
    assert [row[1] for row in ada] == ["a1", "a1", "a2"] and len(bob) == 1

    with memory_api(proxy, **ADA) as api:
        # Deleting a session deletes its rows (a session delete cannot be undone).
        removed = api.delete("/sessions/a2").json()["removed"]
        assert removed["request_metrics"] == 1
        assert metrics_rows(proxy, "ada") == ada[:2]
        # Clearing everything takes every row naming the user; undo brings them back as they were.
        cleared = api.post("/clear").json()
        assert cleared["removed"]["request_metrics"] == 2
        assert metrics_rows(proxy, "ada") == [] and api.get("/metrics").json()["data"] == []
        assert api.post("/clear/undo", json={"undo_token": cleared["undo_token"]}).status_code == 200
        wait_for_jobs(proxy)
        assert metrics_rows(proxy, "ada") == ada[:2]
        assert len(api.get("/metrics", params={"since": 0}).json()["data"]) == 2
        # Once the window ends they are gone for good, with the rest of the clear.
        api.post("/clear")
        time.sleep(3.2)
        wait_for_jobs(proxy)
        assert db_rows(proxy, "SELECT status FROM clears ORDER BY created_at") == [
            ("restored",), ("purged",)]
        assert db_rows(proxy, "SELECT count(*) FROM clear_records") == [(0,)]
        assert metrics_rows(proxy, "ada") == []
    assert metrics_rows(proxy, "bob") == bob  # another user's rows are never touched


def test_a_deleted_fact_is_restorable_until_its_window_ends(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, clear_undo_seconds=1.5, **QUIET)
    with memory_api(proxy, **ADA) as api:
        kept = api.post("/facts", json={"text": "Ada's badge is 7731.", "category": "context"}).json()
        gone = api.post("/facts", json={"text": "Ada's desk is 4B.", "category": "context"}).json()
        first = api.delete(f"/facts/{kept['id']}").json()
        second = api.delete(f"/facts/{gone['id']}").json()
        assert api.get("/facts").json()["data"] == []
        assert api.post("/clear/undo", json={"undo_token": first["undo_token"]}).status_code == 200
        time.sleep(1.7)
        error = assert_error(
            api.post("/clear/undo", json={"undo_token": second["undo_token"]}), 409, "undo_token")
        assert error["code"] == "undo_expired"
        wait_for_jobs(proxy)
        assert [f["text"] for f in api.get("/facts").json()["data"]] == ["Ada's badge is 7731."]
        assert db_rows(proxy, "SELECT status FROM clears ORDER BY created_at") == [
            ("restored",), ("purged",)]
        assert db_rows(proxy, "SELECT count(*) FROM clear_records") == [(0,)]


def test_after_the_window_the_memory_is_gone_for_good(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, clear_undo_seconds=1, **QUIET)
    chat(proxy, "The wifi password is hunter2.", session="w")
    wait_for_jobs(proxy)
    with memory_api(proxy) as api:
        token = api.post("/clear").json()["undo_token"]
        assert db_rows(proxy, "SELECT count(*) FROM clear_records")[0][0] > 0
        time.sleep(1.2)
        error = assert_error(api.post("/clear/undo", json={"undo_token": token}), 409, "undo_token")
        assert error["code"] == "undo_expired"
        wait_for_jobs(proxy)
        assert db_rows(proxy, "SELECT status FROM clears") == [("purged",)]
        assert db_rows(proxy, "SELECT count(*) FROM clear_records") == [(0,)]
        assert_error(api.post("/clear/undo", json={"undo_token": token}), 409, "undo_token")
        assert api.get("/stats").json()["counts"]["turns"] == 0


def test_a_restart_inside_the_window_keeps_the_undo(start_proxy: Starter) -> None:
    first = start_proxy(memory=True, clear_undo_seconds=60, **QUIET)
    chat(first, "Our standup is at 9:15.", session="team")
    wait_for_jobs(first)
    with memory_api(first) as api:
        token = api.post("/clear").json()["undo_token"]
    first.stop()
    second = start_proxy(memory=True, clear_undo_seconds=60, **QUIET)
    with memory_api(second) as api:
        assert api.get("/sessions").json()["data"] == []
        assert api.post("/clear/undo", json={"undo_token": token}).status_code == 200
    wait_for_jobs(second)
    second.stop()
    third = start_proxy(memory=True, clear_undo_seconds=60, **QUIET)  # the undo was durable
    with memory_api(third) as api:
        assert [s["session_id"] for s in api.get("/sessions").json()["data"]] == ["team"]
        assert "9:15" in api.post("/search", json={"query": "when is standup?"}).json()["block"]


def test_a_window_that_ends_while_stopped_purges_on_start(start_proxy: Starter) -> None:
    first = start_proxy(memory=True, clear_undo_seconds=1, **QUIET)
    chat(first, "The VPN endpoint is vpn.example.org.", session="net")
    wait_for_jobs(first)
    with memory_api(first) as api:
        token = api.post("/clear").json()["undo_token"]
    first.stop()
    time.sleep(1.2)
    second = start_proxy(memory=True, clear_undo_seconds=1, **QUIET)
    wait_for_jobs(second)
    assert db_rows(second, "SELECT status FROM clears") == [("purged",)]
    assert db_rows(second, "SELECT count(*) FROM clear_records") == [(0,)]
    with memory_api(second) as api:
        assert_error(api.post("/clear/undo", json={"undo_token": token}), 409, "undo_token")
        assert api.get("/stats").json()["counts"]["turns"] == 0


def test_export_streams_lines_for_a_big_memory(memproxy_quiet: RunningProxy) -> None:
    records = [{"type": "turn", "session_id": f"bulk-{i // 50}", "role": "user" if i % 2 == 0 else "assistant",
                "content": f"Bulk message number {i} about subject {i % 7}."} for i in range(600)]
    with memory_api(memproxy_quiet) as api:
        report = api.post("/import", content=body_of(records)).json()
        assert report["added"]["turns"] == 600
        index_jobs = db_rows(memproxy_quiet, "SELECT count(*) FROM jobs WHERE kind = 'index'")[0][0]
        assert index_jobs == 12  # one durable index job per imported batch
        with api.stream("GET", "/export") as response:
            assert response.headers["transfer-encoding"] == "chunked"  # streamed, not buffered
            assert "content-length" not in response.headers
            lines = response.read().split(b"\n")
        assert len([line for line in lines if line]) == 601
    wait_for_jobs(memproxy_quiet, timeout=120)

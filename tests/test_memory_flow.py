"""Memory end to end: the official SDK, memproxy with real storage (SQLite, and PostgreSQL),
the scripted upstream."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import tiktoken

from memory.recall.render import CLOSE, OPEN
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import (
    JSONReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)
from tests.support.sql import query, scalar

pytestmark = pytest.mark.both_backends


def system_text(received: Any) -> str:
    return "\n".join(m["content"] for m in received.json["messages"] if m["role"] == "system")


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True)


def test_a_fact_from_one_session_is_injected_in_another(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(JSONReply(chat_completion("Noted, Postgres 16 with pgvector.")))
    chat(memproxy, [{"role": "user", "content": "Our billing service runs on Postgres 16 with the pgvector extension."}],
         headers={"X-Memory-User-Id": "ada", "X-Memory-Session-Id": "s1"})
    wait_for_jobs(memproxy)
    reply = chat(memproxy, [{"role": "user", "content": "Which database does the billing service use?"}],
               headers={"X-Memory-User-Id": "ada", "X-Memory-Session-Id": "s2"})
    injected = system_text(upstream.history[-1])
    assert OPEN in injected and CLOSE in injected
    assert "Postgres 16 with the pgvector extension" in injected
    assert int(reply.headers["x-memory-items"]) >= 1
    assert int(reply.headers["x-memory-injected-tokens"]) > 0
    assert float(reply.headers["x-memory-recall-ms"]) >= 0
    assert "x-memory-error" not in reply.headers
    wait_for_jobs(memproxy)
    rows = query(memproxy.state.settings, "SELECT session_id, injected_tokens, items_json,"
                 " recall_ms FROM request_metrics WHERE user_id = 'ada' ORDER BY id")
    assert [r[0] for r in rows] == ["s1", "s2"]  # one row per request
    assert rows[1][1] == int(reply.headers["x-memory-injected-tokens"]) and rows[1][3] is not None


def test_resent_history_is_stored_once_and_replies_are_stored(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(4):
        history.append({"role": "user", "content": f"question number {i}"})
        if i % 2:
            upstream.enqueue(SSEReply(chat_chunks(f"streamed answer {i}", split=3)))
            reply = chat(memproxy, history, stream=True).text
        else:
            reply = chat(memproxy, history).text
        history.append({"role": "assistant", "content": reply})
        wait_for_jobs(memproxy)
    again = chat(memproxy, history)  # the whole history once more: only its reply is new
    history.append({"role": "assistant", "content": again.text})
    wait_for_jobs(memproxy)
    rows = query(memproxy.state.settings, "SELECT role, content, incomplete FROM turns ORDER BY id")
    assert [(r, c) for r, c, _ in rows] == [(m["role"], m["content"]) for m in history[1:]]
    assert "streamed answer 1" in [c for _, c, _ in rows]
    assert all(flag == 0 for _, _, flag in rows)


def test_budget_holds_exactly_from_50_to_4000_tokens(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    topics = ["deploy pipeline", "kubernetes cluster", "database migration", "cache layer"]
    for i in range(24):
        text = (f"Note {i} about the {topics[i % 4]}: " + "we changed the retry policy, the "
                "timeouts and the alerting thresholds after the incident review. " * 6)
        chat(memproxy, [{"role": "user", "content": text}],
             session=f"long-{i}")
    wait_for_jobs(memproxy, timeout=60)
    encoding = tiktoken.get_encoding("o200k_base")  # gpt-4o
    http = httpx.Client(base_url=memproxy.url, timeout=30)
    for budget in (50, 120, 250, 500, 1000, 2000, 4000):
        result = http.post("/v1/chat/completions", headers={
            "X-Memory-Dry-Run": "on", "X-Memory-Budget": str(budget),
            "X-Memory-Session-Id": "question"},
            json={"model": "gpt-4o", "messages": [
                {"role": "user", "content": "what did we change in the deploy pipeline and cache layer?"}]},
        ).json()
        assert len(encoding.encode(result["block"])) == result["tokens"] <= budget
        if budget >= 250:
            assert result["items"], budget
    http.close()


def test_users_never_see_each_other(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    chat(memproxy, [{"role": "user", "content": "My locker code is 4471 and my cat is Miso."}],
         headers={"X-Memory-User-Id": "alice"})
    wait_for_jobs(memproxy)
    for user in ("bob", "alice "[:-1] + "_", "default"):
        chat(memproxy, [{"role": "user", "content": "What is my locker code and my cat's name?"}],
             headers={"X-Memory-User-Id": user})
        assert "4471" not in system_text(upstream.history[-1])
    chat(memproxy, [{"role": "user", "content": "What is my locker code and my cat's name?"}],
         headers={"X-Memory-User-Id": "alice", "X-Memory-Session-Id": "later"})
    assert "4471" in system_text(upstream.history[-1])


def test_placement_last_user_keeps_the_prefix(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    chat(memproxy, [{"role": "user", "content": "The staging cluster is called aurora-west."}])
    wait_for_jobs(memproxy)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "What is the staging cluster called?"}]
    chat(memproxy, messages, headers={"X-Memory-Placement": "last_user"})
    sent = upstream.history[-1].json["messages"]
    assert sent[:3] == messages[:3]
    assert sent[3]["role"] == "system" and "aurora-west" in sent[3]["content"]
    assert sent[4] == messages[3]


def test_switches_do_exactly_what_they_say(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    chat(memproxy, [{"role": "user", "content": "The launch codename is BLUE HERON."}])
    wait_for_jobs(memproxy)
    ask = [{"role": "user", "content": "What is the launch codename?"}]

    def turns() -> int:
        wait_for_jobs(memproxy)
        return int(scalar(memproxy.state.settings, "SELECT count(*) FROM turns"))

    before = turns()
    reply = chat(memproxy, ask, headers={"X-Memory": "off"})
    assert upstream.history[-1].body and "BLUE HERON" not in upstream.history[-1].body.decode()
    assert "x-memory-items" not in reply.headers and turns() == before
    chat(memproxy, ask, headers={"X-Memory-Read": "off"})
    assert "BLUE HERON" not in upstream.history[-1].body.decode()
    assert turns() == before + 2  # question and reply stored
    ask2 = [{"role": "user", "content": "Remind me: what is the launch codename?"}]
    chat(memproxy, ask2, headers={"X-Memory-Write": "off"})
    assert "BLUE HERON" in system_text(upstream.history[-1])
    assert turns() == before + 2


def test_recall_failure_degrades_but_the_chat_goes_through(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    memproxy.state.memory.vectors.close()  # the vector store becomes unavailable
    reply = chat(memproxy, [{"role": "user", "content": "What did we decide about the schema?"}])
    assert reply.status == 200
    assert reply.headers["x-memory-error"].startswith("recall:")
    assert reply.text.startswith("echo:")
    ready = httpx.get(f"{memproxy.url}/readyz")
    assert ready.status_code == 503 and ready.json()["parts"]["vectors"] != "ok"


async def test_queued_and_interrupted_jobs_survive_a_restart(
    make_settings: Callable[..., Any], start_proxy: Callable[..., RunningProxy]
) -> None:
    from memory.storage.turns import NewTurn
    from tests.support.storage import Storage

    settings = make_settings()
    store = await Storage.open(settings.db_path, url=settings.database_url)
    first = await store.log.append_turns("ada", "before-restart", [
        NewTurn("user", "The on-call rotation moved to Thursdays."),
    ])
    second = await store.log.append_turns("ada", "before-restart", [
        NewTurn("user", "Grafana dashboards live in the ops-observability repo."),
    ], after=first.last_id)
    assert first.job_id and second.job_id
    # A crash while the second job ran: it is still marked running.
    await store.queue.claim(None, limit=1, now=time.time() + 1)
    if store.db.dialect == "postgres":  # and long enough ago that its lease has ended
        async with store.db.write() as tx:
            await tx.change("UPDATE jobs SET lease_until = 0 WHERE status = 'running'")
    await store.close()
    states = dict(query(settings, "SELECT id, status FROM jobs"))
    assert sorted(states.values()) == ["queued", "running"]

    proxy = start_proxy(memory=True)
    wait_for_jobs(proxy)
    assert {s for (s,) in query(settings, "SELECT status FROM jobs")} == {"done"}
    assert scalar(settings, "SELECT count(*) FROM chunks") == 2
    async with httpx.AsyncClient(base_url=proxy.base_url) as http:
        for question, expected in [("When is the on-call rotation?", "Thursdays"),
                                   ("Where are the Grafana dashboards?", "ops-observability")]:
            response = await http.post("/chat/completions", headers={
                "X-Memory-Dry-Run": "on", "X-Memory-User-Id": "ada"},
                json={"model": "gpt-4o", "messages": [{"role": "user", "content": question}]})
            assert expected in response.json()["block"]


def test_upstream_embedding_backend(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> None:
    proxy = start_proxy(memory=True, embedding_backend="upstream", upstream_api_key="sk-operator")
    chat(proxy, [{"role": "user", "content": "The nightly backup job writes to bucket zeta-archive."}])
    wait_for_jobs(proxy)
    embedded = [r for r in upstream.history if r.path == "/v1/embeddings"]
    assert embedded and embedded[0].headers["authorization"] == "Bearer sk-operator"
    assert embedded[0].json["model"] == "text-embedding-3-small"
    chat(proxy, [{"role": "user", "content": "Which bucket does the nightly backup job write to?"}],
         headers={"X-Memory-Session-Id": "other"})
    asked = [r for r in upstream.history if r.path == "/v1/chat/completions"][-1]
    assert "zeta-archive" in system_text(asked)


def test_a_long_query_is_embedded_clipped_and_searched_whole(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, embedding_backend="upstream", upstream_api_key="sk-operator")
    chat(proxy, [{"role": "user", "content": "The kestrel-9 migration moved billing to Postgres."}])
    wait_for_jobs(proxy)
    pasted = " ".join(f"row{i}" for i in range(200))
    question = f"Look at this log:\n{pasted} kestrel-9 {pasted}\nWhat went wrong here?"
    chat(proxy, [{"role": "user", "content": question}], headers={"X-Memory-Session-Id": "other"})
    embedded = [r for r in upstream.history if r.path == "/v1/embeddings"][-1].json["input"]
    query = embedded if isinstance(embedded, str) else embedded[0]
    assert len(query.split()) == 32 and query.endswith("What went wrong here?")
    assert "kestrel-9" not in query  # cut from the embedded query, yet the lexical search finds it:
    asked = [r for r in upstream.history if r.path == "/v1/chat/completions"][-1]
    assert "moved billing to Postgres" in system_text(asked)


async def test_metrics_rows_are_pruned_after_retention(make_settings: Callable[..., Any], embedder: Any) -> None:
    from memory.engine import MemoryEngine
    from memory.storage.metrics import RequestMetrics

    engine = await MemoryEngine.open(make_settings(metrics_retention_days=30), embedder=embedder)
    try:
        now = time.time()
        for age_days in (0, 29, 31, 400):
            await engine.record(RequestMetrics("ada", created_at=now - age_days * 86400))
        # The engine's own maintenance prunes once at the start too, and may come first.
        await engine.prune(now)
        ages = query(engine.settings, "SELECT created_at FROM request_metrics ORDER BY created_at")
        assert [round((now - created) / 86400) for (created,) in ages] == [29, 0]
    finally:
        await engine.close()

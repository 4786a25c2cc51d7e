"""The durable local spool (issue 28): turns answered while PostgreSQL is down wait in
data_dir/spool.sqlite3 and are replayed into the database, each once, when it is back;
/readyz and /metrics say so; past MEMPROXY_SPOOL_MAX_TURNS a request that would store turns
is refused with 503 in its format's envelope before it is forwarded. A real PostgreSQL of the
test's own, stopped and started; the real app on a uvicorn socket; the official SDK."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from config import Settings
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.servers import PostgresServer
from tests.support.sql import query

FAST = {"job_backoff_seconds": 0.05, "job_outage_backoff_max_seconds": 0.3}


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own: stopping it touches no other test's database."""
    with PostgresServer() as server:
        yield server


@pytest.fixture
def start_proxy(
    postgres: PostgresServer, start_proxy: Callable[..., RunningProxy]
) -> Iterator[Callable[..., RunningProxy]]:
    """conftest's start_proxy, its proxies stopped before this test's PostgreSQL is: stopped
    after it, a proxy waited out its whole shutdown grace (4-5 s) on index jobs that could
    no longer reach the database."""
    started: list[RunningProxy] = []

    def start(**changes: Any) -> RunningProxy:
        started.append(start_proxy(**changes))
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


def drained(proxy: RunningProxy, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while proxy.state.memory.spool_status()[0]:
        assert time.monotonic() < deadline, "the spool was not replayed"
        time.sleep(0.05)


def readiness(proxy: RunningProxy) -> dict[str, Any]:
    return dict(httpx.get(f"{proxy.url}/readyz", timeout=30).json())


def metric(proxy: RunningProxy, name: str) -> float:
    for line in httpx.get(f"{proxy.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def test_turns_answered_while_postgresql_is_down_are_spooled_then_stored_once(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer,
) -> None:
    proxy = start_proxy(memory=True, database_url=postgres.create_database(), **FAST)
    settings: Settings = proxy.state.settings
    history: list[dict[str, str]] = []

    def say(text: str, *, stream: bool = False) -> None:
        history.append({"role": "user", "content": text})
        reply = chat(proxy, history, session="s1", user="ada", stream=stream)
        assert reply.status == 200 and reply.text == f"echo: {text}"
        history.append({"role": "assistant", "content": reply.text})

    say("The deploy key lives in vault path ops/deploy.")
    wait_for_jobs(proxy)
    postgres.stop()
    try:
        say("The staging cluster is called kestrel.")
        say("Backups run at 02:00 UTC.", stream=True)
        say("The on-call rotation changes on Mondays.")
        time.sleep(0.3)  # the last reply is stored just after its response
        depth = proxy.state.memory.spool_status()[0]
        # Each turn of the session counted once: the 6 said during the outage, and the 2
        # resent from before it (the spool cannot ask the database which it holds).
        assert depth == 8, depth
        assert readiness(proxy)["parts"]["database"] == "database unreachable, spooling 8 turns"
        assert metric(proxy, "memproxy_spool_turns") == 8
        assert metric(proxy, "memproxy_spool_oldest_seconds") > 0
    finally:
        postgres.start()
    drained(proxy)
    counts = wait_for_jobs(proxy, later=True)
    assert set(counts) == {"done"}, counts
    stored = query(settings, "SELECT role, content FROM turns WHERE user_id = 'ada' ORDER BY id")
    assert stored == [(m["role"], m["content"]) for m in history]  # each once, in order
    assert metric(proxy, "memproxy_spool_turns") == 0
    assert readiness(proxy)["status"] == "ok"
    # Every replayed turn was indexed: found by meaning.
    dry = httpx.post(f"{proxy.base_url}/chat/completions", timeout=30, headers={
        "X-Memory-User-Id": "ada", "X-Memory-Dry-Run": "on", "X-Memory-Write": "off",
    }, json={"model": "gpt-4o", "messages": [
        {"role": "user", "content": "When do the backups run?"}]})
    assert "Backups run at 02:00 UTC." in dry.json()["block"]


def test_a_full_spool_refuses_new_turns_with_503_in_each_formats_envelope(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer, upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, database_url=postgres.create_database(),
                        spool_max_turns=4, **FAST)
    settings: Settings = proxy.state.settings
    postgres.stop()
    try:
        first = chat(proxy, "The build farm runs on arm64.", session="s1", user="bo")
        second = chat(proxy, "The build farm has 12 runners.", session="s2", user="bo")
        assert first.status == second.status == 200
        time.sleep(0.3)
        assert proxy.state.memory.spool_status()[0] == 4  # the bound, never past it
        forwarded = len(upstream.history)
        headers = {"X-Memory-User-Id": "bo", "authorization": "Bearer sk-test"}
        chat_reply = httpx.post(f"{proxy.base_url}/chat/completions", headers=headers, json={
            "model": "gpt-4o", "messages": [{"role": "user", "content": "Anything?"}]}, timeout=30)
        assert chat_reply.status_code == 503
        error = chat_reply.json()["error"]
        assert error["code"] == "memory_unavailable" and "spool is full" in error["message"]
        streamed = httpx.post(f"{proxy.base_url}/chat/completions", headers=headers, json={
            "model": "gpt-4o", "stream": True,
            "messages": [{"role": "user", "content": "Anything?"}]}, timeout=30)
        assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "memory_unavailable"
        messages = httpx.post(f"{proxy.base_url}/messages", headers={**headers, "x-api-key": "sk"},
                              json={"model": "claude-3-5-sonnet", "max_tokens": 10, "messages": [
                                  {"role": "user", "content": "Anything?"}]}, timeout=30)
        assert messages.status_code == 503
        assert messages.json()["type"] == "error" and "spool is full" in messages.json()["error"]["message"]
        responses = httpx.post(f"{proxy.base_url}/responses", headers=headers, json={
            "model": "gpt-4o", "input": "Anything?"}, timeout=30)
        assert responses.status_code == 503 and "spool is full" in responses.json()["error"]["message"]
        assert len(upstream.history) == forwarded  # refused before anything went upstream
        # A request that stores nothing is still answered.
        unwritten = chat(proxy, "Anything?", user="bo", headers={"X-Memory-Write": "off"})
        assert unwritten.status == 200
    finally:
        postgres.start()
    drained(proxy)
    assert chat(proxy, "The build farm moved to Frankfurt.", session="s3", user="bo").status == 200
    wait_for_jobs(proxy, later=True)
    stored = query(settings, "SELECT session_id, content FROM turns WHERE user_id = 'bo'"
                             " AND role = 'user' ORDER BY id")
    assert stored == [("s1", "The build farm runs on arm64."), ("s2", "The build farm has 12 runners."),
                      ("s3", "The build farm moved to Frankfurt.")]


def test_the_spool_survives_a_restart_of_memproxy(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer,
) -> None:
    url = postgres.create_database()
    proxy = start_proxy(memory=True, database_url=url, **FAST)
    settings: Settings = proxy.state.settings
    postgres.stop()
    try:
        assert chat(proxy, "The VPN gateway is vpn2.", session="s1", user="cy").status == 200
        time.sleep(0.3)
        assert proxy.state.memory.spool_status()[0] == 2
        proxy.stop()  # its spool stays in the data directory
    finally:
        postgres.start()
    again = start_proxy(memory=True, database_url=url, **FAST)
    drained(again)
    wait_for_jobs(again, later=True)
    assert query(settings, "SELECT role, content FROM turns ORDER BY id") == [
        ("user", "The VPN gateway is vpn2."), ("assistant", "echo: The VPN gateway is vpn2.")]


def _sent_block(upstream: ScriptedUpstream) -> str:
    """The memory block of the last request that reached the upstream ("" without one)."""
    sent = upstream.history[-1].json["messages"]
    return "\n".join(str(m.get("content")) for m in sent if "<memory>" in str(m.get("content")))


def test_recall_reads_the_sessions_spooled_turns_while_the_database_is_down(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer, upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, database_url=postgres.create_database(), **FAST)
    fact = "My locker code at the north gym is 4417."
    question = "What is my locker code at the north gym?"
    postgres.stop()
    try:
        assert chat(proxy, fact, session="s1", user="ada").status == 200
        time.sleep(0.3)  # the reply is spooled just after the response
        # A client that trims its history: turn 1 is not sent again.
        asked = chat(proxy, question, session="s1", user="ada")
        assert asked.status == 200 and asked.text == f"echo: {question}"
        assert fact in _sent_block(upstream)
        assert "recall" in asked.headers["x-memory-error"]  # the outage is still reported
        streamed = chat(proxy, question, session="s1", user="ada", stream=True)
        assert streamed.status == 200 and fact in _sent_block(upstream)
        # Never another user's, nor another session's, even under the same session id.
        for user, session in (("bo", "s1"), ("ada", "s2")):
            other = chat(proxy, question, session=session, user=user)
            assert other.status == 200 and "4417" not in _sent_block(upstream), (user, session)
        # Text the request holds already is not repeated.
        resent = chat(proxy, [{"role": "user", "content": fact},
                              {"role": "assistant", "content": f"echo: {fact}"},
                              {"role": "user", "content": question}], session="s1", user="ada")
        assert resent.status == 200 and fact not in _sent_block(upstream)
    finally:
        postgres.start()
    drained(proxy)


def test_recall_adds_the_sessions_spooled_turns_while_the_database_answers_but_lacks_them(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer, upstream: ScriptedUpstream,
) -> None:
    url = postgres.create_database()
    # The replay retries an outage 0.2, 0.4, 0.8 ... 6.4 s apart (this cap is far off).
    proxy = start_proxy(memory=True, database_url=url, job_backoff_seconds=0.05,
                        job_outage_backoff_max_seconds=60)
    settings: Settings = proxy.state.settings
    stored = "The north site's staging cluster is called kestrel."
    spooled = "The north site's gym locker code is 4417."
    assert chat(proxy, stored, session="s1", user="ada").status == 200
    wait_for_jobs(proxy)
    postgres.stop()
    try:
        assert chat(proxy, spooled, session="s1", user="ada").status == 200
        time.sleep(7.0)  # the replay is in its sleep from about 6.2 s to 12.6 s
    finally:
        postgres.start()
    # Writes of turns wait behind this lock, reads go on: the database answers, and the
    # spool is not replayed yet.
    holder = subprocess.Popen(
        [str(postgres.bin / "psql"), url, "-q", "-c",
         "BEGIN; LOCK TABLE turns IN EXCLUSIVE MODE; SELECT pg_sleep(6); COMMIT;"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not query(settings, "SELECT 1 FROM pg_locks WHERE mode = 'ExclusiveLock'"
                                  " AND granted AND relation = 'turns'::regclass"):
            assert time.monotonic() < deadline, "the lock was not taken"
            time.sleep(0.05)
        assert proxy.state.memory.spool_status()[0] == 2, "replayed before the lock was taken"
        asked = chat(proxy, "What are the north site's cluster name and gym locker code?",
                     session="s1", user="ada")
        assert asked.status == 200 and "x-memory-error" not in asked.headers, asked.headers
        block = _sent_block(upstream)
        assert stored in block and spooled in block, block
        other = chat(proxy, "What is the north site's gym locker code?", session="s1", user="bo")
        assert other.status == 200 and "4417" not in _sent_block(upstream)
    finally:
        holder.wait(30)
    drained(proxy)

"""One user cannot fill the spool for everyone (issue 37, item 6).

Actor: a user (or a client of one key) chatting while the database is down. Asset: every
other user's chats during the outage. A request's own turns are checked against the room
left, and each user holds at most MEMPROXY_SPOOL_MAX_TURNS_PER_USER of the spool: a request
too big for it is answered and not remembered (X-Memory-Error), a user whose share is full
gets 503, and other users go on being answered and remembered. A real PostgreSQL of the
test's own, stopped and started; the real app on a uvicorn socket; the official SDK.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from tests import test_spool
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.servers import PostgresServer
from tests.support.sql import query
from tests.test_spool import FAST, drained

# The spool's own fixtures: a PostgreSQL of this test's own, and proxies stopped before it.
postgres = test_spool.postgres
start_proxy = test_spool.start_proxy

SECRET = "mp-0badc0de_" + "Q7x" * 15  # a memproxy key: the spool holds it redacted


def history(n: int, tag: str) -> list[dict[str, str]]:
    """A conversation of `n` messages ending with a user message."""
    roles = ["user", "assistant"]
    return [{"role": roles[(n - 1 - i) % 2], "content": f"{tag} message {i}"} for i in range(n)]


def depth(proxy: RunningProxy) -> int:
    return int(proxy.state.memory.spool_status()[0])


@pytest.mark.parametrize("stream", [False, True])
def test_one_huge_request_does_not_fill_the_spool_for_everyone(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer, stream: bool,
) -> None:
    proxy = start_proxy(memory=True, database_url=postgres.create_database(),
                        spool_max_turns=50, spool_max_turns_per_user=10, **FAST)
    postgres.stop()
    try:
        # More turns than the whole spool: answered, not remembered, and said so.
        huge = chat(proxy, history(61, "flood"), user="mallory", session="flood", stream=stream)
        assert huge.status == 200 and huge.text.startswith("echo: ")
        time.sleep(0.3)
        # Its turns were refused before the reply started: a stream says so too.
        assert "remember: SpoolFull" in huge.headers["x-memory-error"]
        assert depth(proxy) == 0
        # Everyone else is still answered, and remembered.
        for user in ("alice", "bob", "carol"):
            said = chat(proxy, f"{user} keeps the key {SECRET} in the vault", user=user,
                        session="s1")
            assert said.status == 200, user
        time.sleep(0.3)
        assert depth(proxy) == 6
        spool = proxy.state.settings.spool_path
        assert SECRET.encode() not in b"".join(
            p.read_bytes() for p in spool.parent.glob(spool.name + "*"))
    finally:
        postgres.start()
    drained(proxy)
    wait_for_jobs(proxy, later=True)
    stored = query(proxy.state.settings, "SELECT DISTINCT user_id FROM turns ORDER BY user_id")
    assert stored == [("alice",), ("bob",), ("carol",)]


def test_a_user_past_their_share_gets_503_and_the_others_do_not(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer,
) -> None:
    proxy = start_proxy(memory=True, database_url=postgres.create_database(),
                        spool_max_turns=50, spool_max_turns_per_user=6, **FAST)
    postgres.stop()
    try:
        # A request bigger than what is left of the share, though not of the spool.
        assert chat(proxy, history(9, "big"), user="mallory", session="big").status == 200
        for i in range(3):  # two turns each: the share of six is full
            said = chat(proxy, f"mallory note {i}", user="mallory", session=f"m{i}")
            assert said.status == 200 and "SpoolFull" not in said.headers.get("x-memory-error", "")
            time.sleep(0.2)
        assert proxy.state.memory.spool_status()[0] == 6
        refused = httpx.post(f"{proxy.base_url}/chat/completions", timeout=30, headers={
            "X-Memory-User-Id": "mallory", "authorization": "Bearer sk-test"}, json={
            "model": "gpt-4o", "messages": [{"role": "user", "content": "one more"}]})
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] == "memory_unavailable" and "spool is full" in error["message"]
        unwritten = chat(proxy, "one more", user="mallory", headers={"X-Memory-Write": "off"})
        assert unwritten.status == 200
        for user in ("alice", "bob"):
            said = chat(proxy, f"{user} says hello", user=user, session="s1")
            assert said.status == 200 and "SpoolFull" not in said.headers.get("x-memory-error", "")
        time.sleep(0.3)
        assert proxy.state.memory.spool_status()[0] == 10
    finally:
        postgres.start()
    drained(proxy)
    wait_for_jobs(proxy, later=True)
    users = query(proxy.state.settings, "SELECT user_id, count(*) FROM turns GROUP BY user_id"
                                        " ORDER BY user_id")
    assert users == [("alice", 2), ("bob", 2), ("mallory", 6)]

"""The helpers the tests share (tests/support): waiting for jobs, one chat completion."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import ScriptedUpstream, SSEReply, chat_chunks
from tests.support.storage import Storage


async def test_wait_for_jobs_counts_statuses_and_names_what_is_still_pending(
    tmp_path: Path,
) -> None:
    db_path = tmp_path / "memproxy.db"
    store = await Storage.open(db_path)
    try:
        await store.queue.enqueue("index", {"turn_ids": [1]})
        (claimed,) = await store.queue.claim(None, limit=1, now=time.time())
        await store.queue.complete(claimed)
        await store.queue.enqueue("settle_clear", {"clear_id": "x"}, run_after=time.time() + 3600)
        # Only a job due later is pending: it counts only when asked for.
        assert wait_for_jobs(db_path, timeout=5) == {"done": 1, "queued": 1}
        with pytest.raises(TimeoutError, match="settle_clear"):
            wait_for_jobs(db_path, later=True, timeout=0.3)
        await store.queue.enqueue("extract", {"turn_id": 7})  # due now
        with pytest.raises(TimeoutError, match="extract"):
            wait_for_jobs(db_path, timeout=0.3)
    finally:
        await store.close()


def test_wait_for_jobs_waits_for_the_replies_stored_after_a_response(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True)
    upstream.enqueue(SSEReply(chat_chunks("streamed and stored", split=3)))
    reply = chat(proxy, "Store this reply, please.", session="w", stream=True)
    assert reply.text == "streamed and stored"
    counts = wait_for_jobs(proxy)
    assert counts == {"done": 2}  # the question's index job and the reply's
    with closing(sqlite3.connect(proxy.state.settings.db_path)) as conn:
        stored = conn.execute("SELECT role, content FROM turns ORDER BY id").fetchall()
    assert stored == [("user", "Store this reply, please."), ("assistant", "streamed and stored")]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_sends_identity_headers_and_returns_text_and_headers(
    proxy: RunningProxy, upstream: ScriptedUpstream, stream: bool
) -> None:
    reply = chat(proxy, [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hello there"}],
                 user="ada", session="s9", headers={"X-Trace": "t1"}, stream=stream)
    assert reply.status == 200 and reply.text == "echo: hello there"
    assert reply.model == "gpt-4o" and reply.headers["x-memory-session-id"] == "s9"
    received = upstream.history[-1]
    assert received.headers["x-trace"] == "t1" and received.json.get("stream", False) is stream
    assert received.json["messages"][0] == {"role": "system", "content": "be brief"}

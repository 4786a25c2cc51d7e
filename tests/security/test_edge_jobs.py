"""What one request may cost the shared background queue (issue 21, item 5), on both backends:
a huge turn is indexed up to a cap (stored whole), and one user's backlog does not starve
another user's jobs."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from memory.log.turn_log import INDEX_JOB
from memory.storage.jobs import FAIR_STEP
from memory.storage.turns import NewTurn
from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET, Starter, db_rows
from tests.support.storage import Storage

pytestmark = pytest.mark.both_backends

SECRET = "The launch code for project Bluefin is heliotrope seventeen."
TAIL = "The tail of this message mentions the zeppelin harbour of Quillmouth."
WORDS = ("ledger invoice river candle harvest window meadow copper lantern orchard thunder "
         "biscuit granite velvet compass saddle marble pepper falcon walnut").split()


def huge_message(size: int) -> str:
    """About `size` characters of paragraphs of ordinary words, SECRET first and TAIL last."""
    rng = random.Random(7)
    paragraphs = [SECRET]
    while sum(len(p) for p in paragraphs) < size:
        paragraphs.append(" ".join(
            " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "."
            for _ in range(5)))
    return "\n\n".join([*paragraphs, TAIL])


def chunks_of(proxy: RunningProxy, content_like: str) -> tuple[int, int]:
    """(stored length, chunk count) of the one turn whose content starts like this."""
    [(turn_id, length)] = db_rows(proxy, "SELECT id, LENGTH(content) FROM turns WHERE"
                                         " content LIKE ?", (content_like + "%",))
    [(count,)] = db_rows(proxy, "SELECT COUNT(*) FROM chunks WHERE turn_id = ?", (turn_id,))
    return int(length), int(count)


def test_a_huge_turn_is_stored_whole_and_indexed_up_to_the_cap(
    start_proxy: Starter, backend: str,
) -> None:
    # A cap of 10 rather than the default 100: the same cut, a tenth of the embedding work.
    proxy = start_proxy(memory=True, index_max_chunks_per_turn=10, **QUIET)
    cap = proxy.state.settings.index_max_chunks_per_turn
    message = huge_message(160_000)  # about 40,000 tokens: 200 chunks of 200 without a cap
    with httpx.Client(base_url=proxy.url, timeout=120) as http:
        reply = http.post("/v1/chat/completions", headers={"X-Memory-Session-Id": "huge"},
                          json={"model": "gpt-4o-mini",
                                "messages": [{"role": "user", "content": message}]})
        assert reply.status_code == 200, reply.text
        wait_for_jobs(proxy, timeout=300)
        length, chunks = chunks_of(proxy, SECRET)
        assert length == len(message)  # the turn itself is kept whole
        assert 0 < chunks <= cap
        # Its indexed part is found by words and by meaning; the turn comes back whole.
        search: dict[str, Any] = http.post("/v1/memory/search", json={
            "query": "What is the launch code for project Bluefin?"}).json()
        assert "heliotrope" in search["block"], search
        turns = http.get("/v1/memory/turns", params={"session_id": "huge"}).json()["data"]
        assert any(t["content"] == message for t in turns)


async def test_one_user_s_backlog_does_not_starve_another_user(
    tmp_path: Path, database_url: str | None,
) -> None:
    store = await Storage.open(tmp_path / "memory.db", url=database_url)
    try:
        # A queues 200 index jobs (a script pasting turns), then B chats once.
        began = time.time()
        for n in range(200):
            await store.log.append_turns("user-a", f"s{n}", [NewTurn("user", f"turn {n}")],
                                         job_kind=INDEX_JOB)
        done = await store.log.append_turns("user-b", "s", [NewTurn("user", "hello")],
                                            job_kind=INDEX_JOB)
        # A's jobs go FAIR_STEP apart from its first, B's job at once: it is ahead of all of
        # A's but the few queued in the time this machine took (two on a quick one). Without
        # the fair order it would be 201st.
        ahead = int((time.time() - began) / FAIR_STEP) + 2
        order = []
        for _ in range(ahead + 2):
            [job] = await store.queue.claim(None, 1, time.time())
            order.append(job.id)
            assert await store.queue.complete(job)
        assert ahead < 20 and done.job_id in order[:ahead + 1], (ahead, order)
        # The rest of A's backlog still runs, oldest first.
        rest = await store.queue.claim(None, 500, time.time())
        assert len(rest) == 200 - (ahead + 1)
        assert [job.id for job in rest] == sorted(job.id for job in rest)
    finally:
        await store.close()

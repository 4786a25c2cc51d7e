"""Store: exactly-once turn logging, chunks and full-text search, the job queue, metrics;
on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any, cast

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.storage import metrics, migrations, versions
from memory.storage.fts import match_expression
from memory.storage.jobs import LEASE_SECONDS
from memory.storage.metrics import RequestMetrics
from memory.storage.postgres import numbered
from memory.storage.turns import NewTurn
from tests.support.sql import POSTINGS_FROM_ROWS
from tests.support.storage import Storage

HISTORY = [
    NewTurn("system", "You are a helpful assistant."),
    NewTurn("user", "My cat is called Miso."),
    NewTurn("assistant", "Miso is a lovely name for a cat!"),
    NewTurn("user", "What should I feed her?"),
]


pytestmark = pytest.mark.both_backends


@pytest.fixture
async def store(tmp_path: Path, database_url: str | None) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "memory.db", url=database_url)
    yield store
    await store.close()


async def query_db(store: Storage, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Read the tables directly, as an operator with a SQL shell would."""
    return [tuple(row) for row in await store.db.fetch(sql, params)]


async def write_db(store: Storage, sql: str, params: Sequence[Any] = ()) -> None:
    async with store.db.write() as tx:
        await tx.change(sql, params)


async def fts_is_consistent(store: Storage) -> bool:
    """FTS5's own integrity check; on PostgreSQL, every row's words and the counts BM25
    reads match the text."""
    if store.db.dialect == "postgres":
        stale = await query_db(store, "SELECT COUNT(*) FROM chunks WHERE tsv <>"
                               " setweight(memproxy_words(text), 'A')"
                               " || setweight(memproxy_words(speaker), 'B')")
        totals = await query_db(store, "SELECT docs, tokens FROM fts_totals WHERE name = 'chunks'")
        actual = await query_db(store, "SELECT COUNT(*), COALESCE(SUM(doc_len), 0) FROM chunks")
        terms = await query_db(store, "SELECT lexeme, docs FROM fts_terms"
                               " WHERE name = 'chunks' AND docs > 0 ORDER BY lexeme")
        counted = await query_db(store, "SELECT lexeme, COUNT(*) FROM chunks,"
                                 " unnest(tsvector_to_array(tsv)) AS lexeme GROUP BY lexeme ORDER BY lexeme")
        postings = await query_db(store, "SELECT * FROM chunk_terms ORDER BY 1, 2, 3")
        recounted = await query_db(store, POSTINGS_FROM_ROWS + " ORDER BY 1, 2, 3")
        return (stale == [(0,)] and totals == actual and terms == counted
                and postings == recounted and len(postings) == sum(n for _, n in counted))
    try:
        await write_db(store, "INSERT INTO chunks_fts (chunks_fts) VALUES ('integrity-check')")
    except sqlite3.DatabaseError:
        return False
    return True


async def add_turn_with_text(store: Storage, user: str, session: str, *texts: str) -> list[int]:
    result = await store.log.append_turns(user, session, [NewTurn("user", " ".join(texts))])
    assert result.last_id is not None
    return await store.log.add_chunks(
        result.last_id, [(i, "prose", text, 5) for i, text in enumerate(texts)]
    )


# -- exactly-once logging ------------------------------------------------------------------


async def test_resending_the_same_history_stores_each_turn_once(store: Storage) -> None:
    results = [await store.log.append_turns("alice", "s1", HISTORY) for _ in range(5)]

    assert len(results[0].new_ids) == 4
    assert all(r.new_ids == [] for r in results[1:])
    assert {r.last_id for r in results} == {results[0].new_ids[-1]}
    assert await store.log.count_turns("alice") == 4
    assert await query_db(store, "SELECT turn_count FROM sessions") == [(4,)]


async def test_turns_form_a_path(store: Storage) -> None:
    result = await store.log.append_turns("alice", "s1", HISTORY)

    turns = await store.log.session_turns("alice", "s1")
    assert [t.id for t in turns] == result.new_ids
    assert [t.position for t in turns] == [0, 1, 2, 3]
    assert [t.parent_id for t in turns] == [None, *result.new_ids[:-1]]
    assert turns[1].content == "My cat is called Miso."


async def test_a_growing_history_appends_only_the_new_tail(store: Storage) -> None:
    first = await store.log.append_turns("alice", "s1", HISTORY[:2])
    second = await store.log.append_turns("alice", "s1", HISTORY)

    assert len(second.new_ids) == 2
    added = await store.log.get_turns(second.new_ids)
    assert [t.role for t in added] == ["assistant", "user"]
    assert added[0].parent_id == first.last_id
    assert await query_db(store, "SELECT turn_count FROM sessions") == [(4,)]


async def test_whitespace_and_line_endings_do_not_make_a_new_turn(store: Storage) -> None:
    await store.log.append_turns("alice", "s1", [NewTurn("user", "line one\nline two")])
    again = await store.log.append_turns("alice", "s1", [NewTurn("user", "  line one\r\nline two\n")])
    assert again.new_ids == []


async def test_an_edited_message_branches_without_losing_anything(store: Storage) -> None:
    original = await store.log.append_turns("alice", "s1", HISTORY)
    edited = [*HISTORY[:3], NewTurn("user", "What toys does she like?")]

    branch = await store.log.append_turns("alice", "s1", edited)

    assert len(branch.new_ids) == 1
    (new_turn,) = await store.log.get_turns(branch.new_ids)
    assert new_turn.parent_id == original.new_ids[2]
    assert new_turn.position == 3
    assert branch.last_id == new_turn.id
    assert await store.log.count_turns() == 5
    assert len(await store.log.session_turns("alice", "s1")) == 5


async def test_the_reply_appended_after_last_id_is_not_duplicated_by_the_next_resend(
    store: Storage,
) -> None:
    request = await store.log.append_turns("alice", "s1", HISTORY)
    reply = NewTurn("assistant", "Cat food, mostly.", model="gpt-4o", incomplete=True)
    stored = await store.log.append_turns("alice", "s1", [reply], after=request.last_id)

    resend = await store.log.append_turns("alice", "s1", [*HISTORY, reply, NewTurn("user", "Thanks")])

    assert len(resend.new_ids) == 1
    (turn,) = await store.log.get_turns(stored.new_ids)
    assert (turn.model, turn.incomplete, turn.position) == ("gpt-4o", True, 4)


async def test_after_must_be_a_turn_of_the_same_session(store: Storage) -> None:
    other = await store.log.append_turns("bob", "s1", HISTORY[:1])
    with pytest.raises(LookupError):
        await store.log.append_turns("alice", "s1", HISTORY[1:], after=other.last_id)
    with pytest.raises(LookupError):
        await store.log.append_turns("alice", "s1", HISTORY[1:], after=999)
    assert await store.log.count_turns("alice") == 0


async def test_the_same_text_in_other_users_and_sessions_is_stored_separately(
    store: Storage,
) -> None:
    for user, session in [("alice", "s1"), ("alice", "s2"), ("bob", "s1")]:
        assert len((await store.log.append_turns(user, session, HISTORY)).new_ids) == 4
    assert await store.log.count_turns() == 12
    assert await store.log.count_turns("alice") == 8


async def test_twenty_concurrent_resends_store_each_turn_once(store: Storage) -> None:
    results = await asyncio.gather(*(store.log.append_turns("alice", "s1", HISTORY) for _ in range(20)))

    assert await store.log.count_turns() == 4
    assert len({i for r in results for i in r.new_ids}) == 4
    assert {r.last_id for r in results} == {max(i for r in results for i in r.new_ids)}
    assert (await store.queue.job_counts())["queued"] == 1


async def test_concurrent_resends_through_two_stores_on_one_database(
    tmp_path: Path, database_url: str | None
) -> None:
    # Two replicas behind a load balancer share the database; their writes are serialized
    # (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock) and the unique index holds.
    stores = [await Storage.open(tmp_path / "memory.db", url=database_url) for _ in range(2)]
    try:
        calls = [stores[i % 2].log.append_turns("alice", "s1", HISTORY) for i in range(20)]
        results = await asyncio.gather(*calls)
        assert await stores[0].log.count_turns() == 4
        assert sum(len(r.new_ids) for r in results) == 4
    finally:
        for store in stores:
            await store.close()


async def test_an_index_job_is_enqueued_with_the_turns_only_when_something_is_new(
    store: Storage,
) -> None:
    first = await store.log.append_turns("alice", "s1", HISTORY)
    await store.log.append_turns("alice", "s1", HISTORY)
    await store.log.append_turns("alice", "s1", [NewTurn("user", "hi")], job_kind=None)

    jobs = await store.queue.claim(None, 10, now=time.time())
    assert [(j.id, j.kind, j.payload) for j in jobs] == [
        (first.job_id, "index", {"turn_ids": first.new_ids})
    ]


async def test_a_failed_append_writes_nothing(store: Storage) -> None:
    broken = [*HISTORY, NewTurn(cast(str, None), "role is NOT NULL")]
    with pytest.raises((sqlite3.IntegrityError, asyncpg.NotNullViolationError)):
        await store.log.append_turns("alice", "s1", broken)

    assert await store.log.count_turns() == 0
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 0, "dead": 0}
    assert await query_db(store, "SELECT COUNT(*) FROM sessions") == [(0,)]
    assert len((await store.log.append_turns("alice", "s1", HISTORY)).new_ids) == 4


# -- chunks and full-text search -------------------------------------------------------------


async def test_re_adding_chunks_is_idempotent(store: Storage) -> None:
    turn = (await store.log.append_turns("alice", "s1", HISTORY[:2])).last_id
    assert turn is not None
    chunks = [(0, "prose", "Miso the cat", 3), (1, "code", "print('miso')", 4)]

    first = await store.log.add_chunks(turn, chunks)
    second = await store.log.add_chunks(turn, chunks)

    assert first == second
    assert await query_db(store, "SELECT COUNT(*) FROM chunks") == [(2,)]
    assert len(await store.lexical.search("alice", "miso", k=10)) == 2
    assert await fts_is_consistent(store)


async def test_re_adding_a_changed_chunk_updates_the_index(store: Storage) -> None:
    (chunk_id,) = await add_turn_with_text(store, "alice", "s1", "the old zebra text")
    turn = (await store.log.get_chunks([chunk_id]))[0].turn_id

    assert await store.log.add_chunks(turn, [(0, "prose", "the new giraffe text", 5)]) == [chunk_id]

    assert await store.lexical.search("alice", "zebra", k=5) == []
    assert [c for c, _ in await store.lexical.search("alice", "giraffe", k=5)] == [chunk_id]
    assert await fts_is_consistent(store)


async def test_get_chunks_joins_the_turn_and_keeps_the_order_asked(store: Storage) -> None:
    turn = NewTurn("user", "a b", name="Al", created_at=1_700_000_000.0)
    turn_id = (await store.log.append_turns("alice", "s1", [turn])).last_id
    assert turn_id is not None
    ids = await store.log.add_chunks(turn_id, [(0, "prose", "first", 1), (1, "code", "second", 1)])

    rows = await store.log.get_chunks([ids[1], 12345, ids[0]])

    assert [r.text for r in rows] == ["second", "first"]
    assert (rows[0].kind, rows[0].role, rows[0].name, rows[0].created_at) == (
        "code", "user", "Al", 1_700_000_000.0,
    )  # fmt: skip
    assert (rows[0].user_id, rows[0].session_id, rows[0].ordinal) == ("alice", "s1", 1)


async def test_deleting_a_turn_removes_its_chunks_from_the_index(store: Storage) -> None:
    (chunk_id,) = await add_turn_with_text(store, "alice", "s1", "a unique platypus")
    turn = (await store.log.get_chunks([chunk_id]))[0].turn_id

    await write_db(store, "DELETE FROM turns WHERE id = ?", (turn,))

    assert await store.lexical.search("alice", "platypus", k=5) == []
    assert await fts_is_consistent(store)


async def test_search_ranks_better_matches_first(store: Storage) -> None:
    weak = await add_turn_with_text(store, "alice", "s1", "we talked about the garden today")
    strong = await add_turn_with_text(store, "alice", "s1", "tomato garden: tomato seedlings")
    await add_turn_with_text(store, "alice", "s1", "nothing relevant here at all")

    hits = await store.lexical.search("alice", "tomato garden", k=10)

    assert [c for c, _ in hits] == strong + weak
    assert all(score > 0 for _, score in hits)
    assert hits[0][1] > hits[1][1]
    assert len(await store.lexical.search("alice", "tomato garden", k=1)) == 1


async def test_search_stems_words(store: Storage) -> None:
    ids = await add_turn_with_text(store, "alice", "s1", "she runs every morning")
    assert [c for c, _ in await store.lexical.search("alice", "running", k=5)] == ids
    assert [c for c, _ in await store.lexical.search("alice", "RUN", k=5)] == ids


async def test_search_never_returns_another_users_chunks(store: Storage) -> None:
    mine = await add_turn_with_text(store, "alice", "s1", "my secret recipe")
    await add_turn_with_text(store, "bob", "s1", "bob secret recipe secret recipe")
    bobs_scope = match_expression("bob", "x")
    assert bobs_scope is not None

    assert [c for c, _ in await store.lexical.search("alice", "secret recipe", k=10)] == mine
    # Typing Bob's scope token into the query must not widen Alice's scope.
    assert await store.lexical.search("alice", bobs_scope, k=10) == []
    assert await store.lexical.search("carol", "secret recipe", k=10) == []


async def test_search_can_be_limited_to_one_session(store: Storage) -> None:
    here = await add_turn_with_text(store, "alice", "s1", "parrot talk")
    there = await add_turn_with_text(store, "alice", "s2", "parrot talk")
    await add_turn_with_text(store, "bob", "s1", "parrot talk")

    assert [c for c, _ in await store.lexical.search("alice", "parrot", k=9, session_id="s1")] == here
    assert [c for c, _ in await store.lexical.search("alice", "parrot", k=9, session_id="s2")] == there
    assert len(await store.lexical.search("alice", "parrot", k=9)) == 2


HOSTILE_QUERIES = [
    '"', '""', "'", "*", "a*", "*a", "NEAR(a b)", "NEAR", "a OR b", "OR", "AND", "NOT",
    "(", ")", "((a)", "a)", "-a", "+a", "^a", "owner:u1", "text:secret", "{text}: x",
    "col : x", "a AND NOT b", "\x00", "é", "naïve café", "日本語のテキスト", "😀", "🙂 secret",
    "secret\"; DROP TABLE chunks; --", "\\", "%", "_", "a_b", "___", "rank", "\n\t", "",
    "x" * 10_000, " ".join(["word"] * 5000), "the a an of",
]  # fmt: skip


@pytest.mark.parametrize("query", HOSTILE_QUERIES)
async def test_hostile_query_text_never_raises(store: Storage, query: str) -> None:
    await add_turn_with_text(store, "alice", "s1", "secret naïve café 日本語のテキスト a_b")
    hits = await store.lexical.search("alice", query, k=5)
    assert isinstance(hits, list)
    assert await store.lexical.search("alice", query, k=5, session_id='s1"') == []


@pytest.mark.fuzz
def test_any_text_makes_a_valid_match_expression() -> None:
    with closing(sqlite3.connect(":memory:")) as conn:
        migrations.apply(conn)

        @settings(max_examples=500, deadline=None)
        @given(st.text())
        def check(query: str) -> None:
            expression = match_expression("alice", query, "s1")
            if expression is not None:
                conn.execute(
                    "SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH ?", (expression,)
                ).fetchall()

        check()


async def test_stopwords_only_or_empty_queries_return_nothing(store: Storage) -> None:
    await add_turn_with_text(store, "alice", "s1", "the a an of")
    assert await store.lexical.search("alice", "the a an of", k=5) == []
    assert await store.lexical.search("alice", "   ", k=5) == []
    assert match_expression("alice", "the") is None


async def test_unicode_text_is_searchable(store: Storage) -> None:
    ids = await add_turn_with_text(store, "alice", "s1", "Le café était très naïve")
    assert [c for c, _ in await store.lexical.search("alice", "CAFÉ", k=5)] == ids


# -- the job queue ---------------------------------------------------------------------------


async def test_claim_takes_ready_jobs_oldest_first_and_counts_the_attempt(store: Storage) -> None:
    now = time.time()
    later = await store.queue.enqueue("index", {"n": 1}, run_after=now + 30)
    first = await store.queue.enqueue("index", {"n": 2}, run_after=now - 2)
    second = await store.queue.enqueue("index", {"n": 3}, run_after=now - 1)
    other = await store.queue.enqueue("extract", {"n": 4}, run_after=now - 3)

    jobs = await store.queue.claim(["index"], 5, now=now)

    assert [j.id for j in jobs] == [first, second]
    assert [(j.attempts, j.max_attempts) for j in jobs] == [(1, 5), (1, 5)]
    assert await store.queue.claim(["index"], 5, now=now) == []
    assert [j.id for j in await store.queue.claim(None, 5, now=now + 31)] == [other, later]
    assert (await store.queue.job_counts())["running"] == 4


async def test_concurrent_claims_never_hand_out_a_job_twice(store: Storage) -> None:
    for n in range(20):
        await store.queue.enqueue("index", {"n": n})
    batches = await asyncio.gather(*(store.queue.claim(None, 3, now=time.time()) for _ in range(10)))
    ids = [job.id for batch in batches for job in batch]
    assert len(ids) == len(set(ids)) == 20


async def test_jobs_move_through_retry_bury_and_done(store: Storage) -> None:
    await store.queue.enqueue("index", {})
    b = await store.queue.enqueue("index", {}, max_attempts=1)
    a, buried = await store.queue.claim(None, 2, now=time.time())

    await store.queue.retry_later(a, "TimeoutError: slow", run_after=time.time() + 3600)
    await store.queue.bury(buried, "ValueError: bad payload")

    assert await store.queue.job_counts() == {"queued": 1, "running": 0, "done": 0, "dead": 1}
    (dead,) = await store.queue.dead_jobs(10)
    assert (dead.id, dead.last_error, dead.attempts) == (b, "ValueError: bad payload", 1)
    assert await store.queue.next_job_due() == pytest.approx(time.time() + 3600, abs=5)
    (job,) = await store.queue.claim(None, 5, now=time.time() + 3601)
    assert job.attempts == 2
    assert await store.queue.complete(job)
    await store.queue.retry_later(job, "too late", run_after=0)  # must not revive a done job
    assert (await store.queue.job_counts())["done"] == 1
    assert await store.queue.prune_done_jobs(older_than=time.time() + 1) == 1


async def test_requeue_running_recovers_jobs_and_buries_repeat_crashers(store: Storage) -> None:
    normal = await store.queue.enqueue("index", {}, run_after=0)
    crasher = await store.queue.enqueue("index", {}, max_attempts=1, run_after=0)
    # Claimed so long ago that even a lease (PostgreSQL) has ended: the process is gone.
    await store.queue.claim(None, 5, now=time.time() - LEASE_SECONDS - 1)

    assert await store.queue.requeue_running() == 1

    assert await store.queue.job_counts() == {"queued": 1, "running": 0, "done": 0, "dead": 1}
    (dead,) = await store.queue.dead_jobs(5)
    assert dead.id == crasher and "stopped during its last attempt" in (dead.last_error or "")
    assert [j.id for j in await store.queue.claim(None, 5, now=time.time())] == [normal]


# -- metrics and plumbing --------------------------------------------------------------------


async def test_request_metrics_are_recorded_and_pruned(store: Storage) -> None:
    async with store.db.autocommit() as tx:
        await metrics.insert(
            tx, RequestMetrics(user_id="alice", created_at=100.0, items={"turn": 2}, truncated=True)
        )
        await metrics.insert(tx, RequestMetrics(user_id="alice", error="EmbedError: x"))

    assert await query_db(store, "SELECT items_json, truncated FROM request_metrics WHERE id = 1") == [
        ('{"turn": 2}', 1)
    ]
    async with store.db.write() as tx:
        assert await metrics.prune(tx, older_than=time.time() - 3600) == 1
    assert await query_db(store, "SELECT error FROM request_metrics") == [("EmbedError: x",)]


async def test_check_passes_and_close_is_idempotent(
    tmp_path: Path, database_url: str | None
) -> None:
    store = await Storage.open(tmp_path / "memory.db", url=database_url, readers=1)
    await store.db.check()
    await store.close()
    await store.close()
    with pytest.raises((ValueError, asyncpg.InterfaceError)):
        await store.db.check()


async def test_sqlite_readers_are_read_only(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "memory.db")
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            await store.db.fetch("DELETE FROM jobs")
    finally:
        await store.close()


async def test_a_sliding_window_client_continues_the_stored_path(store: Storage) -> None:
    history = [NewTurn("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(12)]
    await store.log.append_turns("u", "s", history[:6])
    # The client now sends only its last four messages plus a new one, then a shifted window.
    second = await store.log.append_turns("u", "s", [*history[2:6], history[6]])
    third = await store.log.append_turns("u", "s", history[4:9])
    assert len(second.new_ids) == 1 and len(third.new_ids) == 2
    turns = await store.log.session_turns("u", "s")
    assert [t.content for t in turns] == [f"message {i}" for i in range(9)]
    assert [t.position for t in turns] == list(range(9))
    # One matching message alone is not a window: it starts a new branch at the root.
    lone = await store.log.append_turns("u", "s", [history[3]])
    assert len(lone.new_ids) == 1


async def test_vector_writes_move_the_recall_stamp_except_a_sessions_own_turn_vectors(
    store: Storage,
) -> None:
    db = store.db
    before = await versions.stamp(db, "ada", "s1")
    async with db.autocommit() as tx:  # the vectors of session s1's own turns
        assert await versions.bump_vectors(tx, {"ada"}, {("ada", "s1")}) == {"ada": 1}
    assert await versions.stamp(db, "ada", "s1") == before  # a retry in s1 still hits
    async with db.autocommit() as tx:  # another session's, a fact's: s1 must recall again
        assert await versions.bump_vectors(tx, {"ada"}, {("ada", "s2")}) == {"ada": 2}
    assert await versions.stamp(db, "ada", "s1") != before
    assert await versions.vector_generations(db, ["ada", "bob"]) == {"ada": 2, "bob": 0}


async def test_hold_serializes_holders_of_one_key_and_no_other(store: Storage) -> None:
    # hold() (memory.storage.interface): two holders of one key take turns, while a holder
    # of another key gets in meanwhile; a key is held again once every holder has left.
    events: list[tuple[str, int]] = []
    first_in, other_in = asyncio.Event(), asyncio.Event()

    async def holder(number: int) -> None:
        async with store.db.hold("facts:alice"):
            events.append(("in", number))
            first_in.set()
            await asyncio.wait_for(other_in.wait(), timeout=10)
            events.append(("out", number))

    async def other_key() -> None:
        await first_in.wait()
        async with store.db.hold("facts:bob"):
            other_in.set()

    await asyncio.wait_for(asyncio.gather(holder(1), holder(2), other_key()), timeout=30)
    assert events in ([("in", 1), ("out", 1), ("in", 2), ("out", 2)],
                      [("in", 2), ("out", 2), ("in", 1), ("out", 1)])
    await asyncio.wait_for(holder(3), timeout=10)
    assert events[-2:] == [("in", 3), ("out", 3)]


def test_placeholders_are_numbered_for_postgresql_outside_quotes_and_comments() -> None:
    # memory.storage.postgres runs the table modules' `?` SQL as `$n`: a `?` in a string, a
    # quoted name or a comment is text, also in a quote that is never closed.
    sql = "SELECT ?, '?', \"a?\" -- why?\n, ? FROM t WHERE x = 'it''s ?' AND y = ?"
    assert numbered(sql) == (
        "SELECT $1, '?', \"a?\" -- why?\n, $2 FROM t WHERE x = 'it''s ?' AND y = $3"
    )
    assert numbered("SELECT ? -- ?") == "SELECT $1 -- ?"
    assert numbered("SELECT ?, 'open ?") == "SELECT $1, 'open ?"

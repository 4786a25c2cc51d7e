"""Schema migrations: blank databases, re-runs, upgrades and failed steps."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from memory.storage import migrations, postgres_schema
from memory.storage.postgres import PostgresDatabase
from tests.fixtures import make_memproxy_0002_db
from tests.support.servers import PostgresServer
from tests.support.sql import POSTINGS_FROM_ROWS
from tests.support.storage import Storage

EXPECTED_TABLES = {
    "migrations",
    "sessions",
    "turns",
    "chunks",
    "chunks_fts",
    "jobs",
    "request_metrics",
    "facts",
    "facts_fts",
    "summaries",
    "summaries_fts",
    "profiles",
    "consent",
    "injections",
    "memory_versions",
    "vector_generations",
    "api_keys",
    "usage_daily",
    "usage_reservations",
    "rate_buckets",
}
ALL = [name for name, _ in migrations.MIGRATIONS]


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    with closing(sqlite3.connect(tmp_path / "memory.db", isolation_level=None)) as conn:
        yield conn


def tables(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {row[0] for row in rows}


def add_column(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE sessions ADD COLUMN title TEXT")


def test_blank_database_gets_the_whole_schema(conn: sqlite3.Connection) -> None:
    assert migrations.apply(conn) == ALL
    assert ALL[:2] == ["0001_initial", "0002_facts"]
    assert EXPECTED_TABLES <= tables(conn)
    assert migrations.applied(conn) == ALL


def test_applying_again_is_a_no_op(conn: sqlite3.Connection) -> None:
    migrations.apply(conn)
    before = conn.execute("SELECT name, applied_at FROM migrations").fetchall()
    assert migrations.apply(conn) == []
    assert conn.execute("SELECT name, applied_at FROM migrations").fetchall() == before


def test_old_database_is_upgraded_in_order_and_keeps_its_data(conn: sqlite3.Connection) -> None:
    migrations.apply(conn)
    conn.execute("INSERT INTO sessions VALUES ('alice', 's1', 1.0, 2.0, 3)")
    extended = [
        *migrations.MIGRATIONS,
        ("0099_notes", "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT);"
                       " CREATE INDEX notes_body ON notes (body);"),
        ("0100_session_title", add_column),
    ]  # fmt: skip

    assert migrations.apply(conn, extended) == ["0099_notes", "0100_session_title"]

    assert migrations.applied(conn) == [*ALL, "0099_notes", "0100_session_title"]
    assert "notes" in tables(conn)
    assert conn.execute("SELECT user_id, title FROM sessions").fetchall() == [("alice", None)]
    assert migrations.apply(conn, extended) == []


def test_a_failing_migration_leaves_no_trace(conn: sqlite3.Connection) -> None:
    migrations.apply(conn)
    broken = [*migrations.MIGRATIONS, ("0099_broken", "CREATE TABLE half (x); SELECT * FROM nope;")]

    with pytest.raises(sqlite3.OperationalError, match="nope"):
        migrations.apply(conn, broken)

    assert "half" not in tables(conn)
    assert migrations.applied(conn) == ALL
    assert not conn.in_transaction


def test_duplicate_names_are_rejected(conn: sqlite3.Connection) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        migrations.apply(conn, [("0001_a", "SELECT 1;"), ("0001_a", "SELECT 2;")])


def test_trigger_bodies_are_not_split_at_their_semicolons() -> None:
    script = """
    -- a comment; with a semicolon
    CREATE TABLE t (x);
    CREATE TRIGGER t_ai AFTER INSERT ON t BEGIN
        INSERT INTO t (x) VALUES (1);
        INSERT INTO t (x) VALUES (2);
    END;
    SELECT ';';
    """
    statements = list(migrations.split_statements(script))
    assert len(statements) == 3
    assert "VALUES (2);" in statements[1]


def test_an_unfinished_statement_is_an_error() -> None:
    with pytest.raises(ValueError, match="incomplete"):
        list(migrations.split_statements("CREATE TABLE t (x); CREATE TABLE u (y)"))


async def test_store_open_migrates_once_and_sets_wal(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "memory.db"
    for _ in range(2):
        store = await Storage.open(path)
        await store.db.check()
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        assert migrations.applied(conn) == ALL
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_0001_database_is_upgraded_to_facts_and_keeps_its_turns(conn: sqlite3.Connection) -> None:
    migrations.apply(conn, migrations.MIGRATIONS[:1])
    conn.execute("INSERT INTO turns (user_id, session_id, position, role, content, content_hash,"
                 " created_at) VALUES ('ada', 's1', 0, 'user', 'hi', 'h', 1.0)")
    assert migrations.apply(conn) == ALL[1:]
    assert conn.execute("SELECT content FROM turns").fetchall() == [("hi",)]
    conn.execute("INSERT INTO facts (chain_id, user_id, text, category, confidence, importance,"
                 " source, first_seen, last_seen, valid_from, created_at, updated_at, owner)"
                 " VALUES (1, 'ada', 'Ada likes tea', 'preference', 0.9, 7, 'manual',"
                 " 1, 1, 1, 1, 1, 'u1')")
    hits = conn.execute("SELECT rowid FROM facts_fts WHERE facts_fts MATCH 'tea'").fetchall()
    assert hits == [(1,)]
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE facts SET category = 'gossip'")




FACT = ("INSERT INTO facts (chain_id, user_id, text, category, confidence, importance,"
        " source, first_seen, last_seen, valid_from, created_at, updated_at, owner)"
        " VALUES (1, 'ada', ?, 'preference', 0.9, 7, ?, 1, 1, 1, 1, 1, 'u1')")


def attached_to_facts(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    return conn.execute("SELECT type, name FROM sqlite_master WHERE tbl_name = 'facts'"
                        " AND type IN ('index', 'trigger') ORDER BY name").fetchall()


def test_0012_rebuilds_facts_for_mcp_provenance_keeping_rows_indexes_and_triggers(
    conn: sqlite3.Connection,
) -> None:
    migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] < "0012"])
    conn.execute(FACT, ("Ada likes green tea", "manual"))
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(FACT, ("Ada uses Helix", "mcp"))
    attached = attached_to_facts(conn)
    up_to_0012 = [m for m in migrations.MIGRATIONS if m[0] <= "0012_fact_provenance"]
    assert migrations.apply(conn, up_to_0012) == ["0012_fact_provenance"]
    assert attached_to_facts(conn) == attached
    conn.execute(FACT, ("Ada uses Helix", "mcp"))
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(FACT, ("Ada uses vim", "gossip"))
    conn.execute("UPDATE facts SET client = 'helix-editor' WHERE source = 'mcp'")
    assert conn.execute("SELECT text, source, client FROM facts ORDER BY id").fetchall() == [
        ("Ada likes green tea", "manual", None), ("Ada uses Helix", "mcp", "helix-editor")]
    hits = conn.execute("SELECT rowid FROM facts_fts WHERE facts_fts MATCH 'tea OR helix'")
    assert sorted(hits.fetchall()) == [(1,), (2,)]
    assert conn.execute("SELECT COUNT(*) FROM memory_versions").fetchone()[0] > 0
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_0013_adds_api_keys_to_a_database_that_holds_memory(conn: sqlite3.Connection) -> None:
    migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] < "0013"])
    conn.execute(FACT, ("Ada likes green tea", "manual"))
    assert "api_keys" not in tables(conn)
    assert migrations.apply(conn)[0] == "0013_api_keys"
    row = ("key_1", "ab" * 32, "mp-00000000", "ada", None, 0, None, 5, 10, 1.0, None, None)
    conn.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
    for bad in ({"id": "key_2"}, {"id": "key_3", "rate_limit": 0},
                {"id": "key_4", "digest": "cd" * 32, "token_quota": -1}):
        changed = dict(zip(("id", "digest", "prefix", "user_id", "org_id", "org_writer",
                            "expires_at", "rate_limit", "token_quota", "created_at",
                            "last_used_at", "revoked_at"), row, strict=True)) | bad
        with pytest.raises(sqlite3.IntegrityError):  # the same digest twice, or a bad limit
            conn.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         tuple(changed.values()))
    assert conn.execute("SELECT COUNT(*) FROM facts").fetchone() == (1,)


@pytest.fixture(scope="module")
def fixture_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database written by the previous schema (tests/fixtures/make_memproxy_0002_db.py)."""
    path = tmp_path_factory.mktemp("fixture") / "memproxy-0002.db"
    make_memproxy_0002_db.write(path)
    return path


OLD_TABLES = {  # table: the columns it had at 0002
    "sessions": "*", "turns": "*", "request_metrics": "*",
    "facts": "id, chain_id, user_id, text, category, confidence, importance, mentions, source,"
             " source_session, source_turn_ids, pinned, first_seen, last_seen, expires_at,"
             " version, previous_id, valid_from, valid_to, superseded_by, created_at,"
             " updated_at, owner",
    "summaries": "*", "profiles": "*", "consent": "*",
    "jobs": "id, kind, payload, status, attempts, max_attempts, run_after, last_error,"
            " created_at, updated_at",
    "chunks": "id, turn_id, user_id, session_id, ordinal, kind, text, tokens, owner, sess",
}


def old_rows(path: Path) -> dict[str, list[tuple[object, ...]]]:
    with closing(sqlite3.connect(path)) as conn:
        return {table: conn.execute(f"SELECT {columns} FROM {table} ORDER BY rowid").fetchall()
                for table, columns in OLD_TABLES.items()}


def test_0014_adds_usage_to_a_database_that_has_data(conn: sqlite3.Connection) -> None:
    migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] < "0014"])
    conn.execute(FACT, ("Ada likes green tea", "manual"))
    assert "usage_daily" not in tables(conn)
    assert migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] < "0015"]) \
        == ["0014_usage"]
    assert conn.execute("SELECT COUNT(*) FROM facts").fetchone()[0] == 1
    conn.execute("INSERT INTO usage_daily (day, key_id, user_id, requests) VALUES ('2026-11-26', 'k', 'u', 1)")
    with pytest.raises(sqlite3.IntegrityError):  # one row per day, key and user
        conn.execute("INSERT INTO usage_daily (day, key_id, user_id) VALUES ('2026-11-26', 'k', 'u')")


async def test_a_0002_database_from_disk_is_upgraded_without_loss(
    tmp_path: Path, fixture_db: Path
) -> None:
    path = tmp_path / "memproxy.db"
    shutil.copyfile(fixture_db, path)
    with closing(sqlite3.connect(path)) as conn:
        assert migrations.applied(conn) == ALL[:2]
    before = old_rows(path)
    assert all(before.values()), "the fixture has rows in every table"

    store = await Storage.open(path)  # the start-up path: migrates
    try:
        lisbon = [chunk for chunk, _ in await store.lexical.search("ada", "Lisbon hotels", k=10)]
        planner = [chunk for chunk, _ in await store.lexical.search("ada", "planner", k=10)]
        munich = [chunk for chunk, _ in await store.lexical.search("bob'; --", "München", k=10)]
        nothing = await store.lexical.search("ada", "München", k=10)
    finally:
        await store.close()

    assert old_rows(path) == before
    with closing(sqlite3.connect(path)) as conn:  # queued jobs keep their order (0010)
        assert conn.execute("SELECT COUNT(*) FROM jobs WHERE fair_at != run_after"
                            " OR owner != ''").fetchone() == (0,)
    with closing(sqlite3.connect(path)) as conn:
        assert migrations.applied(conn) == ALL
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        speakers = conn.execute("SELECT c.speaker, COALESCE(t.name, t.role) FROM chunks AS c"
                                " JOIN turns AS t ON t.id = c.turn_id").fetchall()
        fact = conn.execute("SELECT rowid FROM facts_fts WHERE facts_fts MATCH 'typescript'")
        summary = conn.execute("SELECT rowid FROM summaries_fts WHERE summaries_fts MATCH 'hotels'")
        assert (fact.fetchall(), summary.fetchall()) == ([(3,)], [(2,)])
    assert all(new == old for new, old in speakers) and ("planner", "planner") in speakers
    assert sorted(lisbon) == [1, 2, 3] and planner == [3]  # the speaker is searchable now
    assert munich == [6] and nothing == []


def test_a_server_starts_on_a_0002_database_and_serves_all_of_it(
    start_proxy: Callable[..., Any], tmp_path: Path, fixture_db: Path
) -> None:
    from tests.support.jobs import wait_for_jobs
    from tests.support.memory import QUIET, export_records

    data = tmp_path / "old"
    data.mkdir()
    shutil.copyfile(fixture_db, data / "memproxy.db")
    proxy = start_proxy(memory=True, data_dir=data, weight_dense=0.0, **QUIET)
    wait_for_jobs(proxy)
    records = export_records(proxy, **{"X-Memory-User-Id": "ada"})
    kinds = [r["type"] for r in records]
    assert (kinds.count("turn"), kinds.count("fact"), kinds.count("summary")) == (5, 3, 2)
    assert [r["consent"] for r in records if r["type"] == "profile"] == [True]
    found = httpx.post(f"{proxy.url}/v1/memory/search", headers={"X-Memory-User-Id": "ada"},
                       json={"query": "When do we fly to Lisbon?"}).json()
    assert "3rd of May" in found["block"] and "TypeScript" not in found["block"]
    with closing(sqlite3.connect(data / "memproxy.db")) as conn:
        jobs = dict(conn.execute("SELECT id, status FROM jobs WHERE id <= 3").fetchall())
        dead = conn.execute("SELECT last_error FROM jobs WHERE id = 3").fetchall()
    # The queued job ran; the dead letter keeps its error; the finished one may be pruned
    # already (done jobs are kept a week, and this one is from 2023).
    assert jobs.get(1, "done") == "done" and jobs[2] == "done" and jobs[3] == "dead"
    assert dead == [("upstream answered 500",)]


# -- PostgreSQL --------------------------------------------------------------------------------


async def test_postgres_gets_the_same_migrations_once_when_replicas_start_together(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database()
    replicas = await asyncio.gather(*(PostgresDatabase.open(url) for _ in range(3)))
    try:
        conn = await asyncpg.connect(url)
        try:
            assert await postgres_schema.applied(conn) == ALL
            assert await postgres_schema.apply(conn) == []  # applying again is a no-op
            tables = {r[0] for r in await conn.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        finally:
            await conn.close()
        # The same tables, FTS5's virtual tables aside (their words live in the rows).
        assert tables == {t for t in EXPECTED_TABLES if not t.endswith("_fts")} | {
            "fts_totals", "fts_terms", "chunk_terms", "clears", "clear_records"}
        for replica in replicas:
            await replica.check()
    finally:
        for replica in replicas:
            await replica.close()


async def test_postgres_0009_gives_the_chunks_already_indexed_their_postings(
    postgres_server: PostgresServer,
) -> None:
    conn = await asyncpg.connect(postgres_server.create_database())
    try:
        before = [m for m in postgres_schema.MIGRATIONS if m[0] < "0009"]
        assert await postgres_schema.apply(conn, before) == ALL[: len(before)]
        for turn, (user, session, text, speaker) in enumerate([
            ("ada", "s1", "Ada flies to Lisbon; Lisbon in May", "planner"),
            ("ada", "s2", "The hotel in Lisbon is booked", "Ada"),
            ("bob", "s1", "Bob walks his dog", "bob"),
        ], start=1):
            await conn.execute(
                "INSERT INTO turns (id, user_id, session_id, position, role, content,"
                " content_hash, created_at) VALUES ($1, $2, $3, 0, 'user', $4, $5, 0)",
                turn, user, session, text, f"h{turn}")
            await conn.execute(
                "INSERT INTO chunks (turn_id, user_id, session_id, ordinal, kind, text, owner,"
                " sess, speaker) VALUES ($1, $2, $3, 0, 'prose', $4, '', '', $5)",
                turn, user, session, text, speaker)

        upto_0009 = [m for m in postgres_schema.MIGRATIONS if m[0] < "0010"]
        assert await postgres_schema.apply(conn, upto_0009) == ["0009_chunk_postings"]

        postings = await conn.fetch("SELECT * FROM chunk_terms ORDER BY 1, 2, 3")
        assert [tuple(r) for r in postings] == [
            tuple(r) for r in await conn.fetch(POSTINGS_FROM_ROWS + " ORDER BY 1, 2, 3")]
        lisbon = [tuple(r) for r in postings if r["lexeme"] == "lisbon"]
        assert lisbon == [("ada", "lisbon", 1, "s1", 2.0, 10), ("ada", "lisbon", 2, "s2", 1.0, 9)]
        assert [r["lexeme"] for r in postings if r["chunk_id"] == 3 and r["tf"] == 1.5] == ["bob"]
    finally:
        await conn.close()


def test_0015_adds_quota_holds_to_a_database_with_usage(conn: sqlite3.Connection) -> None:
    migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] < "0015"])
    conn.execute("INSERT INTO usage_daily (day, key_id, user_id, input_tokens) VALUES ('2026-11-26', 'k', 'u', 7)")
    assert "usage_reservations" not in tables(conn) and "rate_buckets" not in tables(conn)
    assert migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] < "0016"]) \
        == ["0015_quota_holds"]
    assert conn.execute("SELECT input_tokens FROM usage_daily").fetchone()[0] == 7
    conn.execute("INSERT INTO usage_reservations VALUES ('h1', 'k', 100, 1e10)")
    with pytest.raises(sqlite3.IntegrityError):  # a reservation's id is its own
        conn.execute("INSERT INTO usage_reservations VALUES ('h1', 'k', 5, 1e10)")

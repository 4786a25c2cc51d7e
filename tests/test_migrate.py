"""`memproxy migrate`: an embedded install moved up to PostgreSQL and a Chroma server keeps
every row, every vector and what recall finds; a second run adds nothing, an interrupted copy
resumes to the same result, and a running source or a used destination is refused."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config import Settings
from memory import CopiedBatch, MigrateError, VectorIndex, collection_name, migrate
from memory.storage.bulk_copy import TABLES
from tests.conftest import ROOT, RunningProxy, started
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import memory_api
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.servers import ChromaServer, PostgresServer
from tests.support.sql import POSTINGS_FROM_ROWS, query, scalar
from tests.test_learning import PlaysTheModel, answer, fact

SESSIONS = {
    ("ada", "infra"): ["We run the billing service on Postgres 16 in eu-west-1.",
                       "Deploys go out on Tuesdays from the release-train branch.",
                       "The staging cluster is called kestrel."],
    ("ada", "home"): ["My cat Miso hates the vacuum cleaner.",
                      "We are repainting the kitchen in sage green."],
    ("bob", "work"): ["The mobile app ships through Fastlane every second Friday.",
                      "Our on-call rotation uses PagerDuty with a weekly handover."],
}
MANUAL_FACTS = {"ada": ["Ada prefers TypeScript for new services."],
                "bob": ["Bob's team is called Falcon."]}
QUERIES = [("ada", "which database does billing use?"), ("ada", "what is the cat called?"),
           ("ada", "when do deploys go out?"), ("bob", "how does the mobile app ship?")]


@pytest.fixture
def chroma() -> Iterator[ChromaServer]:
    """A Chroma server of the test's own: a copy needs a collection nothing else wrote."""
    with started(ChromaServer) as server:
        yield server


@pytest.fixture
def source(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> RunningProxy:
    """An embedded install filled through the proxy: turns in a few sessions, learned facts
    (one superseded), rolled-up summaries, facts and a profile through the memory API, every
    job done."""
    model = PlaysTheModel()
    upstream.respond_with(model)
    model.facts.extend([
        answer(fact("User's billing service runs on Postgres 16.", "project")),
        answer(fact("User deploys on Tuesdays.", "project")),
        answer(fact("User deploys on Wednesdays.", "project")),
    ])
    model.summaries.extend([json.dumps({"text": f"Summary {i}: infrastructure and habits."})
                            for i in range(5)])
    proxy = start_proxy(memory=True, extract_every=1, summary_every=2)
    for (user, session), lines in SESSIONS.items():
        history: list[dict[str, Any]] = []
        for line in lines:
            history.append({"role": "user", "content": line})
            history.append({"role": "assistant", "content": chat(
                proxy, history, user=user, session=session).text})
        wait_for_jobs(proxy)
    for user, texts in MANUAL_FACTS.items():
        with memory_api(proxy, **{"X-Memory-User-Id": user}) as api:
            for text in texts:
                assert api.post("/facts", json={"text": text, "category": "preference"}
                                ).status_code == 201
    with memory_api(proxy, **{"X-Memory-User-Id": "ada"}) as api:
        assert api.put("/consent", json={"consent": True}).status_code == 200
        assert api.put("/profile", json={"fields": {"role": "staff engineer"},
                                         "text": "I maintain billing."}).status_code == 200
    wait_for_jobs(proxy)
    # A stored key (docs/keys.md), written as the admin API would: its row moves too.
    query(proxy.state.settings, "INSERT INTO api_keys (id, digest, prefix, user_id, org_id,"
          " org_writer, expires_at, rate_limit, token_quota, created_at, last_used_at,"
          " revoked_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", STORED_KEY)
    return proxy


STORED_KEY = ("key_00000000000000a1", "ab" * 32, "mp-0000abcd", "ada", "acme", 1, None, 60,
              1000, 1_764_000_000.5, None, None)


def search(proxy: RunningProxy) -> list[list[tuple[str, str]]]:
    """The items /v1/memory/search finds for each of QUERIES."""
    found = []
    for user, text in QUERIES:
        with memory_api(proxy, **{"X-Memory-User-Id": user}) as api:
            items = api.post("/search", json={"query": text}).json()["items"]
        found.append([(item["source"], item["id"]) for item in items])
    return found


def counts(target: Settings | Path) -> dict[str, int]:
    return {table: int(scalar(target, f"SELECT COUNT(*) FROM {table}")) for table in TABLES}


def run_migrate(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command line, in its own process."""
    env = {**os.environ, "MEMPROXY_DATA_DIR": str(data_dir)}
    return subprocess.run([sys.executable, "-m", "proxy", "migrate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def new_install(data_dir: Path) -> Path:
    """A data directory with an empty database (the schema comes with the copy's snapshot)."""
    data_dir.mkdir()
    sqlite3.connect(data_dir / "memproxy.db").close()
    return data_dir


def fts_mismatches(settings: Settings) -> list[Any]:
    """Where PostgreSQL's full-text counters differ from what the rows hold."""
    wrong: list[Any] = []
    for table in ("chunks", "facts", "summaries"):
        held = query(settings, "SELECT docs, tokens FROM fts_totals WHERE name = ?", (table,))
        actual = query(settings, f"SELECT COUNT(*), COALESCE(SUM(doc_len), 0) FROM {table}")
        if held != actual:
            wrong.append((table, held, actual))
        terms = query(settings, "SELECT lexeme, docs FROM fts_terms WHERE name = ? AND docs > 0"
                      " ORDER BY lexeme", (table,))
        recount = query(settings, f"SELECT lexeme, COUNT(*) FROM {table},"
                        " unnest(tsvector_to_array(tsv)) AS lexeme GROUP BY lexeme ORDER BY lexeme")
        if terms != recount:
            wrong.append((table, "terms", len(terms), len(recount)))
    postings = query(settings, "SELECT * FROM chunk_terms ORDER BY 1, 2, 3")
    if postings != query(settings, f"{POSTINGS_FROM_ROWS} ORDER BY 1, 2, 3") or not postings:
        wrong.append(("chunk_terms", len(postings)))
    return wrong


def test_a_migrated_install_has_the_same_rows_vectors_and_recall(
    source: RunningProxy, start_proxy: Callable[..., RunningProxy],
    postgres_server: PostgresServer, chroma: ChromaServer, tmp_path: Path,
) -> None:
    settings = source.state.settings
    before = search(source)
    assert all(before), before
    refused = run_migrate(settings.data_dir, postgres_server.create_database())
    assert refused.returncode == 1 and "stop memproxy" in refused.stderr
    source.stop()
    rows = counts(settings.db_path)
    assert all(rows[t] for t in ("turns", "chunks", "facts", "summaries", "profiles")), rows
    embedded = VectorIndex.open(settings.vectors_path, collection_name(settings))
    vectors = embedded.count()
    embedded.close()

    dest_url = postgres_server.create_database()
    done = run_migrate(settings.data_dir, dest_url, "--chroma-url", chroma.url,
                       "--batch-size", "4")
    assert done.returncode == 0, done.stderr
    replica = start_proxy(memory=True, database_url=dest_url, chroma_url=chroma.url,
                          data_dir=tmp_path / "replica")
    moved = replica.state.settings
    assert counts(moved) == rows
    assert query(moved, "SELECT * FROM api_keys") == [STORED_KEY]
    assert fts_mismatches(moved) == []
    assert replica.state.memory.vectors.count() == vectors
    assert search(replica) == before
    # New rows get new ids after the copied ones.
    assert chat(replica, "The kestrel cluster moved to eu-central-1.", user="ada",
                session="infra-2").status == 200
    wait_for_jobs(replica)
    assert scalar(moved, "SELECT MAX(id) FROM turns") == rows["turns"] + 2
    replica.stop()

    after = counts(moved)
    again = run_migrate(settings.data_dir, dest_url, "--chroma-url", chroma.url)
    assert again.returncode == 0, again.stderr
    assert counts(moved) == after
    copied = [line.split()[-1] for line in again.stdout.splitlines()
              if line.split()[0] in TABLES]
    assert copied == ["0"] * len(TABLES)
    vectors_row = next(line for line in again.stdout.splitlines() if line.startswith("vectors"))
    assert vectors_row.split() == ["vectors", collection_name(settings), "0"]
    # The columns line up: every number ends where its heading does.
    header, *table_lines = again.stdout.splitlines()[:len(TABLES) + 1]
    for heading in ("SOURCE", "DEST", "COPIED"):
        end = header.index(heading) + len(heading)
        assert all(line[end - 1].isdigit() and line[end:end + 1] in ("", " ")
                   for line in table_lines), (heading, again.stdout)

    # Another install into this database: refused, nothing written.
    other = run_migrate(new_install(tmp_path / "other"), dest_url)
    assert other.returncode == 1 and "holds a copy of" in other.stderr
    assert counts(moved) == after
    # The embedded install is left as it was, for a server to start on again.
    assert search(start_proxy(memory=True)) == before


class Interrupted(Exception):
    """Stands for a copy cut off after some batches."""


def test_an_interrupted_migrate_resumes_to_the_same_result(
    source: RunningProxy, postgres_server: PostgresServer, chroma: ChromaServer, tmp_path: Path,
) -> None:
    settings = source.state.settings
    source.stop()
    # A job the stopped server left running: on PostgreSQL a replica takes it over.
    query(settings.db_path, "UPDATE jobs SET status = 'running' WHERE id = 1")
    whole = postgres_server.create_database()
    migrate(settings, whole)
    resumed = postgres_server.create_database()
    batches: list[CopiedBatch] = []

    def cut_every(n: int) -> Callable[[CopiedBatch], None]:
        def on_batch(batch: CopiedBatch) -> None:
            batches.append(batch)
            if len(batches) % n == 0:
                raise Interrupted

        return on_batch

    for _ in range(100):
        try:
            migrate(settings, resumed, chroma_url=chroma.url, batch_size=3,
                    on_batch=cut_every(7))
            break
        except Interrupted:
            pass
    else:
        raise AssertionError("the interrupted copy never finished")
    row_batches = [b for b in batches if b.table in TABLES]
    vector_batches = [b for b in batches if b.table.startswith("vectors ")]
    assert len(row_batches) > 14 and len(vector_batches) > 7  # cut in both
    # Each run goes on after the last batch committed: every row and vector is read once.
    rows = sum(counts(settings.db_path).values())
    vectors = len(stored_vectors(settings.vectors_path, settings))
    assert sum(b.rows for b in row_batches) == rows
    assert sum(b.rows for b in vector_batches) == sum(b.inserted for b in vector_batches) == vectors

    def dump(url: str) -> dict[str, Any]:
        target = settings.replace(database_url=url)
        tables = {t: query(target, f"SELECT * FROM {t} ORDER BY 1, 2") for t in TABLES}
        return {**tables, "fts": query(target, "SELECT * FROM fts_totals ORDER BY name"),
                "terms": query(target, "SELECT * FROM fts_terms WHERE docs > 0 ORDER BY 1, 2"),
                "next": query(target, "SELECT last_value, is_called FROM turns_id_seq")}

    assert dump(resumed) == dump(whole)
    assert query(settings.replace(database_url=whole),
                 "SELECT id, lease_until FROM jobs WHERE status = 'running'") == [(1, 0.0)]
    on_server, embedded = (stored_vectors(where, settings)
                           for where in (chroma.url, settings.vectors_path))
    assert [(id_, meta) for id_, _, meta in on_server] == [(id_, meta) for id_, _, meta in embedded]
    # The same float32 vectors (the server's JSON may round the last digit).
    assert np.allclose([v for _, v, _ in on_server], [v for _, v, _ in embedded], atol=1e-6)
    with pytest.raises(MigrateError, match="holds a copy of"):
        migrate(settings.replace(data_dir=new_install(tmp_path / "other")), whole)


def stored_vectors(where: Path | str, settings: Settings) -> list[tuple[str, Any, Any]]:
    """Every vector of the settings' collection, embedded (a path) or on a server (a URL)."""
    name = collection_name(settings)
    index = VectorIndex.open(where, name) if isinstance(where, Path) else VectorIndex.connect(
        where, name)
    try:
        return sorted(((id_, vector, dict(metadata))
                       for ids, vectors, metadatas in index.pages(50)
                       for id_, vector, metadata in zip(ids, vectors, metadatas, strict=True)),
                      key=lambda stored: stored[0])
    finally:
        index.close()


def test_a_killed_migrate_goes_on_where_it_stopped(
    source: RunningProxy, postgres_server: PostgresServer,
) -> None:
    settings = source.state.settings
    source.stop()
    dest_url = postgres_server.create_database()
    env = {**os.environ, "MEMPROXY_DATA_DIR": str(settings.data_dir)}
    with subprocess.Popen(
        [sys.executable, "-m", "proxy", "migrate", dest_url, "--batch-size", "1"], cwd=ROOT,
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    ) as process:
        assert process.stderr is not None
        # Each progress line is printed after its batch committed.
        printed = [process.stderr.readline() for _ in range(10)]
        process.kill()
        printed += process.stderr.readlines()
    assert process.returncode < 0  # killed, not finished
    committed = sum(int(line.split(":")[1].split()[0]) for line in printed if " of " in line)

    finish = run_migrate(settings.data_dir, dest_url)
    assert finish.returncode == 0, finish.stderr
    copied = sum(int(line.split()[-1]) for line in finish.stdout.splitlines()
                 if line.split()[0] in TABLES)
    rows = counts(settings.db_path)
    # At most one batch committed after the last line the killed run printed; memory_versions
    # rows come with the rows they count (the destination's triggers), not from the copy.
    expected = sum(rows.values()) - rows["memory_versions"] - committed
    assert expected - 1 <= copied <= expected
    assert counts(settings.replace(database_url=dest_url)) == rows
    assert fts_mismatches(settings.replace(database_url=dest_url)) == []


def test_migrate_checks_every_target_before_writing_anything(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    """Issue 39 item 7: with the Chroma server down, a migrate left the destination's 21 new
    tables behind and printed a traceback; a database that does not exist did too."""
    from tests.support.servers import free_port

    source = new_install(tmp_path / "source")
    dest_url = postgres_server.create_database()
    down = f"http://127.0.0.1:{free_port()}"
    failed = run_migrate(source, dest_url, "--chroma-url", down)
    assert failed.returncode == 1 and failed.stdout == "", failed
    assert failed.stderr.splitlines() == [
        f"memproxy: migrate failed: the vectors (Chroma server at {down}): no answer"
        f" (ConnectError: [Errno 111] Connection refused); start it (chroma run), or fix"
        " --chroma-url"], failed.stderr
    held = _tables(dest_url)
    assert held == [], held

    missing = dest_url.rsplit("/", 1)[0] + "/no_such_db"
    failed = run_migrate(source, missing)
    assert failed.returncode == 1 and len(failed.stderr.splitlines()) == 1, failed.stderr
    assert 'database "no_such_db" does not exist; create it (createdb) or fix DEST_URL' in (
        failed.stderr)
    assert "stays" not in failed.stderr and "Traceback" not in failed.stderr


def _tables(url: str) -> list[str]:
    import asyncio

    import asyncpg

    async def names() -> list[str]:
        conn = await asyncpg.connect(url)
        try:
            rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        finally:
            await conn.close()
        return sorted(str(row[0]) for row in rows)

    return asyncio.run(names())

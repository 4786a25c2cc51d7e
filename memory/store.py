"""SQLite storage for turns, chunks, full-text search, the job queue and request metrics.

The only module that imports aiosqlite. One writer connection takes every write, serialized
by an asyncio.Lock so a multi-statement transaction is never interleaved with another
coroutine's statements (Datasette's write queue); read-only connections serve queries.
Write transactions use BEGIN IMMEDIATE, so they also exclude writers in other processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import KW_ONLY, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from memory import migrations
from memory.lexical import TermSelector
from memory.redact import keep

_BUSY_TIMEOUT_MS = 5000
_LOCKED_ATTEMPTS = 6  # each waits the busy timeout: 30 s in all for a write lock
_T = TypeVar("_T")
# SQLite's default limit on bound parameters is 32766; stay far below it.
_IN_BATCH = 500
_MAX_QUERY_TERMS = 32
# Columns of chunks_fts that query words match (the text, and the speaker's name).
FTS_COLUMNS = ("text", "speaker")
_WORD = re.compile(r"[^\W_]+")
_STOPWORDS = frozenset(
    "a an and are as at be but by did do does for from had has have he her his how i if in "
    "into is it its me my no not of on or our she so than that the their them then there "
    "these they this to was we were what when where which who why will with you your".split()
)

_TURN_COLUMNS = (
    "id, user_id, session_id, parent_id, position, role, name, content, content_hash, "
    "created_at, model, tokens, request_id, incomplete"
)
_CHUNK_SELECT = (
    "SELECT c.id, c.turn_id, c.user_id, c.session_id, c.ordinal, c.kind, c.text, c.tokens, "
    "t.role, t.name, t.created_at FROM chunks AS c JOIN turns AS t ON t.id = c.turn_id"
)
# (seed, neighbour) chunk pairs for Store.neighbour_chunks; {marks} are the seed ids.
# NOT MATERIALIZED: as a materialized table the seed made SQLite build a Bloom filter over
# all of chunks for the last branch (50 ms at 100k chunks); inlined, every step is a lookup.
_NEIGHBOURS = """
WITH seed AS NOT MATERIALIZED (
    SELECT c.id, c.turn_id, c.ordinal, t.parent_id,
        (SELECT MAX(ordinal) FROM chunks WHERE turn_id = c.turn_id) AS last
    FROM chunks AS c JOIN turns AS t ON t.id = c.turn_id WHERE c.id IN ({marks})
)
SELECT s.id, n.id FROM seed AS s
    JOIN chunks AS n ON n.turn_id = s.turn_id AND n.ordinal IN (s.ordinal - 1, s.ordinal + 1)
UNION ALL
SELECT s.id, n.id FROM seed AS s JOIN chunks AS n ON n.turn_id = s.parent_id
    WHERE s.ordinal = 0 AND n.ordinal = (SELECT MAX(ordinal) FROM chunks WHERE turn_id = s.parent_id)
UNION ALL
SELECT s.id, n.id FROM seed AS s JOIN turns AS t ON t.parent_id = s.turn_id
    JOIN chunks AS n ON n.turn_id = t.id AND n.ordinal = 0
    WHERE s.ordinal = s.last
"""
_JOB_STATUSES = ("queued", "running", "done", "dead")


@dataclass(frozen=True, slots=True)
class NewTurn:
    """A message to log; `created_at` is unix seconds."""

    role: str
    content: str
    _: KW_ONLY
    name: str | None = None
    created_at: float = field(default_factory=time.time)
    model: str | None = None
    tokens: int = 0
    request_id: str | None = None
    incomplete: bool = False


@dataclass(frozen=True, slots=True)
class Turn:
    """A logged message; `parent_id` is the previous turn on its branch."""

    id: int
    user_id: str
    session_id: str
    parent_id: int | None
    position: int
    role: str
    name: str | None
    content: str
    content_hash: str
    created_at: float
    model: str | None
    tokens: int
    request_id: str | None
    incomplete: bool


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Outcome of append_turns: the path's last turn, the turns inserted, the job enqueued."""

    last_id: int | None
    new_ids: list[int]
    job_id: int | None = None


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """A chunk with the role, name and time of its turn."""

    id: int
    turn_id: int
    user_id: str
    session_id: str
    ordinal: int
    kind: str
    text: str
    tokens: int
    role: str
    name: str | None
    created_at: float


@dataclass(frozen=True, slots=True)
class Job:
    """A claimed job; `attempts` already counts the current one."""

    id: int
    kind: str
    payload: dict[str, Any]
    attempts: int
    max_attempts: int


@dataclass(frozen=True, slots=True)
class DeadJob:
    """A job that ran out of attempts, with the error that ended it."""

    id: int
    kind: str
    payload: dict[str, Any]
    attempts: int
    last_error: str | None
    updated_at: float


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One row per proxied request; `items` counts recalled items by source."""

    user_id: str
    session_id: str | None = None
    request_id: str | None = None
    model: str | None = None
    items: Mapping[str, int] = field(default_factory=dict)
    injected_tokens: int = 0
    truncated: bool = False
    recall_ms: float | None = None
    embed_ms: float | None = None
    error: str | None = None
    created_at: float = field(default_factory=time.time)


def content_hash(role: str, name: str | None, content: str) -> str:
    """Identity of a message for exactly-once logging; whitespace-only edits keep it."""
    text = content.replace("\r\n", "\n").replace("\r", "\n").strip()
    return hashlib.sha256(json.dumps([role, name, text]).encode()).hexdigest()


def owner_token(user_id: str) -> str:
    """The FTS token that scopes chunks to one user."""
    return "u" + _digits(user_id)


def session_token(user_id: str, session_id: str) -> str:
    """The FTS token that scopes chunks to one session of one user."""
    return "s" + _digits(f"{user_id}\x00{session_id}")


def _digits(value: str) -> str:
    # Digits only: the porter stemmer rewrites letter suffixes ("...ed"), digits never.
    # 80 bits of sha256 keep collisions negligible at any realistic user count.
    number = int.from_bytes(hashlib.sha256(value.encode()).digest()[:10], "big")
    return f"{number:025d}"


def search_terms(query: str) -> list[str]:
    """Distinct lower-cased words of free text, stopwords dropped, capped in number."""
    terms = dict.fromkeys(w for w in _WORD.findall(query.lower()) if w not in _STOPWORDS)
    return list(terms)[:_MAX_QUERY_TERMS]


def match_expression(
    user_id: str, query: str, session_id: str | None = None, *, columns: Sequence[str] = ("text",)
) -> str | None:
    """FTS5 MATCH text for free text within a user (and session) scope; None if no terms.

    `columns` are the indexed columns the words may match (all of them rank; see the
    table's bm25 weights).
    """
    terms = search_terms(query)
    if not terms:
        return None
    # Every term is a quoted string, so user text can never be read as FTS5 syntax.
    alternatives = " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)
    scope = f'owner:"{owner_token(user_id)}"'
    if session_id is not None:
        scope += f' AND sess:"{session_token(user_id, session_id)}"'
    return f"{scope} AND {{{' '.join(columns)}}}:({alternatives})"


class Transaction:
    """Statements of one write transaction, which holds the writer until it ends."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self._db = db

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """Run one statement and return its rows (RETURNING rows, or none)."""
        return list(await self._db.execute_fetchall(sql, params))

    async def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one INSERT/UPDATE/DELETE and return how many rows it changed."""
        async with self._db.execute(sql, params) as cursor:
            return cursor.rowcount

    async def enqueue(
        self, kind: str, payload: Mapping[str, Any], *, max_attempts: int = 5,
        run_after: float | None = None,
    ) -> int:
        """Queue a job that commits (or not) with this transaction; return its id."""
        return await _insert_job(self._db, kind, payload, max_attempts, time.time(), run_after)


class Store:
    """The memory database: one serialized writer, round-robin readers."""

    def __init__(
        self, path: Path, writer: aiosqlite.Connection, readers: list[aiosqlite.Connection],
        *, redact: Callable[[str], str] = keep,
    ) -> None:
        self.path = path
        # Applied to every turn's text before it is hashed and stored (MEMPROXY_REDACT);
        # facts, summaries and imports call it too.
        self.redact = redact
        self._writer = writer
        self._readers = readers
        self._next_reader = itertools.cycle(range(len(readers)))
        self._write_lock = asyncio.Lock()
        self._chunk_terms = TermSelector(self._read, table="chunks_fts", columns=FTS_COLUMNS)

    @classmethod
    async def open(
        cls, path: Path, *, readers: int = 4, redact: Callable[[str], str] = keep
    ) -> Store:
        """Create or upgrade the database at `path` and open its connections."""
        if readers < 1:
            raise ValueError("a store needs at least one reader connection")
        path.parent.mkdir(parents=True, exist_ok=True)
        read_only_uri = await asyncio.to_thread(_prepare_database, path)
        opened: list[aiosqlite.Connection] = []
        try:
            opened.append(await _connect(str(path)))
            for _ in range(readers):
                opened.append(await _connect(read_only_uri, uri=True))
        except BaseException:
            for conn in opened:
                await conn.close()
            raise
        return cls(path, opened[0], opened[1:], redact=redact)

    async def close(self) -> None:
        """Close every connection; safe to call twice."""
        for reader in self._readers:
            await reader.close()
        try:
            await self._writer.execute("PRAGMA optimize")
        except ValueError:  # already closed
            pass
        await self._writer.close()

    async def check(self) -> None:
        """Raise unless both the writer and a reader answer (readiness probe)."""
        # Touch a table: SELECT 1 alone succeeds without reading the file at all.
        probe = "SELECT COUNT(*) FROM migrations"
        await self._writer.execute_fetchall(probe)
        await self._read(probe)

    # -- turns ---------------------------------------------------------------------------

    async def append_turns(
        self,
        user_id: str,
        session_id: str,
        turns: Sequence[NewTurn],
        *,
        after: int | None = None,
        job_kind: str | None = "index",
        max_attempts: int = 5,
    ) -> AppendResult:
        """Log a conversation path exactly once, branching where history was edited."""
        if not turns:
            return AppendResult(after, [])
        # Redacted before hashing: a resent message hashes the same, so it is stored once.
        turns = [
            t if (text := self.redact(t.content)) == t.content else replace(t, content=text)
            for t in turns
        ]
        hashes = [content_hash(t.role, t.name, t.content) for t in turns]
        async with self._transaction() as db:
            parent_id, position = await _path_start(db, user_id, session_id, after)
            known = await _known_turns(db, user_id, session_id, hashes)
            if after is None and (0, hashes[0]) not in known:
                anchor = _window_anchor(known, hashes)
                if anchor is not None:
                    # A client that sends only its last N messages: continue where they are.
                    parent_id, position = await _path_start(db, user_id, session_id, anchor)
                    turns, hashes = turns[1:], hashes[1:]
            new_ids: list[int] = []
            for turn, digest in zip(turns, hashes, strict=True):
                turn_id = known.get((parent_id or 0, digest))
                if turn_id is None:
                    row = (user_id, session_id, parent_id, position, digest)
                    turn_id = await _insert_turn(db, row, turn)
                    new_ids.append(turn_id)
                parent_id, position = turn_id, position + 1
            await _touch_session(db, user_id, session_id, turns, len(new_ids))
            job_id = None
            if new_ids and job_kind is not None:
                payload = {"turn_ids": new_ids}
                job_id = await _insert_job(db, job_kind, payload, max_attempts, time.time())
        return AppendResult(parent_id, new_ids, job_id)

    async def get_turns(self, ids: Sequence[int]) -> list[Turn]:
        """The turns with these ids, in the order asked; unknown ids are skipped."""
        sql = f"SELECT {_TURN_COLUMNS} FROM turns WHERE id IN ({{marks}})"
        found = {turn.id: turn for turn in map(_turn, await self._read_in(sql, ids))}
        return [found[i] for i in ids if i in found]

    async def session_turns(self, user_id: str, session_id: str) -> list[Turn]:
        """Every turn of a session, all branches, in insertion order."""
        sql = f"SELECT {_TURN_COLUMNS} FROM turns WHERE user_id = ? AND session_id = ? ORDER BY id"
        return [_turn(row) for row in await self._read(sql, (user_id, session_id))]

    async def count_turns(self, user_id: str | None = None) -> int:
        """How many turns are stored, for one user or for everyone."""
        if user_id is None:
            rows = await self._read("SELECT COUNT(*) FROM turns")
        else:
            rows = await self._read("SELECT COUNT(*) FROM turns WHERE user_id = ?", (user_id,))
        return int(rows[0][0])

    # -- chunks and full-text search -----------------------------------------------------

    async def add_chunks(
        self, turn_id: int, chunks: Sequence[tuple[int, str, str, int]]
    ) -> list[int]:
        """Store (ordinal, kind, text, tokens) chunks of a turn; re-adding one updates it."""
        async with self._transaction() as db:
            rows = await db.execute_fetchall(
                "SELECT user_id, session_id, COALESCE(name, role) FROM turns WHERE id = ?",
                (turn_id,),
            )
            user_id, session_id, speaker = _only_row(rows, f"no turn with id {turn_id}")
            fresh, changed = await _diff_chunks(db, turn_id, chunks)
            if fresh:
                tokens = (owner_token(user_id), session_token(user_id, session_id))
                scope = (user_id, session_id, *tokens, speaker)
                await _insert_chunks(db, turn_id, scope, fresh)
            if changed:  # the update trigger re-indexes them; their ids stay the same
                await db.executemany(
                    "UPDATE chunks SET kind = ?, text = ?, tokens = ?"
                    " WHERE turn_id = ? AND ordinal = ?",
                    [(kind, text, n, turn_id, ordinal) for ordinal, kind, text, n in changed],
                )
            rows = await db.execute_fetchall(
                "SELECT ordinal, id FROM chunks WHERE turn_id = ? ORDER BY ordinal", (turn_id,)
            )
        wanted = {chunk[0] for chunk in chunks}
        return [int(row[1]) for row in rows if row[0] in wanted]

    async def get_chunks(self, ids: Sequence[int]) -> list[ChunkRow]:
        """The chunks with these ids, in the order asked; unknown ids are skipped."""
        sql = _CHUNK_SELECT + " WHERE c.id IN ({marks})"
        found = {chunk.id: chunk for chunk in map(_chunk, await self._read_in(sql, ids))}
        return [found[i] for i in ids if i in found]

    async def neighbour_chunks(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """(chunk id, neighbour id) pairs: the chunks just before and after each one.

        Before: the previous chunk of its turn, else the last chunk of the previous turn.
        After: the next chunk of its turn, else the first chunk of every following turn
        (a conversation that was edited and resent has several).
        """
        rows = await self._read_in(_NEIGHBOURS, ids)
        return [(int(row[0]), int(row[1])) for row in rows]

    async def fts_search(
        self, user_id: str, query: str, *, k: int, session_id: str | None = None
    ) -> list[tuple[int, float]]:
        """Best `k` (chunk_id, score) for free text within the user's chunks, best first.

        The words match a chunk's text or its speaker's name; the commonest are dropped when
        the rows they match pass a budget (memory.lexical).
        """
        if k <= 0:
            return []
        terms = await self._chunk_terms.select(search_terms(query))
        expression = match_expression(user_id, " ".join(terms), session_id, columns=FTS_COLUMNS)
        if expression is None:
            return []
        # rank is bm25 weighted (1, 0.5, 0, 0) by the migration; lower is better: negate it.
        rows = await self._read(
            "SELECT rowid, -rank FROM chunks_fts WHERE chunks_fts MATCH ? ORDER BY rank LIMIT ?",
            (expression, k),
        )
        return [(int(row[0]), float(row[1])) for row in rows]

    # -- jobs ----------------------------------------------------------------------------

    async def enqueue(
        self,
        kind: str,
        payload: Mapping[str, Any],
        *,
        max_attempts: int = 5,
        run_after: float | None = None,
    ) -> int:
        """Queue a job and return its id."""
        now = time.time()
        async with self._write_lock:
            return await _insert_job(self._writer, kind, payload, max_attempts, now, run_after)

    async def claim(self, kinds: Sequence[str] | None, limit: int, now: float) -> list[Job]:
        """Mark up to `limit` ready jobs running (attempts + 1) and return them, oldest first."""
        if limit <= 0 or (kinds is not None and not kinds):
            return []
        kind_filter = ""
        params: list[Any] = [now, now]
        if kinds is not None:
            kind_filter = f" AND kind IN ({', '.join('?' * len(kinds))})"
            params.extend(kinds)
        params.append(limit)
        rows = await self._write_returning(
            "UPDATE jobs SET status = 'running', attempts = attempts + 1, updated_at = ?"
            " WHERE id IN (SELECT id FROM jobs WHERE status = 'queued' AND run_after <= ?"
            f"{kind_filter} ORDER BY run_after, id LIMIT ?)"
            " RETURNING id, kind, payload, attempts, max_attempts, run_after",
            params,
        )
        rows.sort(key=lambda row: (row[5], row[0]))
        return [Job(row[0], row[1], json.loads(row[2]), row[3], row[4]) for row in rows]

    async def complete(self, job_id: int) -> None:
        """Mark a job done."""
        await self._write_one(
            "UPDATE jobs SET status = 'done', updated_at = ? WHERE id = ?", (time.time(), job_id)
        )

    async def retry_later(self, job_id: int, error: str, run_after: float) -> None:
        """Put a running job back in the queue, not before `run_after`."""
        # Only a running job: a late call must not revive a job already done or dead.
        await self._write_one(
            "UPDATE jobs SET status = 'queued', last_error = ?, run_after = ?, updated_at = ?"
            " WHERE id = ? AND status = 'running'",
            (error, run_after, time.time(), job_id),
        )

    async def bury(self, job_id: int, error: str) -> None:
        """Move a job to the dead letters, keeping its error."""
        await self._write_one(
            "UPDATE jobs SET status = 'dead', last_error = ?, updated_at = ? WHERE id = ?",
            (error, time.time(), job_id),
        )

    async def requeue_running(self) -> int:
        """Crash recovery: queue again the jobs left running; return how many."""
        now = time.time()
        async with self._transaction() as db:
            # A job that was mid-attempt at every crash may be what crashes the process.
            await db.execute(
                "UPDATE jobs SET status = 'dead', updated_at = ?, last_error ="
                " 'the process stopped during its last attempt; last error: '"
                " || COALESCE(last_error, 'none')"
                " WHERE status = 'running' AND attempts >= max_attempts",
                (now,),
            )
            async with db.execute(
                "UPDATE jobs SET status = 'queued', run_after = ?, updated_at = ?"
                " WHERE status = 'running'",
                (now, now),
            ) as cursor:
                return cursor.rowcount

    async def next_job_due(self) -> float | None:
        """When the earliest queued job becomes ready, or None when the queue is empty."""
        rows = await self._read("SELECT MIN(run_after) FROM jobs WHERE status = 'queued'")
        return None if rows[0][0] is None else float(rows[0][0])

    async def pending_jobs(self, due_before: float) -> int:
        """How many jobs are running or queued to become ready before `due_before`."""
        rows = await self._read(
            "SELECT COUNT(*) FROM jobs WHERE status = 'running'"
            " OR (status = 'queued' AND run_after <= ?)",
            (due_before,),
        )
        return int(rows[0][0])

    async def pending_between(self, first: int, last: int) -> int:
        """How many jobs with ids from `first` to `last` are queued or running."""
        rows = await self._read(
            "SELECT COUNT(*) FROM jobs WHERE id BETWEEN ? AND ?"
            " AND status IN ('queued', 'running')",
            (first, last),
        )
        return int(rows[0][0])

    async def job_counts(self) -> dict[str, int]:
        """Number of jobs in each status."""
        rows = await self._read("SELECT status, COUNT(*) FROM jobs GROUP BY status")
        return dict.fromkeys(_JOB_STATUSES, 0) | {str(row[0]): int(row[1]) for row in rows}

    async def dead_jobs(self, limit: int = 100) -> list[DeadJob]:
        """The most recently buried jobs with their errors."""
        rows = await self._read(
            "SELECT id, kind, payload, attempts, last_error, updated_at FROM jobs"
            " WHERE status = 'dead' ORDER BY updated_at DESC, id DESC LIMIT ?",
            (limit,),
        )
        return [DeadJob(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5]) for r in rows]

    async def prune_done_jobs(self, older_than: float) -> int:
        """Delete finished jobs last updated before `older_than`; return how many."""
        return await self._write_one(
            "DELETE FROM jobs WHERE status = 'done' AND updated_at < ?", (older_than,)
        )

    # -- request metrics -----------------------------------------------------------------

    async def record_request_metrics(self, row: RequestMetrics) -> None:
        """Store one request's memory metrics."""
        await self._write_one(
            "INSERT INTO request_metrics (created_at, user_id, session_id, request_id, model,"
            " items_json, injected_tokens, truncated, recall_ms, embed_ms, error)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.created_at, row.user_id, row.session_id, row.request_id, row.model,
                json.dumps(dict(row.items), sort_keys=True), row.injected_tokens,
                int(row.truncated), row.recall_ms, row.embed_ms, row.error,
            ),
        )  # fmt: skip

    async def prune_request_metrics(self, older_than: float) -> int:
        """Delete metrics rows created before `older_than`; return how many."""
        return await self._write_one(
            "DELETE FROM request_metrics WHERE created_at < ?", (older_than,)
        )

    # -- for modules that keep their own tables (facts, summaries, profiles) -------------

    async def read(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """Run one read-only statement on a reader connection and return its rows."""
        return await self._read(sql, params)

    @asynccontextmanager
    async def write(self) -> AsyncIterator[Transaction]:
        """One write transaction (BEGIN IMMEDIATE): committed on exit, rolled back on error."""
        async with self._transaction() as db:
            yield Transaction(db)

    # -- connection plumbing -------------------------------------------------------------

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._write_lock:
            # aiosqlite queues calls in order, so even when this task is cancelled
            # mid-await, the ROLLBACK runs after the statement that was interrupted.
            try:
                await _when_unlocked(lambda: self._writer.execute("BEGIN IMMEDIATE"))
                yield self._writer
                await self._writer.commit()
            except BaseException:
                await self._writer.rollback()
                raise

    async def _write_one(self, sql: str, params: Sequence[Any]) -> int:
        async with self._write_lock:
            cursor = await _when_unlocked(lambda: self._writer.execute(sql, params))
            async with cursor:
                return cursor.rowcount

    async def _write_returning(self, sql: str, params: Sequence[Any]) -> list[sqlite3.Row]:
        async with self._write_lock:
            return list(await _when_unlocked(lambda: self._writer.execute_fetchall(sql, params)))

    async def _read(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        reader = self._readers[next(self._next_reader)]
        return list(await reader.execute_fetchall(sql, params))

    async def _read_in(self, sql: str, ids: Sequence[int]) -> list[sqlite3.Row]:
        rows: list[sqlite3.Row] = []
        for start in range(0, len(ids), _IN_BATCH):
            batch = list(ids[start : start + _IN_BATCH])
            rows += await self._read(sql.format(marks=", ".join("?" * len(batch))), batch)
        return rows


# What a metrics row holds besides its user: take_request_metrics returns rows as these keys.
REQUEST_METRICS_FIELDS = (
    "created_at", "session_id", "request_id", "model", "items_json", "injected_tokens",
    "truncated", "recall_ms", "embed_ms", "error",
)


async def take_request_metrics(
    tx: Transaction, user_id: str, session_id: str | None = None
) -> list[dict[str, Any]]:
    """Delete the user's metrics rows (or one session's) in `tx`; return them, oldest first."""
    scope, params = ("", (user_id,)) if session_id is None else (
        " AND session_id = ?", (user_id, session_id))
    rows = await tx.execute(
        f"DELETE FROM request_metrics WHERE user_id = ?{scope}"
        f" RETURNING id, {', '.join(REQUEST_METRICS_FIELDS)}", params,
    )
    rows.sort(key=lambda row: int(row[0]))
    return [dict(zip(REQUEST_METRICS_FIELDS, row[1:], strict=True)) for row in rows]


async def put_request_metrics(
    tx: Transaction, user_id: str, rows: Sequence[Mapping[str, Any]]
) -> None:
    """Insert rows take_request_metrics returned, for `user_id` (undoing a clear)."""
    if rows:
        await tx.change(
            f"INSERT INTO request_metrics (user_id, {', '.join(REQUEST_METRICS_FIELDS)})"
            f" SELECT ?, {', '.join(f'value ->> {f!r}' for f in REQUEST_METRICS_FIELDS)}"
            " FROM json_each(?) ORDER BY key",
            (user_id, json.dumps([dict(row) for row in rows])),
        )


async def _when_unlocked(statement: Callable[[], Awaitable[_T]]) -> _T:
    """Run a statement that takes the write lock, again while another process (a backup, a
    sqlite3 shell) holds that lock past the busy timeout: a statement refused as "locked"
    changed nothing, so trying again is safe, and a turn is not lost to a long lock."""
    for attempt in itertools.count(1):
        try:
            return await statement()
        except sqlite3.OperationalError as exc:
            if attempt >= _LOCKED_ATTEMPTS or "locked" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _prepare_database(path: Path) -> str:
    """Migrate the file and return the URI that opens it read-only."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        # WAL is a property of the file: set once here, every later connection uses it.
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        migrations.apply(conn)
    finally:
        conn.close()
    return f"{path.resolve().as_uri()}?mode=ro"


async def _connect(database: str, *, uri: bool = False) -> aiosqlite.Connection:
    # isolation_level=None: transactions are begun explicitly, never implicitly.
    conn = await aiosqlite.connect(database, uri=uri, isolation_level=None)
    try:
        for pragma in (
            f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}",
            "PRAGMA foreign_keys = ON",
            "PRAGMA synchronous = NORMAL",
        ):
            await conn.execute(pragma)
    except BaseException:
        await conn.close()
        raise
    return conn


async def _path_start(
    db: aiosqlite.Connection, user_id: str, session_id: str, after: int | None
) -> tuple[int | None, int]:
    if after is None:
        return None, 0
    rows = await db.execute_fetchall(
        "SELECT position FROM turns WHERE id = ? AND user_id = ? AND session_id = ?",
        (after, user_id, session_id),
    )
    (position,) = _only_row(rows, f"turn {after} is not in session {session_id!r}")
    return after, int(position) + 1


def _window_anchor(known: dict[tuple[int, str], int], hashes: Sequence[str]) -> int | None:
    """The stored turn a sliding-window request starts at, if its first two turns match.

    The request's first message is not a conversation root, so it is either an edit (a new
    branch) or the oldest message of a truncated history. Only a match of at least the first
    two messages in a row counts as a window; of several, the longest matching run wins.
    """
    best, best_run = None, 1
    for (_, digest), start in known.items():
        if digest != hashes[0]:
            continue
        run, current = 1, start
        while run < len(hashes) and (current, hashes[run]) in known:
            current = known[(current, hashes[run])]
            run += 1
        if run > best_run:
            best, best_run = start, run
    return best


async def _known_turns(
    db: aiosqlite.Connection, user_id: str, session_id: str, hashes: Sequence[str]
) -> dict[tuple[int, str], int]:
    # One query per 500 messages of resent history instead of one per message.
    distinct = list(dict.fromkeys(hashes))
    known: dict[tuple[int, str], int] = {}
    for start in range(0, len(distinct), _IN_BATCH):
        batch = distinct[start : start + _IN_BATCH]
        rows = await db.execute_fetchall(
            "SELECT COALESCE(parent_id, 0), content_hash, id FROM turns WHERE user_id = ?"
            f" AND session_id = ? AND content_hash IN ({', '.join('?' * len(batch))})",
            (user_id, session_id, *batch),
        )
        known.update({(int(row[0]), str(row[1])): int(row[2]) for row in rows})
    return known


async def _insert_turn(
    db: aiosqlite.Connection, row: tuple[str, str, int | None, int, str], turn: NewTurn
) -> int:
    # No ON CONFLICT needed: BEGIN IMMEDIATE plus the write lock mean nobody can insert
    # between the lookup and this statement; the unique index still guards against bugs.
    inserted = await db.execute_fetchall(
        "INSERT INTO turns (user_id, session_id, parent_id, position, content_hash, role, name,"
        " content, created_at, model, tokens, request_id, incomplete)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        (
            *row, turn.role, turn.name, turn.content, turn.created_at, turn.model,
            turn.tokens, turn.request_id, int(turn.incomplete),
        ),
    )  # fmt: skip
    return int(_only_row(inserted, "insert returned no id")[0])


async def _diff_chunks(
    db: aiosqlite.Connection, turn_id: int, chunks: Sequence[tuple[int, str, str, int]]
) -> tuple[list[tuple[int, str, str, int]], list[tuple[int, str, str, int]]]:
    """Split chunks into those not stored yet and those stored with other content."""
    rows = await db.execute_fetchall(
        "SELECT ordinal, kind, text, tokens FROM chunks WHERE turn_id = ?", (turn_id,)
    )
    stored = {row[0]: tuple(row[1:]) for row in rows}
    fresh = [chunk for chunk in chunks if chunk[0] not in stored]
    changed = [c for c in chunks if c[0] in stored and stored[c[0]] != tuple(c[1:])]
    return fresh, changed


async def _insert_chunks(
    db: aiosqlite.Connection,
    turn_id: int,
    scope: tuple[str, str, str, str, str],
    chunks: Sequence[tuple[int, str, str, int]],
) -> None:
    await db.executemany(
        "INSERT INTO chunks (turn_id, ordinal, kind, text, tokens, user_id, session_id, owner,"
        " sess, speaker) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(turn_id, *chunk, *scope) for chunk in chunks],
    )
    # One statement for the batch: see the migration for why this is not a trigger.
    await db.execute(
        "INSERT INTO chunks_fts (rowid, text, speaker, owner, sess)"
        " SELECT id, text, speaker, owner, sess FROM chunks WHERE turn_id = ? AND ordinal IN (SELECT value FROM json_each(?))",
        (turn_id, json.dumps([chunk[0] for chunk in chunks])),
    )


async def _touch_session(
    db: aiosqlite.Connection, user_id: str, session_id: str, turns: Sequence[NewTurn], added: int
) -> None:
    times = [turn.created_at for turn in turns]
    await db.execute(
        "INSERT INTO sessions (user_id, session_id, created_at, last_active, turn_count)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (user_id, session_id) DO UPDATE SET"
        " last_active = MAX(last_active, excluded.last_active),"
        " turn_count = turn_count + excluded.turn_count",
        (user_id, session_id, min(times), max(times), added),
    )


async def _insert_job(
    db: aiosqlite.Connection,
    kind: str,
    payload: Mapping[str, Any],
    max_attempts: int,
    now: float,
    run_after: float | None = None,
) -> int:
    ready_at = now if run_after is None else run_after
    inserted = await db.execute_fetchall(
        "INSERT INTO jobs (kind, payload, status, attempts, max_attempts, run_after,"
        " created_at, updated_at) VALUES (?, ?, 'queued', 0, ?, ?, ?, ?) RETURNING id",
        (kind, json.dumps(payload), max_attempts, ready_at, now, now),
    )
    return int(_only_row(inserted, "insert returned no id")[0])


def _only_row(rows: Iterable[sqlite3.Row], error: str) -> sqlite3.Row:
    for row in rows:
        return row
    raise LookupError(error)


def _turn(row: sqlite3.Row) -> Turn:
    values = list(row)
    values[-1] = bool(values[-1])  # incomplete is stored as 0/1
    return Turn(*values)


def _chunk(row: sqlite3.Row) -> ChunkRow:
    return ChunkRow(*row)

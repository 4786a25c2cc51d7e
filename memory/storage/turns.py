"""Tables `turns`, `chunks` and `chunks_fts`: the conversation log and its lexical index.

A chunk is a piece of one turn (deleted with it by cascade) and is always read together with
its turn's role, name and time, so the three tables share this module. Turns are immutable;
`memory.log.turn_log` decides which turns of a request are new, these functions store them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field, fields

from memory.storage import pg_search
from memory.storage.database import (
    Connection,
    Row,
    Transaction,
    column,
    equal_to,
    fetch_in,
    first,
    in_values,
    only_row,
    scalar,
)
from memory.storage.fts import (
    CHUNK_COLUMNS,
    match_expression,
    owner_token,
    session_token,
    term_expression,
)

_CHUNK_SELECT = (
    "SELECT c.id, c.turn_id, c.user_id, c.session_id, c.ordinal, c.kind, c.text, c.tokens, "
    "t.role, t.name, t.created_at FROM chunks AS c JOIN turns AS t ON t.id = c.turn_id"
)
# (seed, neighbour) chunk pairs for neighbour_chunks; {marks} are the seed ids.
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
_SPEAKER_NAMES = """
WITH RECURSIVE names(name) AS (
    SELECT (SELECT name FROM turns WHERE user_id = ? AND name > '' ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT t.name FROM turns AS t WHERE t.user_id = ? AND t.name > names.name
            ORDER BY t.name LIMIT 1)
    FROM names WHERE names.name IS NOT NULL
)
SELECT name FROM names WHERE name IS NOT NULL
"""
ChunkSpec = tuple[int, str, str, int]  # ordinal, kind, text, tokens


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


_TURN_COLUMNS = ", ".join(f.name for f in fields(Turn))


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


# -- turns -----------------------------------------------------------------------------


async def position_of(tx: Connection, user_id: str, session_id: str, turn_id: int) -> int:
    """The position of a turn on its branch; LookupError unless it is in this session."""
    rows = await tx.fetch(
        "SELECT position FROM turns WHERE id = ? AND user_id = ? AND session_id = ?",
        (turn_id, user_id, session_id),
    )
    (position,) = only_row(rows, f"turn {turn_id} is not in session {session_id!r}")
    return int(position)


async def known_hashes(
    tx: Connection, user_id: str, session_id: str, hashes: Sequence[str]
) -> dict[tuple[int, str], int]:
    """{(parent id or 0, content hash): turn id} of the session's turns with these hashes."""
    # One query per 500 messages of resent history instead of one per message.
    distinct = list(dict.fromkeys(hashes))
    rows = await fetch_in(
        tx,
        "SELECT COALESCE(parent_id, 0), content_hash, id FROM turns WHERE user_id = ?"
        " AND session_id = ? AND content_hash IN ({marks})",
        distinct,
        prefix=(user_id, session_id),
    )
    return {(int(row[0]), str(row[1])): int(row[2]) for row in rows}


async def insert(
    tx: Transaction, user_id: str, session_id: str, turn: NewTurn, *,
    parent_id: int | None, position: int, digest: str,
) -> int:
    """Store one turn and return its id."""
    # No ON CONFLICT needed: BEGIN IMMEDIATE plus the write lock mean nobody can insert
    # between the lookup and this statement; the unique index still guards against bugs.
    return await scalar(
        tx, int, "INSERT INTO turns (user_id, session_id, parent_id, position, content_hash,"
        " role, name, content, created_at, model, tokens, request_id, incomplete)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
        (
            user_id, session_id, parent_id, position, digest, turn.role, turn.name,
            turn.content, turn.created_at, turn.model, turn.tokens, turn.request_id,
            int(turn.incomplete),
        ),
    )  # fmt: skip


async def get_many(conn: Connection, ids: Sequence[int]) -> list[Turn]:
    """The turns with these ids, in the order asked; unknown ids are skipped."""
    sql = f"SELECT {_TURN_COLUMNS} FROM turns WHERE id IN ({{marks}})"
    found = {turn.id: turn for turn in map(_turn, await fetch_in(conn, sql, ids))}
    return [found[i] for i in ids if i in found]


async def reply_by_request(conn: Connection, user_id: str, request_id: str) -> Turn | None:
    """The user's latest assistant turn stored under `request_id`, if any."""
    rows = await conn.fetch(
        f"SELECT {_TURN_COLUMNS} FROM turns WHERE user_id = ? AND request_id = ?"
        " AND role = 'assistant' ORDER BY id DESC LIMIT 1",
        (user_id, request_id),
    )
    return _turn(rows[0]) if rows else None


async def reply_owner(conn: Connection, request_id: str) -> str | None:
    """The user of the first assistant turn stored under `request_id`, if any (a reply's
    first owner: a later turn under the same id, by a client's X-Request-Id, is not)."""
    return await first(
        conn, str, "SELECT user_id FROM turns WHERE request_id = ? AND role = 'assistant'"
        " ORDER BY id LIMIT 1",
        (request_id,),
    )


async def of_session(conn: Connection, user_id: str, session_id: str) -> list[Turn]:
    """Every turn of a session, all branches, in insertion order."""
    sql = f"SELECT {_TURN_COLUMNS} FROM turns WHERE user_id = ? AND session_id = ? ORDER BY id"
    return [_turn(row) for row in await conn.fetch(sql, (user_id, session_id))]


async def page(conn: Connection, user_id: str, *, after: int, limit: int) -> list[Turn]:
    """Up to `limit` of the user's turns with ids above `after`, in id order."""
    sql = f"SELECT {_TURN_COLUMNS} FROM turns WHERE user_id = ? AND id > ? ORDER BY id LIMIT ?"
    return [_turn(row) for row in await conn.fetch(sql, (user_id, after, limit))]


async def ids_of_session(conn: Connection, user_id: str, session_id: str) -> list[int]:
    """Ids of every turn of a session."""
    sql = "SELECT id FROM turns WHERE user_id = ? AND session_id = ?"
    return await column(conn, int, sql, (user_id, session_id))


async def session_page_ids(
    conn: Connection, user_id: str, session_id: str, *, after: int, limit: int
) -> list[int]:
    """Up to `limit` ids of the session's turns above `after`, in id order."""
    return await column(
        conn, int, "SELECT id FROM turns WHERE user_id = ? AND session_id = ? AND id > ?"
        " ORDER BY id LIMIT ?",
        (user_id, session_id, after, limit),
    )


async def path_ids(conn: Connection, user_id: str, turn_id: int, limit: int) -> list[int]:
    """Ids of the at most `limit` turns ending at `turn_id` on its branch, oldest first."""
    return await column(
        conn, int, "WITH RECURSIVE path(id, parent, depth) AS ("
        " SELECT id, parent_id, 0 FROM turns WHERE id = ? AND user_id = ?"
        " UNION ALL SELECT t.id, t.parent_id, p.depth + 1 FROM turns AS t"
        " JOIN path AS p ON t.id = p.parent WHERE p.depth + 1 < ?)"
        " SELECT id FROM path ORDER BY depth DESC",
        (turn_id, user_id, limit),
    )


async def count(
    conn: Connection, user_id: str | None = None, *, session_id: str | None = None,
    role: str | None = None,
) -> int:
    """How many turns are stored: everyone's, a user's, or a session's (of one role)."""
    where, params = equal_to(user_id=user_id, session_id=session_id, role=role)
    return await scalar(conn, int, f"SELECT COUNT(*) FROM turns WHERE {where}", params)


async def count_by_session(
    conn: Connection, user_id: str, session_ids: Sequence[str]
) -> dict[str, int]:
    """How many turns each of these sessions holds (absent: none)."""
    rows = await fetch_in(
        conn, "SELECT session_id, COUNT(*) FROM turns WHERE user_id = ?"
        " AND session_id IN ({marks}) GROUP BY session_id", session_ids, prefix=(user_id,),
    )
    return {str(row[0]): int(row[1]) for row in rows}


async def titles(
    conn: Connection, user_id: str, session_ids: Sequence[str], chars: int
) -> dict[str, str]:
    """The first `chars` characters of each session's first user message."""
    rows = await fetch_in(
        conn, f"SELECT session_id, substr(content, 1, {int(chars)}) FROM turns AS t"
        " WHERE user_id = ? AND session_id IN ({marks}) AND role = 'user' AND id ="
        " (SELECT MIN(id) FROM turns WHERE user_id = t.user_id AND session_id = t.session_id"
        " AND role = 'user')", session_ids, prefix=(user_id,),
    )
    return {str(row[0]): str(row[1]) for row in rows}


async def delete(tx: Transaction, user_id: str, session_id: str | None = None) -> int:
    """Delete a user's turns (of one session); their chunks go by cascade. Return how many."""
    # One statement for all turns: parent links are checked at its end, when none is left.
    where, params = equal_to(user_id=user_id, session_id=session_id)
    return await tx.change(f"DELETE FROM turns WHERE {where}", params)


# -- chunks and full-text search -------------------------------------------------------


async def add_chunks(tx: Transaction, turn_id: int, chunks: Sequence[ChunkSpec]) -> list[int]:
    """Store (ordinal, kind, text, tokens) chunks of a turn; re-adding one updates it."""
    rows = await tx.fetch(
        "SELECT user_id, session_id, COALESCE(name, role) FROM turns WHERE id = ?", (turn_id,)
    )
    user_id, session_id, speaker = only_row(rows, f"no turn with id {turn_id}")
    fresh, changed = await _diff_chunks(tx, turn_id, chunks)
    if fresh:
        tokens = (owner_token(user_id), session_token(user_id, session_id))
        await _insert_chunks(tx, turn_id, (user_id, session_id, *tokens, speaker), fresh)
    if changed:  # the update trigger re-indexes them; their ids stay the same
        await tx.change_many(
            "UPDATE chunks SET kind = ?, text = ?, tokens = ? WHERE turn_id = ? AND ordinal = ?",
            [(kind, text, n, turn_id, ordinal) for ordinal, kind, text, n in changed],
        )
    rows = await tx.fetch(
        "SELECT ordinal, id FROM chunks WHERE turn_id = ? ORDER BY ordinal", (turn_id,)
    )
    wanted = {chunk[0] for chunk in chunks}
    return [int(row[1]) for row in rows if row[0] in wanted]


async def get_chunks(conn: Connection, ids: Sequence[int]) -> list[ChunkRow]:
    """The chunks with these ids, in the order asked; unknown ids are skipped."""
    rows = await fetch_in(conn, _CHUNK_SELECT + " WHERE c.id IN ({marks})", ids)
    found = {chunk.id: chunk for chunk in (ChunkRow(*row) for row in rows)}
    return [found[i] for i in ids if i in found]


async def neighbour_chunks(conn: Connection, ids: Sequence[int]) -> list[tuple[int, int]]:
    """(chunk id, neighbour id) pairs: the chunks just before and after each one.

    Before: the previous chunk of its turn, else the last chunk of the previous turn.
    After: the next chunk of its turn, else the first chunk of every following turn
    (a conversation that was edited and resent has several).
    """
    rows = await fetch_in(conn, _NEIGHBOURS, ids)
    return [(int(row[0]), int(row[1])) for row in rows]


async def search_chunks(
    conn: Connection, user_id: str, terms: Sequence[str], *, k: int, session_id: str | None = None
) -> list[tuple[int, float]]:
    """Best `k` (chunk_id, bm25) of the user's (session's) chunks holding any of the words
    (memory.storage.fts.search_terms) in their text or speaker, best first."""
    if conn.dialect == "postgres":
        params = [user_id] if session_id is None else [user_id, session_id]
        sql = pg_search.chunk_bm25_sql(session=session_id is not None)
        rows = await conn.fetch(sql, (list(terms), *params, k))
        return [(int(row[0]), float(row[1])) for row in rows]
    expression = match_expression(user_id, " ".join(terms), session_id, columns=CHUNK_COLUMNS)
    if expression is None:
        return []
    # rank is bm25 weighted (1, 0.5, 0, 0) by the migration; lower is better: negate it.
    rows = await conn.fetch(
        "SELECT rowid, -rank FROM chunks_fts WHERE chunks_fts MATCH ? ORDER BY rank LIMIT ?",
        (expression, k),
    )
    return [(int(row[0]), float(row[1])) for row in rows]


async def chunk_term_counts(conn: Connection, terms: Sequence[str]) -> list[int]:
    """How many chunks (of every user) each word matches, in the order given."""
    if conn.dialect == "postgres":
        return await column(conn, int, pg_search.term_counts_sql("chunks"), (list(terms),))
    # One statement counts every word; each is a quoted FTS5 string.
    one = "(SELECT count(*) FROM chunks_fts WHERE chunks_fts MATCH ?)"
    rows = await conn.fetch(
        "SELECT " + ", ".join([one] * len(terms)),
        [term_expression(term, CHUNK_COLUMNS) for term in terms],
    )
    return [int(n) for n in rows[0]]


async def speaker_names(conn: Connection, user_id: str) -> list[str]:
    """The distinct names the user's turns were said under, in name order."""
    # A skip scan of turns_by_name: one index seek per distinct name, however many turns.
    return await column(conn, str, _SPEAKER_NAMES, (user_id, user_id))


async def existing_chunks(conn: Connection, ids: Sequence[int]) -> set[int]:
    """Which of these chunk ids still exist."""
    among, values = in_values(conn, ids)
    return set(await column(conn, int, f"SELECT id FROM chunks WHERE id {among}", (values,)))


async def all_ids(conn: Connection) -> list[int]:
    """Every turn's id, oldest first (a full rebuild of the vectors)."""
    return await column(conn, int, "SELECT id FROM turns ORDER BY id")


async def chunked_turn_ids(conn: Connection) -> list[int]:
    """Ids of every turn that has chunks, ascending."""
    return await column(conn, int, "SELECT DISTINCT turn_id FROM chunks ORDER BY turn_id")


async def count_chunks(conn: Connection, user_id: str) -> int:
    """How many chunks a user's turns have."""
    return await scalar(conn, int, "SELECT COUNT(*) FROM chunks WHERE user_id = ?", (user_id,))


async def delete_chunks(tx: Transaction, user_id: str, session_id: str | None = None) -> list[int]:
    """Delete a user's chunks (of one session) and return their ids."""
    where, params = equal_to(user_id=user_id, session_id=session_id)
    return await column(tx, int, f"DELETE FROM chunks WHERE {where} RETURNING id", params)


async def _diff_chunks(
    tx: Transaction, turn_id: int, chunks: Sequence[ChunkSpec]
) -> tuple[list[ChunkSpec], list[ChunkSpec]]:
    """Split chunks into those not stored yet and those stored with other content."""
    rows = await tx.fetch(
        "SELECT ordinal, kind, text, tokens FROM chunks WHERE turn_id = ?", (turn_id,)
    )
    stored = {row[0]: tuple(row[1:]) for row in rows}
    fresh = [chunk for chunk in chunks if chunk[0] not in stored]
    changed = [c for c in chunks if c[0] in stored and stored[c[0]] != tuple(c[1:])]
    return fresh, changed


async def _insert_chunks(
    tx: Transaction, turn_id: int, scope: tuple[str, str, str, str, str],
    chunks: Sequence[ChunkSpec],
) -> None:
    await tx.change_many(
        "INSERT INTO chunks (turn_id, ordinal, kind, text, tokens, user_id, session_id, owner,"
        " sess, speaker) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(turn_id, *chunk, *scope) for chunk in chunks],
    )
    if tx.dialect == "postgres":
        return  # a trigger indexes each row (memory.storage.postgres_schema)
    # One statement for the batch: see the migration for why this is not a trigger.
    await tx.change(
        "INSERT INTO chunks_fts (rowid, text, speaker, owner, sess)"
        " SELECT id, text, speaker, owner, sess FROM chunks WHERE turn_id = ?"
        " AND ordinal IN (SELECT value FROM json_each(?))",
        (turn_id, json.dumps([chunk[0] for chunk in chunks])),
    )


def _turn(row: Row) -> Turn:
    values = list(row)
    values[-1] = bool(values[-1])  # incomplete is stored as 0/1
    return Turn(*values)


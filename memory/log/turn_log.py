"""The turn log: every message of every conversation, stored exactly once.

Clients resend the whole history on every request. A message is identified by its content
hash and the turn before it, so a resent history stores nothing new, an edited message starts
a new branch, and a client that sends only its last N messages continues where they are.
The SQL is memory.storage.turns'; this module decides which turns of a request are new.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from memory.log.messages import TURN_ROLES, turn_text
from memory.redact import keep
from memory.storage import jobs, sessions, turns
from memory.storage.database import Database, Transaction
from memory.storage.turns import ChunkRow, ChunkSpec, NewTurn, Turn
from memory.tokens import count_tokens, off_loop

INDEX_JOB = "index"  # the job that chunks, embeds and indexes new turns (memory.engine)


def new_turns(
    messages: Sequence[Mapping[str, Any]], *, model: str, request_id: str | None, now: float,
    count: bool = True,
) -> tuple[list[NewTurn], list[int]]:
    """The turns memory keeps of `messages`, and the index of the message each came from."""
    return _turns(_said(messages), model, request_id, now, count)


async def counted_turns(
    messages: Sequence[Mapping[str, Any]], *, model: str, request_id: str | None, now: float
) -> tuple[list[NewTurn], list[int]]:
    """`new_turns`, counted off the event loop when the messages are long (memory.tokens)."""
    said = _said(messages)
    work = functools.partial(_turns, said, model, request_id, now, True)
    return await off_loop(sum(len(text) for _, _, text in said), work)


def _said(messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, Mapping[str, Any], str]]:
    return [(i, m, text) for i, m in enumerate(messages)
            if m.get("role") in TURN_ROLES and (text := turn_text(m))]


def _turns(
    said: Sequence[tuple[int, Mapping[str, Any], str]], model: str, request_id: str | None,
    now: float, count: bool,
) -> tuple[list[NewTurn], list[int]]:
    turns = [NewTurn(role=m["role"], content=text, name=m.get("name"), created_at=now,
                     model=model, tokens=count_tokens(text, model) if count else 0,
                     request_id=request_id) for _, m, text in said]
    return turns, [i for i, _, _ in said]


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Outcome of append_turns: the path's last turn, the turns inserted, the job enqueued,
    and the id of each turn given (a sliding window's first turn: the stored one it matched)."""

    last_id: int | None
    new_ids: list[int]
    job_id: int | None = None
    ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReplyChain:
    """A stored conversation that ends at one reply: where a continuation goes on."""

    session_id: str
    last_turn_id: int
    turns: list[Turn]  # the path up to and including the reply, oldest first


def content_hash(role: str, name: str | None, content: str) -> str:
    """Identity of a message for exactly-once logging; whitespace-only edits keep it."""
    text = content.replace("\r\n", "\n").replace("\r", "\n").strip()
    return hashlib.sha256(json.dumps([role, name, text]).encode()).hexdigest()


class TurnLog:
    """Turns and their chunks in one database."""

    def __init__(self, db: Database, *, redact: Callable[[str], str] = keep) -> None:
        self.db = db
        # Applied to every turn's text before it is hashed and stored (MEMPROXY_REDACT).
        self.redact = redact

    async def append_turns(
        self,
        user_id: str,
        session_id: str,
        new: Sequence[NewTurn],
        *,
        after: int | None = None,
        job_kind: str | None = INDEX_JOB,
        max_attempts: int = 5,
        then: Callable[[Transaction, int], Awaitable[None]] | None = None,
    ) -> AppendResult:
        """Log a conversation path exactly once, branching where history was edited.

        `then(tx, turn_id)` runs in the same transaction when the path's last turn is new
        (the reply's learning jobs), so both are stored or neither is.
        """
        if not new:
            return AppendResult(after, [])
        new = self._redacted(new)
        hashes = [content_hash(t.role, t.name, t.content) for t in new]
        async with self.db.write() as tx:
            known = await turns.known_hashes(tx, user_id, session_id, hashes)
            start, ids = _stored_path(known, hashes, after)
            # A sliding window's first turn is the stored one it starts at, not a step after it.
            window = int(start != after)
            at = -1 if start is None else await turns.position_of(tx, user_id, session_id, start)
            parent_id, position = ids[-1] if ids else start, at + 1 + len(ids) - window
            # Past the stored ones, every turn is new: its parent was just inserted.
            new_ids: list[int] = []
            for turn, digest in zip(new[len(ids) :], hashes[len(ids) :], strict=True):
                parent_id = await turns.insert(
                    tx, user_id, session_id, turn, parent_id=parent_id, position=position,
                    digest=digest,
                )
                new_ids.append(parent_id)
                position += 1
            times = [turn.created_at for turn in new[window:]]
            await sessions.touch(tx, user_id, session_id, times, len(new_ids))
            job_id = None
            if new_ids and job_kind is not None:
                job_id = await jobs.enqueue(
                    tx, job_kind, {"turn_ids": new_ids}, max_attempts=max_attempts,
                    owner=user_id,
                )
            if then is not None and new_ids and new_ids[-1] == parent_id:
                await then(tx, parent_id)
        return AppendResult(parent_id, new_ids, job_id, ids + new_ids)

    async def locate(
        self, user_id: str, session_id: str, path: Sequence[NewTurn], *, after: int | None = None
    ) -> list[int]:
        """The ids of the stored turns `path` starts with (what append_turns would find
        without storing anything): as many as are stored, in order."""
        if not path:
            return []
        path = self._redacted(path)
        hashes = [content_hash(t.role, t.name, t.content) for t in path]
        known = await turns.known_hashes(self.db, user_id, session_id, hashes)
        return _stored_path(known, hashes, after)[1]

    def _redacted(self, new: Sequence[NewTurn]) -> list[NewTurn]:
        # Redacted before hashing: a resent message hashes the same, so it is stored once.
        return [
            t if (text := self.redact(t.content)) == t.content else replace(t, content=text)
            for t in new
        ]

    async def get_turns(self, ids: Sequence[int]) -> list[Turn]:
        """The turns with these ids, in the order asked; unknown ids are skipped."""
        return await turns.get_many(self.db, ids)

    async def session_turns(self, user_id: str, session_id: str) -> list[Turn]:
        """Every turn of a session, all branches, in insertion order."""
        return await turns.of_session(self.db, user_id, session_id)

    async def count_turns(self, user_id: str | None = None) -> int:
        """How many turns are stored, for one user or for everyone."""
        return await turns.count(self.db, user_id)

    async def path(self, user_id: str, turn_id: int, limit: int) -> list[Turn]:
        """The conversation path ending at `turn_id`, oldest first, at most `limit` turns."""
        return await turns.get_many(self.db, await turns.path_ids(self.db, user_id, turn_id, limit))

    async def reply_chain(self, user_id: str, request_id: str, limit: int) -> ReplyChain | None:
        """The conversation ending at the reply stored under `request_id` (its last `limit`
        turns), or None when no such reply is stored for this user."""
        reply = await turns.reply_by_request(self.db, user_id, request_id)
        if reply is None:
            return None
        return ReplyChain(reply.session_id, reply.id, await self.path(user_id, reply.id, limit))

    async def reply_owner(self, request_id: str) -> str | None:
        """The user the reply stored under `request_id` was first stored for, if any."""
        return await turns.reply_owner(self.db, request_id)

    async def add_chunks(self, turn_id: int, chunks: Sequence[ChunkSpec]) -> list[int]:
        """Store (ordinal, kind, text, tokens) chunks of a turn; re-adding one updates it."""
        async with self.db.write() as tx:
            return await turns.add_chunks(tx, turn_id, chunks)

    async def get_chunks(self, ids: Sequence[int]) -> list[ChunkRow]:
        """The chunks with these ids, in the order asked; unknown ids are skipped."""
        return await turns.get_chunks(self.db, ids)

    async def neighbour_chunks(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """(chunk id, neighbour id) pairs: the chunks just before and after each one."""
        return await turns.neighbour_chunks(self.db, ids)


def _stored_path(
    known: dict[tuple[int, str], int], hashes: Sequence[str], after: int | None
) -> tuple[int | None, list[int]]:
    """Where a path goes on from (`after`, or the stored turn a sliding window starts at), and
    the ids of its leading turns stored already, in order (a window's first turn first)."""
    start, found = after, []
    if after is None and (0, hashes[0]) not in known:
        # A client that sends only its last N messages: continue where they are.
        start = _window_anchor(known, hashes)
        found = [] if start is None else [start]
    parent = start
    for digest in hashes[len(found) :]:
        turn_id = known.get((parent or 0, digest))
        if turn_id is None:
            break
        found.append(turn_id)
        parent = turn_id
    return start, found


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

"""Importing records (memory/records.py, or OpenAI-format conversations) into one user.

Idempotent: turns are logged through `Store.append_turns`, which stores each message of a
conversation path once; a fact chain is skipped when its first version is already there
(same text, category and first-seen time), a summary when its session already has one with
the same text and time. Importing the same file twice adds nothing the second time.

New turns are indexed by the durable job queue (one index job per batch of turns), facts and
summaries by `sync_vectors` jobs, exactly as if they had been learned live.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memory.facts import queue_sync
from memory.profiles import ProfileStore
from memory.redact import redact_record
from memory.store import NewTurn, Store, Transaction, owner_token, session_token
from memory.tokens import count_tokens

TURN_BATCH = 200
TOKEN_MODEL = "gpt-4o"
SessionOf = Callable[[Sequence[Mapping[str, Any]]], str]
Key = int | tuple[str, int]  # a record's own id, or a made-up one for records without


_KINDS = ("turns", "facts", "summaries", "profile")


@dataclass
class ImportReport:
    """What an import added and what it found already there."""

    added: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {"added": dict(self.added), "skipped": dict(self.skipped)}


@dataclass
class _Chain:
    session_id: str
    after: int | None
    keys: list[Key] = field(default_factory=list)
    turns: list[NewTurn] = field(default_factory=list)


class Importer:
    """Writes checked records into one user's memory."""

    def __init__(
        self, store: Store, profiles: ProfileStore, *, index_job: str, max_attempts: int,
        max_pinned: int, notify: Callable[[], None],
    ) -> None:
        self.store = store
        self.max_pinned = max_pinned
        self.profiles = profiles
        self.index_job = index_job
        self.max_attempts = max_attempts
        self.notify = notify

    async def run(
        self, user_id: str, records: Sequence[Mapping[str, Any]], *,
        session_of: SessionOf | None = None,
    ) -> ImportReport:
        """Import checked records (see record_checks.check_record) for `user_id`."""
        report = ImportReport()
        turn_map = await _TurnWriter(self, user_id, report, session_of).write(records)
        redact = self.store.redact
        facts = [redact_record(r, redact) for r in records if r["type"] == "fact"]
        summaries = [redact_record(r, redact) for r in records if r["type"] == "summary"]
        if facts or summaries:
            async with self.store.write() as tx:
                await _write_facts(tx, user_id, facts, turn_map, report, self.max_pinned)
                await _write_summaries(tx, user_id, summaries, turn_map, report)
        for record in records:
            if record["type"] == "profile":
                await self._profile(user_id, record, report)
        self.notify()
        return report

    async def _profile(self, user_id: str, record: Mapping[str, Any], report: ImportReport) -> None:
        if not record["consent"]:
            report.skipped["profile"] += 1
            return  # an import never revokes consent; no consent, no profile
        await self.profiles.set_consent(user_id, True)
        body = record["profile"]
        current = await self.profiles.get(user_id)
        if body is None or (
            current is not None
            and (current.fields, current.text) == self.profiles.redacted(body["fields"], body["text"])
        ):
            report.skipped["profile"] += 1
            return
        await self.profiles.put(user_id, body["fields"], body["text"])
        report.added["profile"] += 1


class _TurnWriter:
    """Logs turn and conversation records as conversation paths, mapping old ids to new."""

    def __init__(
        self, importer: Importer, user_id: str, report: ImportReport, session_of: SessionOf | None
    ) -> None:
        self.importer = importer
        self.user_id = user_id
        self.report = report
        self.session_of = session_of or _content_session
        # The file's turn ids, or made-up keys for turns without one -> stored ids.
        self.ids: dict[Key, int] = {}
        self.session_of_key: dict[Key, str] = {}
        self.last_key: dict[str, Key] = {}
        self.synthetic = 0
        self.chain: _Chain | None = None

    async def write(self, records: Sequence[Mapping[str, Any]]) -> dict[Key, int]:
        for record in records:
            if record["type"] == "turn":
                await self._turn(record)
            elif record["type"] == "conversation":
                await self._conversation(record)
        await self._flush()
        return self.ids

    async def _turn(self, record: Mapping[str, Any]) -> None:
        session = record["session_id"]
        key: Key = record["id"] if record["id"] is not None else self._new_key()
        parent = record["parent_id"] if record["has_parent"] else self.last_key.get(session)
        if parent is not None and self.session_of_key.get(parent, session) != session:
            parent = None  # a parent in another session is not a parent
        chain = self.chain
        if chain is None or chain.session_id != session or not chain.keys or chain.keys[-1] != parent:
            await self._flush()
            chain = self.chain = _Chain(session, self.ids.get(parent) if parent is not None else None)
        model = record["model"]
        tokens = record["tokens"]
        chain.keys.append(key)
        chain.turns.append(NewTurn(
            record["role"], record["content"], name=record["name"],
            created_at=record["created_at"], model=model, request_id=record["request_id"],
            tokens=count_tokens(record["content"], model or TOKEN_MODEL) if tokens is None else tokens,
            incomplete=record["incomplete"],
        ))
        self.session_of_key[key] = session
        self.last_key[session] = key

    async def _conversation(self, record: Mapping[str, Any]) -> None:
        await self._flush()
        if not record["turns"]:
            return
        session = record["session_id"] or self.session_of(record["messages"])
        chain = self.chain = _Chain(session, None)
        for turn in record["turns"]:
            chain.keys.append(self._new_key())
            chain.turns.append(NewTurn(
                turn["role"], turn["content"], name=turn["name"], created_at=turn["created_at"],
                tokens=count_tokens(turn["content"], TOKEN_MODEL),
            ))
        await self._flush()

    async def _flush(self) -> None:
        chain, self.chain = self.chain, None
        if chain is None:
            return
        after = chain.after
        store = self.importer.store
        for start in range(0, len(chain.turns), TURN_BATCH):
            turns = chain.turns[start:start + TURN_BATCH]
            result = await store.append_turns(
                self.user_id, chain.session_id, turns, after=after,
                job_kind=self.importer.index_job, max_attempts=self.importer.max_attempts,
            )
            self.report.added["turns"] += len(result.new_ids)
            self.report.skipped["turns"] += len(turns) - len(result.new_ids)
            assert result.last_id is not None
            stored = await _path_ids(store, result.last_id, len(turns))
            self.ids.update(zip(chain.keys[start:start + TURN_BATCH], stored, strict=True))
            after = result.last_id

    def _new_key(self) -> Key:
        self.synthetic += 1
        return ("made-up", self.synthetic)


async def _path_ids(store: Store, last_id: int, count: int) -> list[int]:
    """The ids of the `count` turns ending at `last_id` on its path, oldest first."""
    rows = await store.read(
        "WITH RECURSIVE path(id, parent_id, depth) AS ("
        " SELECT id, parent_id, 1 FROM turns WHERE id = ?"
        " UNION ALL SELECT t.id, t.parent_id, p.depth + 1 FROM turns AS t"
        " JOIN path AS p ON t.id = p.parent_id WHERE p.depth < ?)"
        " SELECT id FROM path ORDER BY depth DESC",
        (last_id, count),
    )
    return [int(row[0]) for row in rows]


def _content_session(messages: Sequence[Mapping[str, Any]]) -> str:
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True, default=str).encode())
    return "import-" + digest.hexdigest()[:24]


async def _write_facts(
    tx: Transaction, user_id: str, records: Sequence[Mapping[str, Any]],
    turn_map: Mapping[Key, int], report: ImportReport, max_pinned: int,
) -> None:
    chains: dict[Key, list[Mapping[str, Any]]] = {}
    root_of: dict[Key, Key] = {}
    for i, record in enumerate(records):
        key: Key = record["id"] if record["id"] is not None else ("made-up", i)
        previous = record["previous_id"]
        root = root_of.get(previous, key) if previous is not None else key
        root_of[key] = root
        chains.setdefault(root, []).append(record)
    new_ids: list[int] = []
    for chain in chains.values():
        if await _fact_chain_exists(tx, user_id, chain[0]):
            report.skipped["facts"] += len(chain)
            continue
        new_ids += await _insert_fact_chain(tx, user_id, chain, turn_map, max_pinned)
        report.added["facts"] += len(chain)
    await queue_sync(tx, facts=new_ids)


async def _fact_chain_exists(tx: Transaction, user_id: str, first: Mapping[str, Any]) -> bool:
    if first["first_seen"] is not None:
        rows = await tx.execute(
            "SELECT 1 FROM facts WHERE user_id = ? AND previous_id IS NULL AND text = ?"
            " AND category = ? AND first_seen = ? LIMIT 1",
            (user_id, first["text"], first["category"], first["first_seen"]),
        )
    else:  # a hand-written fact: the same active fact counts as already there
        rows = await tx.execute(
            "SELECT 1 FROM facts WHERE user_id = ? AND text = ? AND category = ?"
            " AND valid_to IS NULL LIMIT 1",
            (user_id, first["text"], first["category"]),
        )
    return bool(rows)


async def _insert_fact_chain(
    tx: Transaction, user_id: str, chain: Sequence[Mapping[str, Any]],
    turn_map: Mapping[Key, int], max_pinned: int,
) -> list[int]:
    now = time.time()
    new_of: dict[int, int] = {}
    inserted: list[int] = []
    for record in chain:
        first_seen = record["first_seen"] or now
        created = record["created_at"] or now
        previous = new_of.get(record["previous_id"]) if record["previous_id"] is not None else None
        rows = await tx.execute(
            "INSERT INTO facts (chain_id, user_id, text, category, confidence, importance,"
            " mentions, source, source_session, source_turn_ids, pinned, first_seen, last_seen,"
            " expires_at, version, previous_id, valid_from, valid_to, created_at, updated_at,"
            " owner) VALUES (0, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " RETURNING id",
            (user_id, record["text"], record["category"], record["confidence"],
             record["importance"], record["mentions"], record["source"], record["source_session"],
             json.dumps(sorted({turn_map[t] for t in record["source_turn_ids"] if t in turn_map})),
             first_seen, record["last_seen"] or first_seen, record["expires_at"],
             record["version"], previous, record["valid_from"] or created, record["valid_to"],
             created, record["updated_at"] or created, owner_token(user_id)),
        )  # fmt: skip
        inserted.append(int(rows[0][0]))
        if record["id"] is not None:
            new_of[record["id"]] = inserted[-1]
    await tx.change(
        "UPDATE facts SET chain_id = ? WHERE id IN (SELECT value FROM json_each(?))",
        (inserted[0], json.dumps(inserted)),
    )
    for record, fact_id in zip(chain, inserted, strict=True):
        successor = new_of.get(record["superseded_by"]) if record["superseded_by"] else None
        if successor is not None:
            await tx.change("UPDATE facts SET superseded_by = ? WHERE id = ?", (successor, fact_id))
        if record["pinned"] and record["valid_to"] is None:
            await _pin_if_room(tx, user_id, fact_id, max_pinned)
    return inserted


async def _pin_if_room(tx: Transaction, user_id: str, fact_id: int, max_pinned: int) -> None:
    # Over the limit (pins made since the export), the fact comes back unpinned.
    rows = await tx.execute(
        "SELECT COUNT(*) FROM facts WHERE user_id = ? AND pinned = 1 AND valid_to IS NULL",
        (user_id,),
    )
    if int(rows[0][0]) < max_pinned:
        await tx.change("UPDATE facts SET pinned = 1 WHERE id = ?", (fact_id,))


async def _write_summaries(
    tx: Transaction, user_id: str, records: Sequence[Mapping[str, Any]],
    turn_map: Mapping[Key, int], report: ImportReport,
) -> None:
    now = time.time()
    new_of: dict[int, int] = {}
    inserted: list[tuple[Mapping[str, Any], int]] = []
    for record in records:
        created = record["created_at"]
        rows = await tx.execute(
            "SELECT id FROM summaries WHERE user_id = ? AND session_id = ? AND text = ?"
            " AND (? IS NULL OR created_at = ?) LIMIT 1",
            (user_id, record["session_id"], record["text"], created, created),
        )
        if rows:
            report.skipped["summaries"] += 1
            continue
        cited = sorted({turn_map[t] for t in record["source_turn_ids"] if t in turn_map})
        last = turn_map.get(record["last_turn_id"] or 0) or (cited[-1] if cited else 0)
        rows = await tx.execute(
            "INSERT INTO summaries (user_id, session_id, text, data, source_turn_ids,"
            " last_turn_id, user_turns, tokens, created_at, owner, sess)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (user_id, record["session_id"], record["text"], json.dumps(record["data"]),
             json.dumps(cited), last, record["user_turns"], record["tokens"], created or now,
             owner_token(user_id), session_token(user_id, record["session_id"])),
        )  # fmt: skip
        inserted.append((record, int(rows[0][0])))
        if record["id"] is not None:
            new_of[record["id"]] = inserted[-1][1]
        report.added["summaries"] += 1
    for record, summary_id in inserted:
        successor = new_of.get(record["superseded_by"]) if record["superseded_by"] else None
        if successor is not None:
            await tx.change(
                "UPDATE summaries SET superseded_by = ? WHERE id = ?", (successor, summary_id)
            )
    await queue_sync(tx, summaries=[summary_id for _, summary_id in inserted])

"""Importing records (memory/admin/records.py, or OpenAI-format conversations) into one user.

Idempotent: turns are logged through `TurnLog.append_turns`, which stores each message of a
conversation path once; a summary is skipped when its session already has one with the same
text and time. Importing the same file twice adds nothing the second time.

A fact chain whose first version is already there (same text, category and first-seen time)
is the same fact: if the file's chain changed later than the stored one (a newer export,
after an edit or an unpin), the versions past the stored current one are added to the stored
chain and the current version takes the file's pin ("updated"); otherwise it is skipped
(docs/memory-api.md, Import).

New turns are indexed by the durable job queue (one index job per batch of turns), facts and
summaries by `sync_vectors` jobs, exactly as if they had been learned live.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any

from memory.admin.record_checks import IGNORED
from memory.learning.facts import queue_sync
from memory.learning.profiles import ProfileStore
from memory.log.turn_log import TurnLog
from memory.redact import redact_record
from memory.storage import facts, summaries, turns
from memory.storage.database import Transaction
from memory.storage.facts import Fact, NewFact
from memory.storage.summaries import NewSummary
from memory.storage.turns import NewTurn
from memory.tokens import count_tokens

TURN_BATCH = 200
TOKEN_MODEL = "gpt-4o"
SessionOf = Callable[[Sequence[Mapping[str, Any]]], str]
Key = int | tuple[str, int]  # a record's own id, or a made-up one for records without


_KINDS = ("turns", "facts", "summaries", "profile")


@dataclass
class ImportReport:
    """What an import added, what it found already there, and what it left out."""

    added: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))
    # Fact versions already stored that took the file's newer state (a pin changed).
    updated: dict[str, int] = field(default_factory=lambda: {"facts": 0})
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_KINDS, 0))
    # Conversation messages left out on purpose, by reason (record_checks.IGNORED).
    ignored: dict[str, int] = field(default_factory=lambda: dict.fromkeys(IGNORED, 0))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return asdict(self)


@dataclass
class _Chain:
    session_id: str
    after: int | None
    keys: list[Key] = field(default_factory=list)
    turns: list[NewTurn] = field(default_factory=list)


@dataclass(eq=False)
class Importer:
    """Writes checked records into one user's memory."""

    log: TurnLog
    profiles: ProfileStore
    _: KW_ONLY
    index_job: str
    max_attempts: int
    max_pinned: int
    notify: Callable[[], None]

    async def run(
        self, user_id: str, records: Sequence[Mapping[str, Any]], *,
        session_of: SessionOf | None = None, kept_turns: Collection[int] = (),
    ) -> ImportReport:
        """Import checked records (see record_checks.check_record) for `user_id`.
        `kept_turns`: ids of the user's stored turns that facts and summaries may cite as
        they are (an undone delete); any other turn id must come with the records."""
        report = ImportReport()
        turn_map: dict[Key, int] = {turn_id: turn_id for turn_id in kept_turns}
        turn_map.update(await _TurnWriter(self, user_id, report, session_of).write(records))
        redact = self.log.redact
        facts = [redact_record(r, redact) for r in records if r["type"] == "fact"]
        summaries = [redact_record(r, redact) for r in records if r["type"] == "summary"]
        if facts or summaries:
            async with self.log.db.write() as tx:
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
        for reason, count in record["ignored"].items():
            self.report.ignored[reason] += count
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
        log = self.importer.log
        for start in range(0, len(chain.turns), TURN_BATCH):
            batch = chain.turns[start:start + TURN_BATCH]
            result = await log.append_turns(
                self.user_id, chain.session_id, batch, after=after,
                job_kind=self.importer.index_job, max_attempts=self.importer.max_attempts,
            )
            self.report.added["turns"] += len(result.new_ids)
            self.report.skipped["turns"] += len(batch) - len(result.new_ids)
            assert result.last_id is not None
            stored = await turns.path_ids(log.db, self.user_id, result.last_id, len(batch))
            self.ids.update(zip(chain.keys[start:start + TURN_BATCH], stored, strict=True))
            after = result.last_id

    def _new_key(self) -> Key:
        self.synthetic += 1
        return ("made-up", self.synthetic)


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
        stored = await _stored_chain(tx, user_id, chain[0])
        if stored is not None:
            added, changed = await _apply_newer(tx, user_id, stored, chain, turn_map, max_pinned)
        else:  # a new chain: every version is added
            added, changed = await _insert_fact_chain(tx, user_id, chain, turn_map, max_pinned), []
        new_ids += added + changed
        report.added["facts"] += len(added)
        report.updated["facts"] += len(changed)
        report.skipped["facts"] += len(chain) - len(added) - len(changed)
    await queue_sync(tx, facts=new_ids)


async def _stored_chain(
    tx: Transaction, user_id: str, first: Mapping[str, Any]
) -> list[Fact] | None:
    """The stored versions of the fact the file's chain starts with, oldest first; None
    when it is new."""
    if first["first_seen"] is not None:
        found = await facts.first_version(
            tx, user_id, first["text"], first["category"], first["first_seen"]
        )
        return None if found is None else await facts.history(tx, user_id, found)
    # A hand-written fact: the same active fact counts as already there, and has no newer.
    exists = await facts.current_exists(tx, user_id, first["text"], first["category"])
    return [] if exists else None


def _changed_at(record: Mapping[str, Any]) -> float:
    return float(record["updated_at"] or record["created_at"] or 0.0)


async def _apply_newer(
    tx: Transaction, user_id: str, stored: Sequence[Fact], chain: Sequence[Mapping[str, Any]],
    turn_map: Mapping[Key, int], max_pinned: int,
) -> tuple[list[int], list[int]]:
    """Bring a stored chain up to the file's when the file's changed later: (ids of the
    versions added, ids of stored versions changed; a closed one is among them)."""
    if not stored or max(map(_changed_at, chain)) <= max(f.updated_at for f in stored):
        return [], []  # the same, or older than what is stored
    current = stored[-1]
    newer = [r for r in chain if r["version"] > current.version]
    if newer:
        chain_id = await facts.chain_of(tx, user_id, current.id)
        assert chain_id is not None
        added = await _insert_fact_chain(tx, user_id, newer, turn_map, max_pinned,
                                         after=(chain_id, current.id))
        closed_at = newer[0]["valid_from"] or _changed_at(newer[0])
        await facts.close(tx, current.id, superseded_by=added[0], now=closed_at)
        return added, [current.id]
    same = next((r for r in chain if r["version"] == current.version), None)
    if same is None or current.valid_to is not None or bool(same["pinned"]) == current.pinned:
        return [], []
    if same["pinned"] and await facts.count_pinned(tx, user_id) >= max_pinned:
        return [], []  # over the limit: it stays unpinned, as a new import's would
    await facts.set_pinned(tx, current.id, bool(same["pinned"]), _changed_at(same))
    return [], [current.id]


async def _insert_fact_chain(
    tx: Transaction, user_id: str, chain: Sequence[Mapping[str, Any]],
    turn_map: Mapping[Key, int], max_pinned: int, *, after: tuple[int, int] | None = None,
) -> list[int]:
    """Insert the versions of `chain` as a new chain, or `after` (chain id, current version
    id) as the next versions of a stored one."""
    now = time.time()
    new_of: dict[int, int] = {}
    inserted: list[int] = []
    for record in chain:
        first_seen = record["first_seen"] or now
        created = record["created_at"] or now
        previous = new_of.get(record["previous_id"]) if record["previous_id"] is not None else None
        if previous is None and after is not None and not inserted:
            previous = after[1]
        inserted.append(await facts.insert(tx, NewFact(
            user_id, record["text"], record["category"], record["confidence"],
            record["importance"], record["source"], mentions=record["mentions"],
            source_session=record["source_session"], client=record["client"],
            source_turn_ids=[turn_map[t] for t in record["source_turn_ids"] if t in turn_map],
            first_seen=first_seen, last_seen=record["last_seen"] or first_seen,
            expires_at=record["expires_at"], version=record["version"], previous_id=previous,
            valid_from=record["valid_from"] or created, valid_to=record["valid_to"],
            created_at=created, updated_at=record["updated_at"] or created,
            chain_id=after[0] if after else inserted[0] if inserted else None,
        )))
        if record["id"] is not None:
            new_of[record["id"]] = inserted[-1]
    for record, fact_id in zip(chain, inserted, strict=True):
        successor = new_of.get(record["superseded_by"]) if record["superseded_by"] else None
        if successor is not None:
            await facts.set_superseded_by(tx, fact_id, successor)
        if record["pinned"] and record["valid_to"] is None:
            # Over the limit (pins made since the export), the fact comes back unpinned.
            if await facts.count_pinned(tx, user_id) < max_pinned:
                await facts.set_pinned(tx, fact_id, True, None)
    return inserted


async def _write_summaries(
    tx: Transaction, user_id: str, records: Sequence[Mapping[str, Any]],
    turn_map: Mapping[Key, int], report: ImportReport,
) -> None:
    now = time.time()
    inserted: list[tuple[Mapping[str, Any], int]] = []
    for record in records:
        created = record["created_at"]
        if await summaries.exists(tx, user_id, record["session_id"], record["text"], created):
            report.skipped["summaries"] += 1
            continue
        cited = sorted({turn_map[t] for t in record["source_turn_ids"] if t in turn_map})
        last = turn_map.get(record["last_turn_id"] or 0) or (cited[-1] if cited else 0)
        summary_id = await summaries.insert(tx, NewSummary(
            user_id, record["session_id"], record["text"], record["data"],
            source_turn_ids=cited, last_turn_id=last, user_turns=record["user_turns"],
            tokens=record["tokens"], created_at=created or now,
        ))
        inserted.append((record, summary_id))
        report.added["summaries"] += 1
    new_of = {record["id"]: new_id for record, new_id in inserted if record["id"] is not None}
    for record, summary_id in inserted:
        successor = new_of.get(record["superseded_by"]) if record["superseded_by"] else None
        if successor is not None:
            await summaries.set_superseded_by(tx, summary_id, successor)
    await queue_sync(tx, summaries=[summary_id for _, summary_id in inserted])

"""Clear all of a user's memory, or delete one fact or summary, with an undo window that
survives restarts.

`clear` runs one transaction: it copies the user's memory as records (admin/records.py),
with its request metrics rows, into `clear_records` (storage/clears.py), deletes them
everywhere (admin/forget.py), records the clear with its expiry, and queues a durable
`settle_clear` job for the moment the window ends. The undo token is returned once; only its
hash is stored. Deleting one fact (its whole version chain) or one summary is a clear of
just that item: the same table, window, token, undo and job.

    pending --undo before expiry--> undone --records imported again--> restored
    pending --window ends---------> purged (the kept records are deleted for good)

The decision is taken by time inside a transaction, so undo and purge can never both win,
and a restart loses neither: a pending clear is still undoable until it expires, and a
restore that a crash interrupted is finished by the job (imports are idempotent).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import Any

from memory.admin.forget import forget_user
from memory.admin.importer import Importer, ImportReport
from memory.admin.record_checks import check_record
from memory.admin.records import RecordSource, fact_record, summary_record
from memory.learning.facts import FactStore, queue_sync
from memory.storage import clears, facts, jobs, metrics, summaries, turns
from memory.storage.database import Database, Transaction

SETTLE_JOB = "settle_clear"
METRICS_RECORD = "request_metrics"  # kept with the records; never exported or imported


class ClearNotFound(LookupError):
    """No clear with this undo token belongs to this user."""


class ClearExpired(ValueError):
    """The undo window of this clear has ended; the memory is gone for good."""


@dataclass(frozen=True)
class ClearReceipt:
    """What a clear removed and how to undo it."""

    undo_token: str
    created_at: float
    expires_at: float
    removed: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return asdict(self)


@dataclass(eq=False)
class Clears:
    """Clear-all, undo, and the job that settles each clear when its window ends."""

    db: Database
    source: RecordSource
    importer: Importer
    facts: FactStore
    _: KW_ONLY
    window: float
    notify: Callable[[], None]
    _restores: dict[str, asyncio.Task[ImportReport]] = field(default_factory=dict, init=False)

    async def clear(self, user_id: str) -> ClearReceipt:
        """Remove all of the user's memory, keeping it restorable until the window ends."""
        async with self.db.write() as tx:
            # Readers see exactly what this transaction deletes: no other write can commit
            # while it holds the writer.
            active_facts = await self.facts.count(user_id)
            records = [json.dumps(r) async for r in self.source.records(user_id, meta=False)]
            # The request metrics name the user too: kept for the window like the rest.
            taken = await metrics.take_rows(tx, user_id)
            records += [json.dumps({"type": METRICS_RECORD, **row}) for row in taken]
            removed = {
                "facts": active_facts, **await forget_user(tx, user_id),
                "request_metrics": len(taken),
            }
            receipt = await self._keep(tx, user_id, records, removed)
        self.notify()
        return receipt

    async def remove_fact(self, user_id: str, fact_id: int) -> ClearReceipt | None:
        """Delete a fact's whole version chain, restorable by undo until the window ends;
        None when the user has no such fact."""
        async with self.db.write() as tx:
            chain = await facts.history(tx, user_id, fact_id)
            if not chain:
                return None
            deleted = await facts.delete_chain(tx, user_id, fact_id)
            await queue_sync(tx, facts=deleted)
            records = [json.dumps(fact_record(f)) for f in chain]
            receipt = await self._keep(tx, user_id, records, {"facts": len(deleted)})
        self.notify()
        return receipt

    async def remove_summary(self, user_id: str, summary_id: int) -> ClearReceipt | None:
        """Delete one summary, restorable by undo until the window ends; None when the
        user has no such summary."""
        async with self.db.write() as tx:
            found = await summaries.get(tx, user_id, summary_id)
            if found is None:
                return None
            deleted = await summaries.delete(tx, user_id, summary_id=summary_id)
            await queue_sync(tx, summaries=deleted)
            records = [json.dumps(summary_record(found))]
            receipt = await self._keep(tx, user_id, records, {"summaries": len(deleted)})
        self.notify()
        return receipt

    async def _keep(
        self, tx: Transaction, user_id: str, records: list[str], removed: dict[str, int]
    ) -> ClearReceipt:
        """Keep what `tx` deletes until the window ends, and queue the job that settles it."""
        token = secrets.token_urlsafe(24)
        clear_id = _hash(token)
        now = time.time()
        expires = now + self.window
        await clears.insert(
            tx, clear_id, user_id, removed=removed, records=records, created_at=now,
            expires_at=expires,
        )
        await jobs.enqueue(tx, SETTLE_JOB, {"clear_id": clear_id}, run_after=expires)
        return ClearReceipt(token, now, expires, removed)

    async def undo(self, user_id: str, token: str) -> ImportReport:
        """Bring back what the clear removed; ClearNotFound or ClearExpired otherwise."""
        clear_id = _hash(token)
        async with self.db.write() as tx:
            found = await clears.get(tx, clear_id)
            if found is None or found[0] != user_id:
                raise ClearNotFound("no clear with this undo token")
            _, status, expires_at = found
            if status == "purged" or (status == "pending" and time.time() >= expires_at):
                raise ClearExpired("the undo window has ended; the memory is gone for good")
            if status == "pending":
                await clears.mark_undone(tx, clear_id)
        return await self._restore(clear_id, user_id)

    async def owner(self, token: str) -> str | None:
        """Whose memory the clear with this undo token removed, or None."""
        found = await clears.get(self.db, _hash(token))
        return None if found is None else found[0]

    async def pending(self, user_id: str) -> list[dict[str, Any]]:
        """The user's clears still inside their undo window."""
        return await clears.pending(self.db, user_id, time.time())

    async def settle(self, payload: dict[str, Any]) -> None:
        """The job at the end of the window: purge a pending clear, finish an undone one."""
        clear_id = str(payload["clear_id"])
        found = await clears.get(self.db, clear_id)
        if found is None:
            return
        user_id, status, expires_at = found
        if status == "undone":
            await self._restore(clear_id, user_id)
        elif status == "pending":
            await asyncio.sleep(max(0.0, expires_at - time.time()))
            await self._purge(clear_id)

    async def _purge(self, clear_id: str) -> None:
        async with self.db.write() as tx:
            purged = await clears.purge(tx, clear_id, time.time())
        if purged:  # the kept copies leave the database's files too, where it can
            await self.db.erase_deleted()

    async def _restore(self, clear_id: str, user_id: str) -> ImportReport:
        # Undo and the settle job may both ask; the first one's task serves both.
        task = self._restores.get(clear_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._import(clear_id, user_id))
            self._restores[clear_id] = task
            task.add_done_callback(lambda _: self._restores.pop(clear_id, None))
        return await asyncio.shield(task)

    async def _import(self, clear_id: str, user_id: str) -> ImportReport:
        kept = [json.loads(r) for r in await clears.records(self.db, clear_id)]
        taken = [r for r in kept if r["type"] == METRICS_RECORD]
        restored = [check_record(r) for r in kept if r["type"] != METRICS_RECORD]
        report = await self.importer.run(
            user_id, restored, kept_turns=await self._cited_turns(user_id, restored)
        )
        async with self.db.write() as tx:
            # In the transaction that drops the kept records: restored exactly once.
            await metrics.put_rows(tx, user_id, [
                {k: v for k, v in r.items() if k != "type"} for r in taken
            ])
            await clears.mark_restored(tx, clear_id, time.time())
        return report


    async def _cited_turns(self, user_id: str, restored: list[dict[str, Any]]) -> set[int]:
        """The stored turns a deleted fact or summary cites, so it comes back citing them.
        A clear kept its turns with the records and imports them anew: none then."""
        if any(r["type"] == "turn" for r in restored):
            return set()
        cited = {
            t for r in restored
            for t in (*r.get("source_turn_ids", ()), r.get("last_turn_id")) if t
        }
        stored = await turns.get_many(self.db, sorted(cited)) if cited else []
        return {t.id for t in stored if t.user_id == user_id}


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()

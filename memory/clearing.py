"""Clear all of a user's memory, with an undo window that survives restarts.

`clear` runs one transaction: it copies the user's memory as records (memory/records.py),
with its request metrics rows, into `clear_records`, deletes them everywhere
(memory/forget.py), records the clear with its expiry, and queues a durable `settle_clear`
job for the moment the window ends. The undo token is returned once; only its hash is stored.

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
from dataclasses import dataclass
from typing import Any

from memory.facts import FactStore
from memory.forget import forget_user
from memory.importer import Importer, ImportReport
from memory.record_checks import check_record
from memory.records import RecordSource
from memory.store import Store, put_request_metrics, take_request_metrics

SETTLE_JOB = "settle_clear"
METRICS_RECORD = "request_metrics"  # kept with the records; never exported or imported
_INSERT_BATCH = 500


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
        return {
            "undo_token": self.undo_token, "created_at": self.created_at,
            "expires_at": self.expires_at, "removed": self.removed,
        }


class Clears:
    """Clear-all, undo, and the job that settles each clear when its window ends."""

    def __init__(
        self, store: Store, source: RecordSource, importer: Importer, facts: FactStore, *,
        window: float, notify: Callable[[], None],
    ) -> None:
        self.store = store
        self.source = source
        self.importer = importer
        self.facts = facts
        self.window = window
        self.notify = notify
        self._restores: dict[str, asyncio.Task[ImportReport]] = {}

    async def clear(self, user_id: str) -> ClearReceipt:
        """Remove all of the user's memory, keeping it restorable until the window ends."""
        token = secrets.token_urlsafe(24)
        clear_id = _hash(token)
        now = time.time()
        expires = now + self.window
        async with self.store.write() as tx:
            # Readers see exactly what this transaction deletes: no other write can commit
            # while it holds the writer.
            active_facts = await self.facts.count(user_id)
            records = [json.dumps(r) async for r in self.source.records(user_id, meta=False)]
            # The request metrics name the user too: kept for the window like the rest.
            metrics = await take_request_metrics(tx, user_id)
            records += [json.dumps({"type": METRICS_RECORD, **row}) for row in metrics]
            removed = {
                "facts": active_facts, **await forget_user(tx, user_id),
                "request_metrics": len(metrics),
            }
            await tx.change(
                "INSERT INTO clears (id, user_id, status, removed, created_at, expires_at)"
                " VALUES (?, ?, 'pending', ?, ?, ?)",
                (clear_id, user_id, json.dumps(removed), now, expires),
            )
            for start in range(0, len(records), _INSERT_BATCH):
                await tx.change(
                    "INSERT INTO clear_records (clear_id, seq, record)"
                    " SELECT ?, ? + key, value FROM json_each(?)",
                    (clear_id, start, json.dumps(records[start:start + _INSERT_BATCH])),
                )
            await tx.enqueue(SETTLE_JOB, {"clear_id": clear_id}, run_after=expires)
        self.notify()
        return ClearReceipt(token, now, expires, removed)

    async def undo(self, user_id: str, token: str) -> ImportReport:
        """Bring back what the clear removed; ClearNotFound or ClearExpired otherwise."""
        clear_id = _hash(token)
        async with self.store.write() as tx:
            rows = await tx.execute(
                "SELECT user_id, status, expires_at FROM clears WHERE id = ?", (clear_id,)
            )
            if not rows or rows[0][0] != user_id:
                raise ClearNotFound("no clear with this undo token")
            status, expires_at = rows[0][1], float(rows[0][2])
            if status == "purged" or (status == "pending" and time.time() >= expires_at):
                raise ClearExpired("the undo window has ended; the memory is gone for good")
            if status == "pending":
                await tx.change("UPDATE clears SET status = 'undone' WHERE id = ?", (clear_id,))
        return await self._restore(clear_id, user_id)

    async def pending(self, user_id: str) -> list[dict[str, Any]]:
        """The user's clears still inside their undo window."""
        rows = await self.store.read(
            "SELECT created_at, expires_at, removed FROM clears WHERE user_id = ?"
            " AND status = 'pending' AND expires_at > ? ORDER BY created_at",
            (user_id, time.time()),
        )
        return [
            {"created_at": r[0], "expires_at": r[1], "removed": json.loads(r[2])} for r in rows
        ]

    async def settle(self, payload: dict[str, Any]) -> None:
        """The job at the end of the window: purge a pending clear, finish an undone one."""
        clear_id = str(payload["clear_id"])
        rows = await self.store.read(
            "SELECT user_id, status, expires_at FROM clears WHERE id = ?", (clear_id,)
        )
        if not rows:
            return
        user_id, status, expires_at = rows[0][0], rows[0][1], float(rows[0][2])
        if status == "undone":
            await self._restore(clear_id, user_id)
        elif status == "pending":
            await asyncio.sleep(max(0.0, expires_at - time.time()))
            await self._purge(clear_id)

    async def _purge(self, clear_id: str) -> None:
        async with self.store.write() as tx:
            purged = await tx.change(
                "UPDATE clears SET status = 'purged', settled_at = ? WHERE id = ?"
                " AND status = 'pending' AND expires_at <= ?",
                (time.time(), clear_id, time.time()),
            )
            if purged:
                await tx.change("DELETE FROM clear_records WHERE clear_id = ?", (clear_id,))

    async def _restore(self, clear_id: str, user_id: str) -> ImportReport:
        # Undo and the settle job may both ask; the first one's task serves both.
        task = self._restores.get(clear_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._import(clear_id, user_id))
            self._restores[clear_id] = task
            task.add_done_callback(lambda _: self._restores.pop(clear_id, None))
        return await asyncio.shield(task)

    async def _import(self, clear_id: str, user_id: str) -> ImportReport:
        rows = await self.store.read(
            "SELECT record FROM clear_records WHERE clear_id = ? ORDER BY seq", (clear_id,)
        )
        records = [json.loads(r[0]) for r in rows]
        metrics = [r for r in records if r["type"] == METRICS_RECORD]
        report = await self.importer.run(
            user_id, [check_record(r) for r in records if r["type"] != METRICS_RECORD]
        )
        async with self.store.write() as tx:
            # In the transaction that drops the kept records: restored exactly once.
            await put_request_metrics(tx, user_id, [
                {k: v for k, v in r.items() if k != "type"} for r in metrics
            ])
            await tx.change(
                "UPDATE clears SET status = 'restored', settled_at = ? WHERE id = ?",
                (time.time(), clear_id),
            )
            await tx.change("DELETE FROM clear_records WHERE clear_id = ?", (clear_id,))
        return report


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()

"""The management side of memory, in one place for the engine to own: sessions, export
and import, clear-all with undo, statistics, and the jobs they queue."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from config import Settings
from memory.admin.clearing import SETTLE_JOB, Clears
from memory.admin.forget import DROP_CHUNK_VECTORS_JOB, drop_chunk_vectors
from memory.admin.importer import Importer
from memory.admin.records import RecordSource
from memory.admin.sessions import SessionStore
from memory.admin.stats import MemoryStats
from memory.index.shared_vectors import SharedVectors
from memory.jobs.worker import Handler
from memory.learning.facts import FactStore
from memory.learning.profiles import ProfileStore
from memory.learning.summaries import SummaryStore
from memory.log.turn_log import TurnLog


class Management:
    """Sessions, records (export), importer, clears and stats over one database."""

    def __init__(
        self, settings: Settings, log: TurnLog, vectors: SharedVectors, facts: FactStore,
        summaries: SummaryStore, profiles: ProfileStore, *, index_job: str,
        notify: Callable[[], None],
    ) -> None:
        db = log.db
        self.sessions = SessionStore(db, notify=notify)
        self.records = RecordSource(db, facts, summaries, profiles, redact=log.redact)
        self.importer = Importer(
            log, profiles, index_job=index_job, max_attempts=settings.job_max_attempts,
            max_pinned=settings.fact_max_pinned, notify=notify,
        )
        self.clears = Clears(
            db, self.records, self.importer, facts, window=settings.clear_undo_seconds,
            notify=notify,
        )
        self.stats = MemoryStats(
            db, vectors.index, facts, profiles, vectors_path=settings.vectors_path
        )
        self.handlers: dict[str, Handler] = {
            SETTLE_JOB: self.clears.settle,
            DROP_CHUNK_VECTORS_JOB: partial(drop_chunk_vectors, db, vectors),
        }

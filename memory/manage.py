"""The management side of memory, in one place for the engine to own: sessions, export
and import, clear-all with undo, statistics, and the jobs they queue."""

from __future__ import annotations

from collections.abc import Callable

from config import Settings
from memory.clearing import SETTLE_JOB, Clears
from memory.facts import FactStore
from memory.forget import DROP_CHUNK_VECTORS_JOB, ChunkVectorDropper
from memory.importer import Importer
from memory.jobs import Handler
from memory.profiles import ProfileStore
from memory.records import RecordSource
from memory.sessions import SessionStore
from memory.stats import MemoryStats
from memory.store import Store
from memory.summaries import SummaryStore
from memory.vectors import VectorIndex


class Management:
    """Sessions, records (export), importer, clears and stats over one store."""

    def __init__(
        self, settings: Settings, store: Store, vectors: VectorIndex, facts: FactStore,
        summaries: SummaryStore, profiles: ProfileStore, *, index_job: str,
        notify: Callable[[], None],
    ) -> None:
        self.sessions = SessionStore(store, notify=notify)
        self.records = RecordSource(store.read, facts, summaries, profiles)
        self.importer = Importer(
            store, profiles, index_job=index_job, max_attempts=settings.job_max_attempts,
            max_pinned=settings.fact_max_pinned, notify=notify,
        )
        self.clears = Clears(
            store, self.records, self.importer, facts, window=settings.clear_undo_seconds,
            notify=notify,
        )
        self.stats = MemoryStats(
            store, vectors, facts, profiles, vectors_path=settings.vectors_path
        )
        dropper = ChunkVectorDropper(store, vectors)
        self.handlers: dict[str, Handler] = {
            SETTLE_JOB: self.clears.settle, DROP_CHUNK_VECTORS_JOB: dropper.run,
        }

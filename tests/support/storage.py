"""The storage parts the engine builds over one database, opened together for tests that
exercise them without the rest of the engine, on either backend."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memory.jobs.queue import JobQueue
from memory.log.turn_log import TurnLog
from memory.recall.lexical import ChunkSearch
from memory.storage.database import Database, SQLiteDatabase
from memory.storage.postgres import PostgresDatabase


@dataclass
class Storage:
    """A database with the turn log, the job queue and the chunk search over it."""

    db: Database
    log: TurnLog
    queue: JobQueue
    lexical: ChunkSearch

    @classmethod
    async def open(cls, path: Path, *, url: str | None = None, readers: int = 4) -> Storage:
        """Create or upgrade the database (PostgreSQL at `url`, else the SQLite file at
        `path`) and build the parts over it."""
        db: Database
        if url is None:
            db = await SQLiteDatabase.open(path, readers=readers)
        else:
            db = await PostgresDatabase.open(url, connections=readers)
        return cls(db, TurnLog(db), JobQueue(db), ChunkSearch(db))

    @property
    def path(self) -> Path:
        """The database file (SQLite only)."""
        assert isinstance(self.db, SQLiteDatabase), "a PostgreSQL database has no file"
        return self.db.path

    async def close(self) -> None:
        """Close the database; safe to call twice."""
        await self.db.close()

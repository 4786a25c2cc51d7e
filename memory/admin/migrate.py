"""`memproxy migrate`: moving an embedded install up to PostgreSQL and a Chroma server.

The database's rows go to PostgreSQL with their ids (storage/bulk_copy.py): the destination's
schema is made by its own migrations, its full-text columns and counters by its triggers, and
its id sequences start after the copied ids. Vector ids are row ids ("c123" for chunk 123),
so vectors stay valid across the copy:
- with a Chroma server (`chroma_url`), the embedded collection of the configured embedding
  model is copied to it, vectors and metadata as they are (no re-embedding), page by page,
  each page noted in the destination database like a batch of rows (ids the server holds
  already are skipped, so a page copied but not noted adds nothing when copied again);
- without one, vectors are not copied: a memproxy on PostgreSQL started with the same
  MEMPROXY_DATA_DIR keeps using the embedded Chroma there, which still matches every row
  (as does the Chroma server of an install that has MEMPROXY_CHROMA_URL set already).
  Replicas on several machines need a Chroma server.

The source must be stopped: it is read in one snapshot that no other process may share
(storage/bulk_copy.snapshot), also while the vectors are copied, so no server starts meanwhile.
Every step is resumable and idempotent: running the command again after an interruption goes
on where it stopped, and once done adds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from config import Settings
from config.settings import without_password
from memory.engine import collection_name
from memory.index.vectors import VectorIndex, check_server
from memory.outages import CannotOpen
from memory.storage import bulk_copy, jobs
from memory.storage.bulk_copy import Batch, CopyRefused, Source, SourceBusy
from memory.storage.database import DatabaseError
from memory.storage.postgres import PostgresDatabase, PostgresError, check_reachable


class MigrateError(Exception):
    """The copy stopped or was refused; what was committed stays, and a rerun goes on."""


@dataclass(frozen=True)
class MigrateResult:
    """What a migrate found and did."""

    source_rows: dict[str, int]  # per table, in the source
    dest_rows: dict[str, int]  # per table, in the destination afterwards
    copied_rows: dict[str, int]  # per table, by this run
    copied_vectors: dict[str, int]  # per collection, by this run ({} without a Chroma server)
    seconds: float


def migrate(
    settings: Settings, dest_url: str, *, chroma_url: str | None = None,
    batch_size: int = 2000, on_batch: Callable[[Batch], None] | None = None,
) -> MigrateResult:
    """Copy the embedded install of `settings` into the PostgreSQL database at `dest_url`
    (and its vectors to the Chroma server at `chroma_url`), `batch_size` rows or vectors at a
    time.

    Runs its own event loop: call it from synchronous code, or in a worker thread.
    """
    started = time.perf_counter()
    if chroma_url and settings.chroma_url:
        raise MigrateError(f"the vectors are on the Chroma server {settings.chroma_url} already"
                           " (MEMPROXY_CHROMA_URL): migrate without a Chroma server address")
    try:
        with bulk_copy.snapshot(settings.db_path) as source:
            source_rows = bulk_copy.source_counts(source)
            copied, dest_rows, vectors = asyncio.run(_copy(
                source, settings, dest_url, chroma_url=chroma_url, batch_size=batch_size,
                on_batch=on_batch,
            ))
    except (SourceBusy, CopyRefused, DatabaseError, PostgresError, CannotOpen) as exc:
        raise MigrateError(str(exc)) from exc
    return MigrateResult(source_rows, dest_rows, copied, vectors, time.perf_counter() - started)


async def _copy(
    source: Source, settings: Settings, dest_url: str, *, chroma_url: str | None,
    batch_size: int, on_batch: Callable[[Batch], None] | None,
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Rows copied and rows held per table, and vectors copied per collection."""
    source_name = str(settings.db_path.resolve())
    # Every target answers before anything is written: a Chroma server that is down must
    # not leave the destination's new tables behind.
    await check_reachable(dest_url, without_password(dest_url), named="DEST_URL")
    if chroma_url:
        await asyncio.to_thread(check_server, chroma_url, without_password(chroma_url),
                                named="--chroma-url")
    async with contextlib.AsyncExitStack() as stack:
        dest = await PostgresDatabase.open(dest_url)  # creates or upgrades its schema
        stack.push_async_callback(dest.close)
        done = await bulk_copy.begin(source, dest, source_name=source_name)
        vectors = Vectors(settings, chroma_url) if chroma_url else None
        if vectors is not None:
            stack.callback(vectors.close)
            if vectors.key not in done:
                vectors.check_empty()
        copied = await bulk_copy.copy_tables(
            source, dest, source_name=source_name, done=done, batch_size=batch_size,
            on_batch=on_batch,
        )
        async with dest.write() as tx:
            await jobs.expire_unleased(tx)
        moved = {} if vectors is None else await vectors.copy(
            dest, source_name=source_name, done=done, page=batch_size, on_batch=on_batch)
        return copied, await bulk_copy.count_rows(dest), moved


class Vectors:
    """The configured embedding model's collection, embedded and on the Chroma server (a
    collection of an earlier model is not read by this version)."""

    def __init__(self, settings: Settings, chroma_url: str) -> None:
        self.name = collection_name(settings)
        self.key = f"vectors {self.name}"  # its progress in the destination database
        self.source = VectorIndex.open(settings.vectors_path, self.name)
        try:
            self.server = VectorIndex.connect(chroma_url, self.name)
        except BaseException:
            self.source.close()
            raise

    def check_empty(self) -> None:
        """Refuse a server whose collection already holds vectors: their ids (row ids of
        another database) would be taken for copies of ours."""
        if held := self.server.count():
            raise CopyRefused(f"the Chroma server's collection {self.name} already holds"
                              f" {held} vectors; copy to a new server or delete that collection")

    async def copy(
        self, dest: PostgresDatabase, *, source_name: str, done: dict[str, int], page: int,
        on_batch: Callable[[Batch], None] | None,
    ) -> dict[str, int]:
        """Copy the vectors after those an earlier run noted in `done`, noting each page in
        the destination database; how many were new, by collection."""
        offset, copied = done.get(self.key, 0), 0
        for ids, vectors, metadatas in self.source.pages(page, start=offset):
            # An id the server holds already came from a page copied but not yet noted.
            missing = set(self.server.missing(ids))
            keep = [i for i, id_ in enumerate(ids) if id_ in missing]
            self.server.add([ids[i] for i in keep], vectors[keep], [metadatas[i] for i in keep])
            offset += len(ids)
            async with dest.write() as tx:
                await bulk_copy.record(tx, source_name=source_name, name=self.key, last=offset,
                                       copied=len(keep))
            copied += len(keep)
            if on_batch is not None:
                on_batch(Batch(self.key, len(ids), len(keep)))
        return {self.name: copied}

    def close(self) -> None:
        """Release both clients."""
        self.server.close()
        self.source.close()

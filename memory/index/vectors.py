"""Dense vector index on Chroma, embedded or a server; the only module that imports chromadb.

Every call is synchronous because chromadb is; callers run them in worker threads. We always
pass our own vectors, so the collection has no embedding function and never loads a model.
Queries scoped to one user search that user's copy in memory.index.vector_cache when it is on;
with embedded Chroma the copies are also kept in files beside it (index/vector_cache.py,
folder `vector-copies/<collection>`), so a restart does not have to ask Chroma for them.
Writes return the users whose vectors they changed: index/shared_vectors.py counts them in
the database, so that replicas sharing a Chroma server drop the copies another one made stale.

The index heals itself: when a call fails because the collection was deleted, or its
directory is gone or damaged, the collection is created again (empty; a damaged directory is
moved aside first), the call runs once more, and `on_lost` is told, so the owner can queue
the jobs that rebuild the vectors from the database (index/rebuild.py). A Chroma server that
does not answer is an outage, not a loss: its connection errors leave as
`memory.outages.Unavailable`, which the job worker waits out.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import chromadb
import httpx
import numpy as np
import numpy.typing as npt
from chromadb.api.client import Client
from chromadb.api.models.Collection import Collection
from chromadb.config import Settings
from chromadb.errors import NotFoundError

from memory.index.heap_fill import fill_heap
from memory.index.vector_cache import CopyFiles, Row, VectorCache
from memory.outages import CannotOpen, Unavailable
from memory.storage.file_modes import private_dir, private_tree

Metadata = Mapping[str, str | int | float | bool]
PAGE = 5000  # vectors per read when loading a user's copy
DB_FILE = "chroma.sqlite3"
T = TypeVar("T")
# Why a collection is lost: the first two leave the client working, the others do not.
DELETED, REPLACED = "the collection was deleted", "the collection was replaced"
GONE, DAMAGED = "its directory is gone", "its database is damaged"


class VectorIndex:
    """A persistent cosine-space collection of vectors with metadata filters."""

    def __init__(self, where: Path | str, name: str, cache_bytes: int = 0) -> None:
        # A directory of embedded Chroma, or the address of a Chroma server.
        self.path: Path | None = where if isinstance(where, Path) else None
        self.url: str | None = where if isinstance(where, str) else None
        self.name = name
        self._client = self._connect()
        self._collection = _collection(self._client, name)
        copies = None
        if self.path is not None:  # even with no cache: a write must discard stale files
            folder = self.path.parent / "vector-copies" / name
            copies = CopyFiles(folder, str(self._collection.id))
        self._cache = VectorCache(cache_bytes, self._user_rows, copies)
        # Chroma survives concurrent calls (2 writers + 1 reader: no errors, no leaks), but
        # measured with one thread upserting batches of 64 nonstop, a query waited p50 110-200
        # ms and up to 6 s without this lock, against p50 25-60 ms and at most 1.3 s with it.
        self._lock = threading.Lock()
        # Told (in the calling thread, under the lock) why the collection was created again.
        self.on_lost: Callable[[str], None] | None = None

    @classmethod
    def open(cls, path: Path, collection: str = "memory", *, cache_bytes: int = 0) -> VectorIndex:
        """Open (creating if needed) the collection stored under `path`.

        `cache_bytes` bounds the in-memory copies that user-scoped queries search (0: every
        query goes to Chroma with a metadata filter).
        """
        return cls(path, collection, cache_bytes)

    @classmethod
    def connect(cls, url: str, collection: str = "memory", *, cache_bytes: int = 0) -> VectorIndex:
        """Open (creating if needed) the collection on the Chroma server at `url`
        (`chroma run`); replicas share it."""
        return cls(url, collection, cache_bytes)

    def add(
        self, ids: Sequence[str], vectors: npt.NDArray[np.float32], metadatas: Sequence[Metadata]
    ) -> set[str]:
        """Insert or replace vectors by id (idempotent); return the users whose vectors
        changed."""
        if not len(ids) == len(vectors) == len(metadatas):
            raise ValueError(
                f"add needs as many vectors and metadatas as ids: "
                f"{len(ids)} ids, {len(vectors)} vectors, {len(metadatas)} metadatas"
            )
        if not ids:
            return set()

        def upsert() -> set[str]:
            # A moved id (SQLite reuses a deleted chunk's) matters only to the copies' files.
            moved = self._owners(ids) if self._cache.copies is not None else set()
            owners = moved | {str(metadata.get("user_id")) for metadata in metadatas}
            self._cache.changing(owners)
            self._collection.upsert(
                ids=list(ids),
                embeddings=np.asarray(vectors, dtype=np.float32),
                metadatas=[dict(metadata) for metadata in metadatas],
            )
            return owners

        with self._lock:
            owners = self._healing(upsert)
            self._cache.upsert(ids, np.asarray(vectors, dtype=np.float32), metadatas)
            self._private()
        return owners

    def query(
        self, vector: npt.NDArray[np.float32], *, k: int, where: Mapping[str, str | bool]
    ) -> list[tuple[str, float]]:
        """Return up to `k` (id, cosine similarity) pairs matching `where`, best first."""
        if k < 1:
            return []
        with self._lock:
            if self._cache.enabled and "user_id" in where:
                rest = {key: value for key, value in where.items() if key != "user_id"}
                user_id = str(where["user_id"])
                return self._healing(lambda: self._cache.search(user_id, vector, k, rest))
            result = self._healing(lambda: self._collection.query(
                query_embeddings=np.asarray(vector, dtype=np.float32).reshape(1, -1),
                n_results=k,
                where=where_clause(where),
                include=["distances"],
            ))
        ids = result["ids"][0]
        distances = (result["distances"] or [[]])[0]
        # Chroma's cosine space reports distance = 1 - cosine similarity.
        return [(id_, 1.0 - float(d)) for id_, d in zip(ids, distances, strict=True)]

    def delete(
        self, *, ids: Sequence[str] | None = None, where: Mapping[str, str] | None = None
    ) -> set[str]:
        """Delete vectors by id and/or metadata equality, at least one given; return the
        users who held them."""
        if ids is None and where is None:
            raise ValueError("delete needs ids or where; refusing to delete everything")
        if ids is not None and not ids:
            return set()

        def remove() -> set[str]:
            owners = self._owners(ids, where)
            self._cache.changing(owners)
            self._collection.delete(
                ids=list(ids) if ids is not None else None,
                where=where_clause(where) if where is not None else None,
            )
            return owners

        with self._lock:
            owners = self._healing(remove)
            self._cache.forget(ids=ids, user_id=where.get("user_id") if where else None)
            self._private()
        return owners

    def refresh(self, generations: Mapping[str, int]) -> None:
        """Drop the users' copies older than these vector generations (index/vector_cache.py)."""
        with self._lock:
            self._cache.refresh(generations)

    def advance(self, generations: Mapping[str, int]) -> None:
        """Keep current the copies that this process's write just brought to these
        generations."""
        with self._lock:
            self._cache.advance(generations)

    def count(self, where: Mapping[str, str] | None = None) -> int:
        """Number of vectors in the collection, or of those matching `where`."""
        with self._lock:
            if not where:
                return self._healing(lambda: self._collection.count())
            clause = where_clause(where)
            return self._healing(lambda: len(self._collection.get(where=clause, include=[])["ids"]))

    def pages(
        self, size: int = PAGE, *, start: int = 0
    ) -> Iterator[tuple[list[str], npt.NDArray[np.float32], list[Metadata]]]:
        """Every vector of the collection from the `start`-th on, with its id and metadata,
        `size` at a time in a fixed order (a copy to another Chroma; the collection must not
        change meanwhile)."""
        offset = start
        while True:
            with self._lock:
                page = self._healing(functools.partial(
                    self._collection.get, include=["embeddings", "metadatas"], limit=size,
                    offset=offset,
                ))
            if not page["ids"]:
                return
            embeddings = page["embeddings"] if page["embeddings"] is not None else []
            yield (list(page["ids"]), np.asarray(embeddings, dtype=np.float32),
                   [cast(Metadata, m) for m in page["metadatas"] or []])
            offset += len(page["ids"])

    def missing(self, ids: Sequence[str]) -> list[str]:
        """Those of `ids` the collection does not hold."""
        with self._lock:
            found = set(self._healing(lambda: self._collection.get(ids=list(ids), include=[]))["ids"])
        return [id_ for id_ in ids if id_ not in found]

    def other_collections(self) -> list[str]:
        """Names of the other collections in the same Chroma (another model's, say)."""
        with self._lock:
            return [c.name for c in self._client.list_collections() if c.name != self.name]

    def _owners(
        self, ids: Sequence[str] | None, where: Mapping[str, str] | None = None
    ) -> set[str]:
        """Users who hold any of the vectors named now."""
        if where is not None and "user_id" in where:
            return {where["user_id"]}  # no need to ask Chroma
        found = self._collection.get(
            ids=list(ids) if ids is not None else None,
            where=where_clause(where) if where is not None else None, include=["metadatas"],
        )
        return {str(metadata.get("user_id")) for metadata in found["metadatas"] or []}

    def _user_rows(self, user_id: str) -> list[Row]:
        """Every vector of one user, read from Chroma in pages (the cache's loader)."""
        rows: list[Row] = []
        while True:
            page = self._collection.get(
                where=where_clause({"user_id": user_id}), include=["embeddings", "metadatas"],
                limit=PAGE, offset=len(rows),
            )
            embeddings = page["embeddings"] if page["embeddings"] is not None else []
            # Stored by add() from float32 vectors and scalar metadata, so they come back so.
            rows.extend(cast(list[Row], list(
                zip(page["ids"], embeddings, page["metadatas"] or [], strict=True)
            )))
            if len(page["ids"]) < PAGE:
                return rows

    def save_copies(self) -> None:
        """Write the files of users' copies changed since they were loaded or last saved."""
        with self._lock:
            self._cache.save()

    def close(self) -> None:
        """Release chroma's resources (its SQLite handles and segment files)."""
        with self._lock:
            self._cache.save()
            self._close_client()
            self._private()

    def _private(self) -> None:
        """Chroma writes its files with the umask's mode: make them 0600 (and its folders
        0700) after each write (memory/storage/file_modes.py; about 0.1 ms)."""
        if self.path is not None:
            private_tree(self.path)

    def _healing(self, call: Callable[[], T]) -> T:
        """Run a Chroma call (holding the lock); when the collection turns out to be lost,
        create it again and run the call once more, on the new, empty collection."""
        lost = GONE if self.path is not None and not (self.path / DB_FILE).is_file() else None
        if lost is None:
            try:
                return call()
            except Exception as exc:
                lost = self._lost()
                if lost is None and isinstance(exc, httpx.TransportError):
                    # chromadb's HTTP client lets httpx's connection errors through.
                    raise Unavailable("Chroma", f"{type(exc).__name__}: {exc}") from exc
                if lost is None:
                    raise  # a failure of the call itself: the caller sees it
        self._recreate(lost)
        if self.on_lost is not None:
            self.on_lost(lost)
        return call()

    def _lost(self) -> str | None:
        """Why the collection is unusable for good, or None when it is still there."""
        try:
            found = self._client.get_collection(self.name)
        except NotFoundError:
            return DELETED
        except Exception:
            # A server that does not answer is an outage, not a loss: the call's error stands.
            return DAMAGED if self.path is not None and _damaged(self.path / DB_FILE) else None
        return None if found.id == self._collection.id else REPLACED

    def _recreate(self, lost: str) -> None:
        """A working, empty collection again; a damaged directory is kept aside for a look."""
        self._cache.forget(ids=None, user_id=None)
        if lost in (GONE, DAMAGED) and self.path is not None:
            with contextlib.suppress(Exception):
                self._close_client()
            if self.path.exists():
                self.path.rename(self.path.with_name(f"{self.path.name}.damaged-{time.time():.0f}"))
            self._client = self._connect()
        self._collection = _collection(self._client, self.name)
        if self._cache.copies is not None:
            self._cache.copies.clear()
            self._cache.copies.collection_id = str(self._collection.id)

    def _connect(self) -> Client:
        # PersistentClient and HttpClient are typed as the ClientAPI protocol but build a
        # Client, which adds close(); telemetry off (then chromadb makes no calls of its own).
        if self.path is not None:
            private_dir(self.path)
            fill_heap()  # hnswlib writes memory it never set into its files: index/heap_fill.py
            client = cast(Client, chromadb.PersistentClient(
                path=str(self.path), settings=_client_settings()
            ))
            private_tree(self.path)
            return client
        assert self.url is not None
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a Chroma server address is http(s)://host[:port], not {self.url!r}")
        secure = parts.scheme == "https"
        return cast(Client, chromadb.HttpClient(
            host=parts.hostname, port=parts.port or (443 if secure else 8000), ssl=secure,
            settings=_client_settings(),
        ))

    def _close_client(self) -> None:
        self._client.close()
        # chromadb 1.x gives every HTTP client Systems of its own (the client's and its
        # admin client's) and stops them on close, but never closes their httpx sessions:
        # each would leak a socket to the server.
        admin = getattr(self._client, "_admin_client", None)
        for api in (self._client._server, getattr(admin, "_server", None)):
            session = getattr(api, "_session", None)
            if session is not None:
                session.close()


def check_server(url: str, shown: str, *, named: str) -> None:
    """CannotOpen unless a Chroma server answers its heartbeat at `url`. `shown`: the
    address without its password; `named`: what set it (a setting or an argument)."""
    part = f"the vectors (Chroma server at {shown})"
    try:
        with httpx.Client(timeout=10.0) as http:
            http.get(f"{url.rstrip('/')}/api/v2/heartbeat").raise_for_status()
    except httpx.HTTPStatusError as exc:
        raise CannotOpen(part, f"not a Chroma server (its heartbeat answered"
                         f" {exc.response.status_code})", f"fix {named}") from None
    except httpx.HTTPError as exc:
        raise CannotOpen(part, f"no answer ({type(exc).__name__}: {exc})",
                         f"start it (chroma run), or fix {named}") from None


def _client_settings() -> Settings:
    # A new object each time: chromadb's client factories write their arguments into it.
    return Settings(anonymized_telemetry=False, allow_reset=False)


def _collection(client: Client, name: str) -> Collection:
    return client.get_or_create_collection(
        name, configuration={"hnsw": {"space": "cosine"}}, embedding_function=None
    )


def _damaged(db_file: Path) -> bool:
    """Whether Chroma's SQLite file fails its own check (a lock or a busy file does not count:
    those pass)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db_file}?mode=ro", uri=True, timeout=5)) as db:
            checked: tuple[str, ...] = tuple(db.execute("PRAGMA quick_check").fetchone() or ())
            return checked != ("ok",)
    except sqlite3.OperationalError:
        return False  # locked or busy: not damaged
    except sqlite3.DatabaseError:
        return True  # "file is not a database", "malformed"


def where_clause(filters: Mapping[str, str | bool] | None) -> dict[str, Any] | None:
    """Translate equality filters into chroma's `where` syntax (several keys -> `$and`)."""
    if not filters:
        return None
    terms = [{key: {"$eq": value}} for key, value in filters.items()]
    return terms[0] if len(terms) == 1 else {"$and": cast(Any, terms)}

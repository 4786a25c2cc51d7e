"""Exact per-user search over an in-memory copy of a user's vectors.

Chroma keeps the vectors on disk, but its metadata filter costs time in proportion to the
whole collection, not to the user: measured on 70k vectors, `where user_id = X` costs 18-40
ms of CPU whether X owns 600 vectors or 10k, against 1.4 ms for the same query unfiltered.
A Chroma collection per user would avoid the filter, but each one holds about 2.7 MB of
preallocated HNSW memory from its first vector, and Chroma's cache eviction loses vectors
that were not yet flushed. So recall searches a copy of the user's vectors instead: one
matrix product, exact cosine, in a few milliseconds even at 100k vectors.

The copies live in an LRU bounded by bytes. A copy is loaded on first use, from its file
when there is one (CopyFiles below) or else from Chroma, kept in step on every add (the
index is the only writer in this process), and dropped on any delete that may touch it, to
be reloaded when next needed.

Other replicas sharing a Chroma server write too. Each copy carries the user's vector
generation (memory.storage.versions) it is known to include; `refresh` is told the
generations just read from the database and drops the copies older than those, and a load
is labelled with the newest generation read before it (a lower label only costs a reload).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from memory.storage.file_modes import PRIVATE_FILE, private_dir

Vectors = npt.NDArray[np.float32]
Value = str | int | float | bool
# One row of a loaded copy: id, vector, metadata.
Row = tuple[str, Sequence[float] | Vectors, Mapping[str, Value]]
MISSING = -1  # code of a metadata key a row does not have
# A search whose filter keeps fewer than 1/SELECTIVE of the rows multiplies only those.
SELECTIVE = 8
GENERATIONS_KEPT = 4096  # users whose last read generation is remembered while not loaded
COPY_VERSION = 1  # of the copy files

# Named as when CopyFiles had a module of its own, so that log filters on it still match.
log = logging.getLogger("memproxy.memory.index.vector_copies")


class UserVectors:
    """One user's vectors as a growable matrix, with metadata as integer codes per key."""

    def __init__(self, dim: int) -> None:
        self.ids: list[str] = []
        self.rows: dict[str, int] = {}
        self.matrix: Vectors = np.zeros((16, dim), dtype=np.float32)
        self.columns: dict[str, npt.NDArray[np.int32]] = {}
        self.codes: dict[str, dict[Value, int]] = {}
        # The user's vector generation this copy includes every write of.
        self.generation = 0

    @property
    def nbytes(self) -> int:
        """Memory held by the matrix and the metadata codes."""
        return self.matrix.nbytes + sum(c.nbytes for c in self.columns.values())

    def upsert(self, rows: Iterable[Row]) -> None:
        """Add rows, or replace the vector and metadata of ids already held."""
        for id_, vector, metadata in rows:
            row = self.rows.get(id_)
            if row is None:
                row = len(self.ids)
                self._reserve(row + 1)
                self.ids.append(id_)
                self.rows[id_] = row
            self.matrix[row] = vector
            for column in self.columns.values():
                column[row] = MISSING
            for key, value in metadata.items():
                column = self._column(key)
                column[row] = self.codes[key].setdefault(value, len(self.codes[key]))

    def search(self, vector: Vectors, k: int, where: Mapping[str, Value]) -> list[tuple[str, float]]:
        """The `k` most similar rows matching every `where` equality, best first."""
        n = len(self.ids)
        if n == 0 or k < 1:
            return []
        mask: npt.NDArray[np.bool_] | None = None
        for key, value in where.items():
            code = self.codes.get(key, {}).get(value)
            if code is None:
                return []
            match = self.columns[key][:n] == code
            mask = match if mask is None else mask & match
        candidates = np.flatnonzero(mask) if mask is not None else np.arange(n)
        query = np.asarray(vector, dtype=np.float32)
        # A filter that keeps few rows (a user's standing statements) scores only those.
        if len(candidates) * SELECTIVE < n:
            similarity = np.zeros(n, dtype=np.float32)
            similarity[candidates] = self.matrix[candidates] @ query
        else:
            similarity = self.matrix[:n] @ query
        if len(candidates) > k:
            top = np.argpartition(-similarity[candidates], k - 1)[:k]
            candidates = candidates[top]
        # Ties break by id so results are deterministic.
        order = sorted(candidates.tolist(), key=lambda r: (-similarity[r], self.ids[r]))
        return [(self.ids[r], float(similarity[r])) for r in order]

    def _reserve(self, rows: int) -> None:
        if rows <= len(self.matrix):
            return
        more = max(rows, 2 * len(self.matrix)) - len(self.matrix)
        self.matrix = np.pad(self.matrix, ((0, more), (0, 0)))
        for key, column in self.columns.items():
            self.columns[key] = np.pad(column, (0, more), constant_values=MISSING)

    def _column(self, key: str) -> npt.NDArray[np.int32]:
        if key not in self.columns:
            self.columns[key] = np.full(len(self.matrix), MISSING, dtype=np.int32)
            self.codes[key] = {}
        return self.columns[key]


class CopyFiles:
    """One file per user in `folder`, valid for the collection `collection_id` only.

    Users' vector copies kept on disk, so the first recall after a start reads one file.

    Loading a 10k-turn user's copy from Chroma (a get filtered on user_id, 10k rows) took
    1.8-2.6 s here, nearly all of it inside Chroma. A file holds a JSON head (the collection's id,
    so that a collection created again never reads an old file; the ids; the metadata values),
    then the vectors as raw float32 and the metadata as int32 codes, so reading it is two
    `np.fromfile` calls: 2-5 ms for 10k vectors. Float16 would halve the file, but converting
    10k vectors back to float32 took 15-70 ms, and a zipped .npz 15-70 ms more to read.

    A file is only right while nothing has changed the user's vectors since it was written, so the
    index discards it before every write that may touch the user (before, not after: a crash
    between the two leaves no stale file behind). The copy in memory stays exact, and is written
    back when it is dropped from memory, by the engine's hourly maintenance and when the index
    closes; a copy loaded from Chroma is written at once.
    """

    def __init__(self, folder: Path, collection_id: str) -> None:
        self.folder = folder
        self.collection_id = collection_id
        private_dir(folder)

    def path(self, user_id: str) -> Path:
        """The user's file (named by a digest: user ids are free text)."""
        return self.folder / f"{hashlib.sha256(user_id.encode()).hexdigest()[:32]}.vectors"

    def read(self, user_id: str, dim: int) -> UserVectors | None:
        """The user's copy from its file, or None when there is no usable file."""
        path = self.path(user_id)
        try:
            with path.open("rb") as file:
                size = int.from_bytes(file.read(8), "little")
                if size > os.fstat(file.fileno()).st_size:
                    raise ValueError("its head runs past its end")
                head = json.loads(file.read(size))
                if {key: head.get(key) for key in ("version", "collection", "user_id", "dim")} != {
                    "version": COPY_VERSION, "collection": self.collection_id, "user_id": user_id,
                    "dim": dim,
                }:
                    return None
                n, keys = len(head["ids"]), list(head["codes"])
                matrix = np.fromfile(file, dtype=np.float32, count=n * dim)
                columns = np.fromfile(file, dtype=np.int32, count=n * len(keys))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # damaged: Chroma has it all
            log.warning("ignoring the vector copy %s (%s: %s)", path, type(exc).__name__, exc)
            return None
        if len(matrix) != n * dim or len(columns) != n * len(keys):
            log.warning("ignoring the vector copy %s: it is cut short", path)
            return None
        vectors = UserVectors(dim)
        vectors.ids = list(head["ids"])
        vectors.rows = {id_: row for row, id_ in enumerate(vectors.ids)}
        # UserVectors grows by doubling from its length: it needs one row at least.
        vectors.matrix = matrix.reshape(n, dim) if n else vectors.matrix
        table = columns.reshape(len(keys), n)
        vectors.columns = {key: table[i].copy() for i, key in enumerate(keys)}
        vectors.codes = {key: {value: code for code, value in enumerate(values)}
                         for key, values in head["codes"].items()}
        if not n:
            vectors.columns = {key: np.full(len(vectors.matrix), MISSING, dtype=np.int32) for key in keys}
        return vectors

    def write(self, user_id: str, vectors: UserVectors) -> None:
        """Store the user's copy (atomically: a reader sees the old file or the new one)."""
        n = len(vectors.ids)
        keys = list(vectors.codes)
        head = json.dumps({
            "version": COPY_VERSION, "collection": self.collection_id, "user_id": user_id,
            "dim": vectors.matrix.shape[1], "ids": vectors.ids,
            # Values in code order: code c is the c-th value of its key.
            "codes": {key: sorted(vectors.codes[key], key=vectors.codes[key].__getitem__)
                      for key in keys},
        }).encode()
        path = self.path(user_id)
        partial = path.with_suffix(".partial")
        try:
            # 0600 whatever the umask: a user's vectors are memory (file_modes.py).
            with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE),
                      "wb") as out:
                out.write(len(head).to_bytes(8, "little"))
                out.write(head)
                out.write(np.ascontiguousarray(vectors.matrix[:n], dtype=np.float32).tobytes())
                for key in keys:
                    out.write(np.ascontiguousarray(vectors.columns[key][:n], dtype=np.int32).tobytes())
            os.replace(partial, path)
        except OSError as exc:  # a full disk costs the next start time, nothing more
            log.warning("could not write the vector copy %s: %s", path, exc)
            with contextlib.suppress(OSError):
                partial.unlink()

    def discard(self, user_ids: Iterable[str]) -> None:
        """Remove these users' files (their vectors are about to change)."""
        for user_id in user_ids:
            with contextlib.suppress(FileNotFoundError):
                self.path(user_id).unlink()

    def clear(self) -> None:
        """Remove every file (a write whose users are unknown, or a new collection)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        private_dir(self.folder)


class VectorCache:
    """Users' vector copies, least recently used dropped first past `max_bytes`; 0 is off.

    Not thread-safe: the caller (VectorIndex) serialises every call under its lock.
    """

    def __init__(
        self, max_bytes: int, load: Callable[[str], Iterable[Row]],
        copies: CopyFiles | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self._load = load
        self._users: OrderedDict[str, UserVectors] = OrderedDict()
        self.copies = copies
        # Users held in memory whose file was discarded since: written back when dropped.
        self._unsaved: set[str] = set()
        # The newest vector generation read for each user (the label of their next load).
        self._read: OrderedDict[str, int] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def search(
        self, user_id: str, vector: Vectors, k: int, where: Mapping[str, Value]
    ) -> list[tuple[str, float]]:
        """Exact search within the user's vectors, loading them first if needed."""
        vectors = self._users.get(user_id)
        if vectors is None and self.copies is not None:
            vectors = self.copies.read(user_id, len(vector))
        if vectors is None:
            vectors = UserVectors(len(vector))
            vectors.upsert(self._load(user_id))
            if self.copies is not None:
                self.copies.write(user_id, vectors)
        if user_id not in self._users:
            vectors.generation = self._read.get(user_id, 0)
        self._users[user_id] = vectors
        self._users.move_to_end(user_id)
        hits = vectors.search(vector, k, where)
        self._evict()
        return hits

    def upsert(
        self, ids: Sequence[str], vectors: Vectors, metadatas: Sequence[Mapping[str, Value]]
    ) -> None:
        """Keep loaded copies in step with vectors just written to the index."""
        for id_, vector, metadata in zip(ids, vectors, metadatas, strict=True):
            held = self._users.get(str(metadata.get("user_id")))
            if held is not None:
                held.upsert([(id_, vector, metadata)])
            # An id may have moved to another user: drop any other copy that holds it.
            for user_id, other in list(self._users.items()):
                if other is not held and id_ in other.rows:
                    self._drop(user_id)
        self._evict()

    def refresh(self, generations: Mapping[str, int]) -> None:
        """Drop the copies older than these generations, just read from the database
        (another replica wrote those users' vectors since the copies were loaded)."""
        for user_id, generation in generations.items():
            held = self._users.get(user_id)
            if held is not None and held.generation < generation:
                self._drop(user_id)
                if self.copies is not None:
                    self.copies.discard([user_id])
            self._read[user_id] = max(generation, self._read.get(user_id, 0))
            self._read.move_to_end(user_id)
        while len(self._read) > GENERATIONS_KEPT:
            self._read.popitem(last=False)

    def advance(self, generations: Mapping[str, int]) -> None:
        """After this process's own write bumped these generations: a copy one behind holds
        that write (upsert kept it in step) and nothing else missed, so it stays current."""
        for user_id, generation in generations.items():
            held = self._users.get(user_id)
            if held is not None and held.generation == generation - 1:
                held.generation = generation

    def changing(self, user_ids: Iterable[str]) -> None:
        """Before a write that may change these users' vectors, discard their files; copies
        in memory stay and are saved when dropped."""
        if self.copies is None:
            return
        users = set(user_ids)
        self.copies.discard(users)
        self._unsaved.update(users & self._users.keys())

    def save(self) -> None:
        """Write the files of the copies changed since they were loaded (at close)."""
        if self.copies is not None:
            for user_id in self._unsaved & self._users.keys():
                self.copies.write(user_id, self._users[user_id])
        self._unsaved.clear()

    def forget(self, *, ids: Sequence[str] | None, user_id: str | None) -> None:
        """Drop the copies a delete may have changed (they reload on next use)."""
        if ids is None and user_id is None:
            self._users.clear()
            self._unsaved.clear()
            return
        for held_by, vectors in list(self._users.items()):
            if held_by == user_id or (ids is not None and any(i in vectors.rows for i in ids)):
                self._drop(held_by)

    def _drop(self, user_id: str) -> None:
        del self._users[user_id]
        self._unsaved.discard(user_id)

    def _evict(self) -> None:
        total = sum(v.nbytes for v in self._users.values())
        # The most recent user always stays, even alone over the limit: dropping it would
        # reload it on every query.
        while total > self.max_bytes and len(self._users) > 1:
            user_id, dropped = self._users.popitem(last=False)
            total -= dropped.nbytes
            if user_id in self._unsaved and self.copies is not None:
                self.copies.write(user_id, dropped)
            self._unsaved.discard(user_id)

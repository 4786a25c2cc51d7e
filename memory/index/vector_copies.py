"""Users' vector copies kept on disk, so the first recall after a start reads one file.

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

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from memory.index.vector_cache import MISSING, UserVectors
from memory.storage.file_modes import PRIVATE_FILE, private_dir

log = logging.getLogger(f"memproxy.{__name__}")
VERSION = 1


class CopyFiles:
    """One file per user in `folder`, valid for the collection `collection_id` only."""

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
                    "version": VERSION, "collection": self.collection_id, "user_id": user_id,
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
            "version": VERSION, "collection": self.collection_id, "user_id": user_id,
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

"""Users' vector copies kept on disk, so the first recall after a start reads one file.

Loading a 10k-turn user's copy from Chroma (a get filtered on user_id, 10k rows) took
1.8-2.6 s here, nearly all of it inside Chroma; reading the same copy from its file takes a
few milliseconds. A file holds the ids, the vectors as float16 (half the bytes; a cosine moves
by about 1e-4) and the metadata as integer codes per key, with the collection's id: a
collection created again (index/vectors.py heals itself that way) never reads an old file.

A file is only right while nothing has changed the user's vectors since it was written, so the
index discards it before every write that may touch the user (before, not after: a crash
between the two leaves no stale file behind). The copy in memory stays exact, and is written
back when it is dropped from memory or the index closes; a copy loaded from Chroma is written
at once.
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
from typing import Any

import numpy as np

from memory.index.vector_cache import UserVectors

log = logging.getLogger(f"memproxy.{__name__}")
VERSION = 1


class CopyFiles:
    """One .npz file per user in `folder`, valid for the collection `collection_id` only."""

    def __init__(self, folder: Path, collection_id: str) -> None:
        self.folder = folder
        self.collection_id = collection_id
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, user_id: str) -> Path:
        """The user's file (named by a digest: user ids are free text)."""
        return self.folder / f"{hashlib.sha256(user_id.encode()).hexdigest()[:32]}.npz"

    def read(self, user_id: str, dim: int) -> UserVectors | None:
        """The user's copy from its file, or None when there is no usable file."""
        path = self.path(user_id)
        try:
            with np.load(path, allow_pickle=False) as data:
                head = json.loads(bytes(data["head"]).decode())
                if head != {"version": VERSION, "collection": self.collection_id,
                            "user_id": user_id, "dim": dim}:
                    return None
                vectors = UserVectors(dim)
                vectors.ids = [str(i) for i in data["ids"]]
                vectors.rows = {id_: row for row, id_ in enumerate(vectors.ids)}
                vectors.matrix = np.asarray(data["matrix"], dtype=np.float32)
                codes = json.loads(bytes(data["codes"]).decode())
                vectors.codes = {key: {v: c for c, v in enumerate(values)}
                                 for key, values in codes.items()}
                vectors.columns = {key: np.array(data[f"column_{n}"], dtype=np.int32)
                                   for n, key in enumerate(codes)}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as exc:  # damaged or foreign: Chroma has it all
            log.warning("ignoring the vector copy %s (%s: %s)", path, type(exc).__name__, exc)
            return None
        if len(vectors.matrix) == 0:  # UserVectors grows by doubling: it needs one row at least
            vectors.matrix = np.zeros((16, dim), dtype=np.float32)
        return vectors

    def write(self, user_id: str, vectors: UserVectors) -> None:
        """Store the user's copy (atomically: a reader sees the old file or the new one)."""
        n = len(vectors.ids)
        dim = vectors.matrix.shape[1]
        keys = list(vectors.codes)
        head = {"version": VERSION, "collection": self.collection_id, "user_id": user_id,
                "dim": dim}
        # Values in code order: code c is the c-th value of its key.
        codes = {key: sorted(vectors.codes[key], key=vectors.codes[key].__getitem__)
                 for key in keys}
        arrays: dict[str, Any] = {
            "head": np.frombuffer(json.dumps(head).encode(), dtype=np.uint8),
            "ids": np.array(vectors.ids, dtype=str),
            "matrix": vectors.matrix[:n].astype(np.float16),
            "codes": np.frombuffer(json.dumps(codes).encode(), dtype=np.uint8),
            **{f"column_{i}": vectors.columns[key][:n] for i, key in enumerate(keys)},
        }
        path = self.path(user_id)
        partial = path.with_suffix(".partial.npz")
        try:
            with partial.open("wb") as out:
                np.savez(out, **arrays)
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
        self.folder.mkdir(parents=True, exist_ok=True)

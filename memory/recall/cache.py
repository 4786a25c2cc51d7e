"""Recall results of recent requests, for retried and regenerated requests.

A request sent again (same user, session, messages and settings) would recall the same
thing unless the user's memory changed in between, so its result is kept under a key made
of all of them, stamped with the user's memory version (memory.storage.versions) and its organisation's, and
reused while the stamp holds. The stamp lives in the database, so a write made by another
process sharing it invalidates too. Bounded: the least recently used result goes first.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
# The memory versions a result was recalled at (each: the writes to the memory, and those of
# its vectors, besides the session's own; memory.storage.versions): the user's, and the
# organisation's when the request reaches its shared memory. The vectors count apart: a
# turn's chunks are written (and counted) before its vectors, so a result recalled in
# between lacks their dense hits.
Version = tuple[int, int]
Stamp = tuple[Version, Version | None]


def cache_key(*parts: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """A digest of the request's settings and its whole conversation."""
    text = json.dumps([parts, list(messages)], default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class RecallCache(Generic[T]):
    """At most `size` results, each valid for one stamp."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[str, tuple[Stamp, T]] = OrderedDict()

    def get(self, key: str, stamp: Stamp) -> T | None:
        """The result kept under `key` for this stamp, or None."""
        kept = self._kept.get(key)
        if kept is None or kept[0] != stamp:
            return None
        self._kept.move_to_end(key)
        return kept[1]

    def put(self, key: str, stamp: Stamp, result: T) -> None:
        """Keep `result`, valid while the user's stamp is `stamp`."""
        if self.size <= 0:
            return
        self._kept[key] = (stamp, result)
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

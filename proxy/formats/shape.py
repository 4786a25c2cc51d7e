"""What compaction needs to know of a conversation's items, as each format reports it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """What compaction needs to know of a conversation's items."""

    roles: Sequence[str | None]  # user, assistant, system, ... (None: other items)
    pairs: Sequence[tuple[int, int]]  # (call, result) item indexes that must stay together


def pairs_by_id(calls: Iterable[tuple[int, Any]], results: Iterable[tuple[int, Any]]) -> list[tuple[int, int]]:
    """(call index, result index) for each result whose id names a call."""
    where = {key: index for index, key in calls if isinstance(key, str)}
    return [(where[key], index) for index, key in results if isinstance(key, str) and key in where]

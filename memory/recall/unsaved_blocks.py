"""Stable injection for sessions that store nothing (`X-Memory-Write: off`): their blocks
kept in this process only (docs/memory.md, "Prompt caching: stable injection").

A block is kept under the user, the session and a digest of the conversation up to the user
message it was placed before, so a later request that resends that conversation finds it
and puts it back byte for byte. Nothing here reaches the database or a file. Each block is
stamped with the user's memory version (memory.storage.versions) and, when the request
reaches it, its organisation's: a delete anywhere (the memory API, clear, retention, a fact
superseded, by any process sharing the database) bumps the version, and the user's blocks
are dropped at their next lookup. So does any other write to the user's memory, which is
stricter than stored blocks are (those go only with deletes) and costs one broken prefix;
so does a request of the user with another scope (its stamp has the organisation's part or
lacks it).
A process that does not hold a session's blocks (a restart, another replica, an evicted
entry) recalls a new block, as without this cache.

Bounded by entries and by bytes: the least recently used block goes first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from memory.storage.injections import Injection

Key = tuple[str, str, str]  # user, session, digest of the conversation to a user message
# A stamp: the user's memory version, and the organisation's (or None).
Stamp = tuple[int, int | None]
ENTRY_OVERHEAD = 200  # bytes besides the block and item keys: the key, the tuple, the dict slot


def user_turn_digests(messages: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """{index of a user message: digest of the conversation's turns up to it}.

    System and developer messages are left out: a block is placed by the conversation it
    was recalled for, as the stored blocks are found by their turns.
    """
    running = hashlib.sha256()
    digests: dict[int, str] = {}
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in ("system", "developer"):
            continue
        running.update(orjson.dumps([role, message.get("content"), message.get("name")],
                                    default=str))
        if role == "user":
            digests[i] = running.copy().hexdigest()
    return digests


class UnsavedBlocks:
    """At most `entries` blocks and `max_bytes` bytes of them."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[Key, tuple[Injection, int]] = OrderedDict()  # block, bytes
        # A user's blocks, and the stamp they were all recalled at (another one drops them).
        self._by_user: dict[str, tuple[Stamp, set[Key]]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def placed(
        self, user_id: str, session_id: str, messages: Sequence[Mapping[str, Any]], stamp: Stamp
    ) -> dict[int, Injection]:
        """{index into `messages`: the block kept for that user message}; the user's blocks
        are dropped first when their stamp is not `stamp`."""
        if not self._current(user_id, stamp):
            return {}
        found: dict[int, Injection] = {}
        for index, digest in user_turn_digests(messages).items():
            kept = self._kept.get((user_id, session_id, digest))
            if kept is not None:
                self._kept.move_to_end((user_id, session_id, digest))
                found[index] = kept[0]
        return found

    def keep(
        self, user_id: str, session_id: str, messages: Sequence[Mapping[str, Any]], index: int,
        injection: Injection, stamp: Stamp,
    ) -> None:
        """Keep the block placed before `messages[index]` (a user message), recalled while
        the user's memory was at `stamp`; the first one kept stays (a retry reuses it)."""
        digest = user_turn_digests(messages).get(index)
        size = (len(injection.block.encode()) + sum(len(k) for k in injection.items)
                + len(session_id) + ENTRY_OVERHEAD)
        if digest is None or self.entries <= 0 or size > self.max_bytes:
            return
        key = (user_id, session_id, digest)
        if self._current(user_id, stamp) and key in self._kept:
            return
        self._kept[key] = (injection, size)
        self._by_user.setdefault(user_id, (stamp, set()))[1].add(key)
        self.bytes += size
        while len(self._kept) > self.entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._kept)))

    def blocks_of(self, user_id: str) -> list[Injection]:
        """The blocks kept for `user_id` (whatever their stamp)."""
        kept_at = self._by_user.get(user_id)
        return [self._kept[key][0] for key in kept_at[1]] if kept_at else []

    def forget_user(self, user_id: str) -> None:
        """Drop every block kept for `user_id`."""
        kept_at = self._by_user.get(user_id)
        for key in list(kept_at[1]) if kept_at else []:
            self._drop(key)

    def _current(self, user_id: str, stamp: Stamp) -> bool:
        """Whether blocks of `user_id` are kept at `stamp`; those kept at another are dropped."""
        kept_at = self._by_user.get(user_id)
        if kept_at is not None and kept_at[0] != stamp:
            self.forget_user(user_id)
        return kept_at is not None and kept_at[0] == stamp

    def _drop(self, key: Key) -> None:
        _, size = self._kept.pop(key)
        self.bytes -= size
        keys = self._by_user[key[0]][1]
        keys.discard(key)
        if not keys:
            del self._by_user[key[0]]

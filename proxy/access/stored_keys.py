"""Keys in the database as authentication sees them (docs/keys.md): a short cache in front of
the database, which stays the truth.

A presented secret is hashed once (SHA-256) and looked up by its digest; the row's digest is
then compared in constant time. Found and not-found answers are both kept for TTL seconds
(2 s), so a revocation on any replica reaches this one within TTL plus one lookup (docs/keys.md
promises 5 s); expiry is judged on every request from the cached `expires_at`, so it takes
effect at once. Concurrent misses for one digest share one database read.

Last-used times are written at most once per TOUCH_EVERY seconds per key and replica, in one
batched write a second after the first use that needs one: never a write per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from config import ApiKey
from memory import KeyStore, StoredKey, key_digest
from proxy.http.errors import AuthenticationFailed, MemoryUnavailable

log = logging.getLogger("memproxy.keys")

TTL = 2.0  # seconds a lookup (found or not) is kept
TOUCH_EVERY = 60.0  # seconds between last-used writes of one key from one replica
_MAX_ENTRIES = 4096  # past this, expired entries go; if all are fresh, all go
_FLUSH_DELAY = 1.0  # seconds the first pending last-used time waits for others to join it


@dataclass(frozen=True)
class _Entry:
    until: float
    row: StoredKey | None
    key: ApiKey | None  # what the row authenticates as (None: no row)


def as_api_key(row: StoredKey) -> ApiKey:
    """The ApiKey a stored key authenticates as: `key` holds the digest, never the secret."""
    return ApiKey(
        row.digest, row.user_id, row.org_id, row.org_writer, key_id=row.id,
        token_quota=row.token_quota,
        rate_limit=float(row.rate_limit) if row.rate_limit is not None else None,
        expires_at=row.expires_at,
    )


class StoredKeys:
    """Lookups of stored keys by secret, cached for TTL seconds."""

    def __init__(
        self, store: KeyStore, *, ttl: float = TTL, touch_every: float = TOUCH_EVERY,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.touch_every = touch_every
        self.clock = clock
        self.wall = wall
        self._entries: dict[str, _Entry] = {}
        self._members: dict[str, tuple[float, frozenset[str]]] = {}
        self._loading: dict[str, asyncio.Task[StoredKey | None]] = {}
        self._touched: dict[str, float] = {}  # key id -> clock of its last scheduled write
        self._pending: dict[str, float] = {}  # key id -> wall time it was used
        self._flush: asyncio.Task[None] | None = None

    async def find(self, secret: str) -> ApiKey:
        """The key this secret belongs to; 401 when it is unknown, revoked or expired."""
        digest = key_digest(secret)
        now = self.clock()
        entry = self._entries.get(digest)
        if entry is None or entry.until <= now:
            entry = await self._load(digest, now)
        row, key = entry.row, entry.key
        # The row was found by this digest; comparing again, in constant time, keeps a
        # database that matched loosely (a collation, a prefix index) from letting one in.
        if row is None or key is None or not hmac.compare_digest(row.digest, digest):
            raise AuthenticationFailed("incorrect API key provided")
        if row.revoked_at is not None:
            raise AuthenticationFailed("this API key has been revoked")
        if row.expires_at is not None and row.expires_at <= self.wall():
            raise AuthenticationFailed("this API key has expired")
        if now - self._touched.get(row.id, -self.touch_every) >= self.touch_every:
            self._touch(row.id, now)
        return key

    async def members(self, org_id: str) -> frozenset[str]:
        """The users live stored keys of `org_id` are bound to (cached like keys)."""
        now = self.clock()
        cached = self._members.get(org_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            found = await self.store.members(org_id, self.wall())
        except Exception as exc:
            raise _unreachable(exc) from None
        if len(self._members) >= _MAX_ENTRIES:
            self._members.clear()
        self._members[org_id] = (now + self.ttl, found)
        return found

    def forget(self, key_id: str) -> None:
        """Drop what this replica cached of a key (it changed here; others wait out TTL)."""
        for digest, entry in list(self._entries.items()):
            if entry.row is not None and entry.row.id == key_id:
                del self._entries[digest]
        self._members.clear()

    async def _load(self, digest: str, now: float) -> _Entry:
        loading = self._loading.get(digest)
        if loading is None:
            loading = asyncio.get_running_loop().create_task(self.store.find(digest))
            self._loading[digest] = loading
            loading.add_done_callback(partial(_settled, self._loading, digest))
        try:
            # Shielded: one caller going away does not cancel the read the others wait on.
            row = await asyncio.shield(loading)
        except Exception as exc:
            raise _unreachable(exc) from None
        entry = _Entry(now + self.ttl, row, as_api_key(row) if row is not None else None)
        if len(self._entries) >= _MAX_ENTRIES:
            self._entries = {d: e for d, e in self._entries.items() if e.until > now}
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries.clear()
        self._entries[digest] = entry
        return entry

    def _touch(self, key_id: str, now: float) -> None:
        self._touched[key_id] = now
        self._pending[key_id] = self.wall()
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._write_later())

    async def _write_later(self) -> None:
        await asyncio.sleep(_FLUSH_DELAY)
        await self.flush()

    async def flush(self) -> None:
        """Write the pending last-used times now (a failure only loses those times)."""
        pending, self._pending = self._pending, {}
        try:
            await self.store.touch(pending.items())
        except Exception as exc:  # last-used is a hint: never worth failing a request
            log.warning("could not record keys' last use", extra={"error": type(exc).__name__})

    async def aclose(self) -> None:
        """Write what is pending and stop."""
        if self._flush is not None and not self._flush.done():
            self._flush.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush
        await self.flush()


def _unreachable(exc: Exception) -> MemoryUnavailable:
    log.warning("key lookup failed", extra={"error": type(exc).__name__})
    return MemoryUnavailable("cannot check this API key now: the key database is unreachable")


def _settled(loading: dict[str, asyncio.Task[StoredKey | None]], digest: str,
             task: asyncio.Task[StoredKey | None]) -> None:
    if loading.get(digest) is task:
        del loading[digest]
    if not task.cancelled():
        task.exception()  # retrieved, so a failure nobody awaited any more is not reported twice

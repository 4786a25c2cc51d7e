"""Per-key limits: a request-rate token bucket (off by default) and a cap on open streams.

`MEMPROXY_RATE_LIMIT` requests per minute refill each key's bucket continuously; the bucket
holds `MEMPROXY_RATE_LIMIT_BURST` requests (default: one minute's worth). A request finding
it empty gets 429 with `Retry-After`: the whole seconds until the bucket holds a request
again, so a client that waits that long is let in. `MEMPROXY_MAX_STREAMS_PER_KEY` caps the
streamed chat completions a key has open; the slot is freed when the stream ends, fails or
the client goes away, and one over the cap gets 429 with `Retry-After: 1`.

The key is the proxy key when one was presented (named by its `key_id`, never its secret),
else the client's bearer key, else the resolved user id. Without proxy keys nothing checks
those strings, so a client could send a new one with every request: then the client's
address is a second bucket, and a request must fit in both. A bearer key is held only as a
BLAKE2b digest, never as sent. A stored key's own `rate_limit` (docs/keys.md) replaces
`MEMPROXY_RATE_LIMIT` for its bucket, with one minute's worth as its burst.

Across replicas (docs/keys.md, "Rate limits across replicas"): a proxy key's rate is held
in the database (`rate_buckets`), so N replicas give it its rate, not N times it. This
replica's own bucket is asked first, and refuses without a database round trip (no replica
may exceed the whole rate alone); a request it admits then takes from the shared bucket, in
one statement. Buckets without a proxy key (a client's address, or whatever key a client
sends when keys are off) stay per replica: their names are the client's choice, and a
shared table of them would be an unbounded write for anyone. Open streams are per replica.
If the database cannot be reached, the replica's own bucket decides alone.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from config import ApiKey, Settings
from memory import SharedBuckets
from proxy.access.identity import presented_key
from proxy.http.errors import RateLimited
from proxy.http.logs import get_logger
from proxy.http.relay import RelayResponse, StreamOutcome

log = get_logger("limits")
STREAM_RETRY_AFTER = 1  # seconds: streams end at their own pace, so a short constant
_SWEEP_EVERY = 1024  # admissions between sweeps of idle keys
_KEEP_IDLE = 1024  # keys kept without a sweep


def limit_key(api_key: ApiKey | None, headers: Mapping[str, str], user_id: str) -> str:
    """Whom a request counts against: proxy key, else the client's key, else the user."""
    if api_key is not None:
        return "key:" + api_key.key_id
    raw = presented_key(headers)
    if raw:
        return "key:" + hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()
    return "user:" + user_id


def limit_keys(
    api_key: ApiKey | None, request: Request, user_id: str, settings: Settings
) -> tuple[str, ...]:
    """Every bucket a request counts against: its key's, and without proxy keys (where the
    key is whatever string the client sent) also its address's."""
    key = limit_key(api_key, request.headers, user_id)
    if api_key is not None or settings.keys_required or request.client is None:
        return (key,)
    return (key, "addr:" + request.client.host)


@dataclass
class _Bucket:
    tokens: float
    updated: float
    streams: int = 0
    per_minute: float = 0.0  # its refill rate (a key's own rate_limit, or the setting's)
    capacity: float = 0.0


class StreamSlot:
    """One open stream of a key; `release` is idempotent."""

    def __init__(self, buckets: list[_Bucket]) -> None:
        self._buckets = buckets

    def release(self) -> None:
        """Give the slot back."""
        for bucket in self._buckets:
            bucket.streams -= 1
        self._buckets = []

    def hand_over(self, response: Any) -> None:
        """Hold the slot until a relayed stream ends; release it now for anything else
        (a JSON reply, a dry run, an error: `response` is None)."""
        if not isinstance(response, RelayResponse):
            self.release()
            return
        after = response.on_done

        def done(outcome: StreamOutcome) -> None:
            self.release()
            if after is not None:
                after(outcome)

        response.on_done = done


class KeyLimits:
    """Request rate and open streams per key."""

    def __init__(
        self, rate_per_minute: int = 0, burst: int = 0, max_streams: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_minute = rate_per_minute
        self.rate = rate_per_minute / 60.0  # requests per second
        self.capacity = float(burst or rate_per_minute)
        self.max_streams = max_streams
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._admitted = 0
        # Proxy keys' buckets in the database (set once it is open); None: per replica.
        self.shared: SharedBuckets | None = None
        self.wall_clock: Callable[[], float] = time.time  # the shared buckets' time

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyLimits:
        """The limits the settings ask for."""
        return cls(settings.rate_limit, settings.rate_limit_burst, settings.max_streams_per_key)

    def applies(self, api_key: ApiKey | None) -> bool:
        """Whether a request with this key meets any limit (a stored key may have its own)."""
        return bool(self.rate or self.max_streams) or (
            api_key is not None and api_key.rate_limit is not None)

    def admit(self, *keys: str, stream: bool, rate: float | None = None) -> StreamSlot | None:
        """Let one request through or raise RateLimited; it counts against every one of
        `keys`, and each must admit it. A stream gets a slot. `rate`: the first key's own
        requests per minute, instead of MEMPROXY_RATE_LIMIT.

        Nothing is taken from a request that is refused, so a refusal costs no quota.
        """
        limit_streams = stream and self.max_streams > 0
        if not (self.rate or limit_streams or rate):
            return None
        now = self.clock()
        buckets = [self._bucket(key, now, rate if i == 0 else None) for i, key in enumerate(keys)]
        for bucket in buckets:
            self._check(bucket, limit_streams)
        for bucket in buckets:
            if bucket.per_minute:
                bucket.tokens -= 1.0
            if limit_streams:
                bucket.streams += 1
        self._sweep(now)
        return StreamSlot(buckets) if limit_streams else None

    async def take(
        self, api_key: ApiKey | None, keys: tuple[str, ...], *, stream: bool
    ) -> StreamSlot | None:
        """`admit` here, then, for a proxy key with a rate, from the bucket every replica
        shares; a refusal there gives this replica's request back and raises RateLimited."""
        rate = api_key.rate_limit if api_key is not None else None
        slot = self.admit(*keys, stream=stream, rate=rate)
        per_minute = float(rate or self.per_minute)
        if self.shared is None or api_key is None or not per_minute:
            return slot
        capacity = per_minute if rate else self.capacity
        try:
            level = await self.shared.take(keys[0], per_minute=per_minute, capacity=capacity,
                                           now=self.wall_clock())
        except Exception as exc:  # the database is down: this replica's bucket decides
            log.warning(f"shared rate limit not read: {type(exc).__name__}: {exc}")
            return slot
        if level is None:
            return slot
        if slot is not None:
            slot.release()
        self._buckets[keys[0]].tokens += 1.0  # not spent here: the request is refused
        raise _rate_limited(per_minute, level, ", on every replica together")

    def _bucket(self, key: str, now: float, rate: float | None) -> _Bucket:
        per_minute = rate or float(self.per_minute)
        capacity = per_minute if rate else self.capacity
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(capacity, now, 0, per_minute, capacity)
        elif bucket.per_minute != per_minute:  # the key's rate changed (PATCH)
            bucket.per_minute, bucket.capacity = per_minute, capacity
            bucket.tokens = min(bucket.tokens, capacity)
        if per_minute:
            refill = (now - bucket.updated) * per_minute / 60.0
            bucket.tokens = min(capacity, bucket.tokens + refill)
            bucket.updated = now
        return bucket

    def _check(self, bucket: _Bucket, limit_streams: bool) -> None:
        if limit_streams and bucket.streams >= self.max_streams:
            raise RateLimited(
                f"too many concurrent streams for this key: the limit is {self.max_streams}",
                code="concurrency_limit_exceeded",
                headers={"Retry-After": str(STREAM_RETRY_AFTER)},
            )
        # The tolerance absorbs float error, so waiting exactly Retry-After is enough.
        if bucket.per_minute and bucket.tokens < 1.0 - 1e-9:
            raise _rate_limited(bucket.per_minute, bucket.tokens)

    @property
    def tracked_keys(self) -> int:
        """How many keys have state (idle ones are forgotten every so often)."""
        return len(self._buckets)

    def open_streams(self, key: str) -> int:
        """How many streams `key` has open now."""
        bucket = self._buckets.get(key)
        return bucket.streams if bucket is not None else 0

    def _sweep(self, now: float) -> None:
        # Forget keys that are back where a new key starts (full bucket, no stream), so
        # many one-off users do not grow memory without bound.
        self._admitted += 1
        if self._admitted % _SWEEP_EVERY or len(self._buckets) <= _KEEP_IDLE:
            return
        idle = [
            key for key, b in self._buckets.items()
            if b.streams == 0 and (
                not b.per_minute
                or b.tokens + (now - b.updated) * b.per_minute / 60.0 >= b.capacity
            )
        ]
        for key in idle:
            del self._buckets[key]


def _rate_limited(per_minute: float, level: float, where: str = "") -> RateLimited:
    """429 for a bucket holding `level` requests: Retry-After is the whole seconds until it
    holds one again (at least 1)."""
    wait = max(1, math.ceil((1.0 - max(level, 0.0)) * 60.0 / per_minute))
    return RateLimited(f"rate limit reached: {per_minute:g} requests per minute for this"
                       f" key{where}; try again in {wait} s",
                       code="rate_limit_exceeded", headers={"Retry-After": str(wait)})

"""Usage per day (UTC), key and user, and the monthly token quota (docs/usage.md).

Every request of /v1/chat/completions, /v1/responses and /v1/messages (and of the
pass-through, requests and errors only) is counted in process by `UsageMeter.count`: a dict
update, nothing else on the request's path. A background task adds the counts to the
database (`usage_daily`) every MEMPROXY_USAGE_FLUSH_SECONDS and once more at shutdown;
a failed write keeps them for the next flush. A crash loses at most one interval.

A key with a `token_quota` is checked before its request's body is read: the month's input
and output tokens of every replica (the database, read at most every QUOTA_CACHE_SECONDS,
and again after this process flushed the key's tokens) plus this process's counts not yet
written. Requests already running finish, so a key may end a little over its quota.

Past that check, a request of a quota key reserves an estimate of its tokens
(proxy/access/quota.py) in the database, in one transaction with the month's figure, and is
refused when the month's tokens plus every replica's reservations reached the quota. When
it ends (whatever way: a reply, an error, a cut stream, a client gone) its reservation is
settled: deleted in the same transaction that adds its counts to `usage_daily`. The
overshoot this leaves is bounded in docs/usage.md.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from config import ApiKey
from memory import UsageCounts, UsageLedger, UsageRow
from proxy.access.quota import LEASE_SECONDS
from proxy.http.errors import RateLimited
from proxy.http.logs import get_logger
from proxy.http.relay import RelayResponse, StreamOutcome

log = get_logger("usage")
NO_KEY = "none"  # the key_id of requests made without a proxy key (keys off, or a wrong one)
QUOTA_CACHE_SECONDS = 2.0  # how stale another replica's spending may be when a quota is read
DAY = 86400


@dataclass
class Tally:
    """One request's figures, filled in as it goes."""

    input_tokens: int = 0
    output_tokens: int = 0
    memory_tokens: int = 0
    error: bool = False


@dataclass
class _Read:
    tokens: int  # from the database: the month so far, every replica
    at: float  # time.monotonic() of the read
    month: str  # the month's first day
    flushes: int  # this process's flush count when the read began


class UsageMeter:
    """The in-process counts, their flushing, and quota checks."""

    def __init__(
        self, ledger: UsageLedger, *, flush_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ledger = ledger
        self.flush_seconds = flush_seconds
        self.clock = clock
        # (day, key_id, user_id) -> [requests, input, output, memory tokens, errors]
        self._pending: dict[tuple[str, str, str], list[int]] = {}
        self._flushing: dict[tuple[str, str, str], list[int]] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._day_number = -1
        self._day = ""
        # Quotas: the month's tokens per key, as last read, and reads under way.
        self._reads: dict[str, _Read] = {}
        self._reading: dict[str, asyncio.Future[int]] = {}
        self._flushes = 0
        self._settling: set[asyncio.Task[None]] = set()

    # -- counting (the request's path)

    def count(self, key_id: str, user_id: str, tally: Tally) -> None:
        """Count one finished request."""
        number = int(self.clock()) // DAY
        if number != self._day_number:
            self._day_number = number
            self._day = time.strftime("%Y-%m-%d", time.gmtime(number * DAY))
        row = self._pending.get((self._day, key_id, user_id))
        if row is None:
            row = self._pending[(self._day, key_id, user_id)] = [0, 0, 0, 0, 0]
        row[0] += 1
        row[1] += tally.input_tokens
        row[2] += tally.output_tokens
        row[3] += tally.memory_tokens
        row[4] += tally.error

    # -- flushing

    def start(self) -> None:
        """Flush every flush_seconds until close()."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            await self.flush()

    async def close(self) -> None:
        """Stop the periodic flush, wait for settlements, and write what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        await self.flush()

    async def flush(self) -> None:
        """Write the counts so far; on failure they wait for the next flush."""
        async with self._lock:
            if not self._pending:
                return
            self._flushing, self._pending = self._pending, {}
            rows = [UsageRow(day, key, user, UsageCounts(*values))
                    for (day, key, user), values in self._flushing.items()]
            try:
                await self.ledger.add(rows)
            except Exception as exc:  # the database is down: keep the counts, try again
                log.warning(f"usage not written, kept for the next flush: {type(exc).__name__}: {exc}")
                for where, values in self._flushing.items():
                    row = self._pending.setdefault(where, [0, 0, 0, 0, 0])
                    for i, value in enumerate(values):
                        row[i] += value
            else:
                if any(key in self._reads for _, key, _ in self._flushing):
                    self._flushes += 1  # quota reads from before this write are short now
            finally:
                self._flushing = {}

    # -- quotas

    async def check_quota(self, key: ApiKey) -> None:
        """429 when `key` has a token quota and this month's tokens reached it."""
        quota = key.token_quota
        if quota is None:
            return
        try:
            used = await self.month_tokens(key.key_id)
        except Exception as exc:  # the database is down: the last figure read, else let it by
            log.warning(f"quota not read: {type(exc).__name__}: {exc}")
            read = self._reads.get(key.key_id)
            used = read.tokens if read is not None else 0
        if used >= quota:
            raise self._spent(used, quota)

    def _spent(self, used: int, quota: int, held: int = 0) -> RateLimited:
        resets = _next_month(self.clock())
        running = f" ({held} more held by requests still running)" if held else ""
        return RateLimited(
            f"this key's monthly token quota is spent: {used} of {quota} tokens used this"
            f" month{running}; it resets at"
            f" {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(resets))}",
            code="token_quota_exceeded",
            headers={"Retry-After": str(max(1, int(resets - self.clock())))},
        )

    async def reserve(self, key: ApiKey, tokens: int) -> str | None:
        """Hold `tokens` of `key`'s quota for one request, or raise 429 when its month
        (spent plus every replica's reservations) reached the quota; the reservation's id,
        None when the key has no quota or the database is down (usage never breaks the
        chat: the request goes by)."""
        quota = key.token_quota
        if quota is None:
            return None
        now = self.clock()
        try:
            hold = await self.ledger.reserve(
                key.key_id, first_day=time.strftime("%Y-%m-01", time.gmtime(now)), quota=quota,
                tokens=tokens, hold_id=uuid.uuid4().hex, now=now, expires_at=now + LEASE_SECONDS,
            )
        except Exception as exc:
            log.warning(f"quota not reserved: {type(exc).__name__}: {exc}")
            return None
        used = hold.used + self._unwritten(key.key_id, time.strftime("%Y-%m-01", time.gmtime(now)))
        if hold.hold_id is None:
            raise self._spent(used, quota, hold.held)
        return hold.hold_id

    def settle(self, hold_id: str, key_id: str, user_id: str, tally: Tally) -> asyncio.Task[None]:
        """End a request's reservation and write its counts, in one transaction, in a task
        of its own that a client going away does not cancel (a failed write leaves the
        counts to the next flush and the reservation to its lease)."""
        task = asyncio.get_running_loop().create_task(self._settle(hold_id, key_id, user_id, tally))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def _settle(self, hold_id: str, key_id: str, user_id: str, tally: Tally) -> None:
        day = time.strftime("%Y-%m-%d", time.gmtime(self.clock()))
        counts = UsageCounts(1, tally.input_tokens, tally.output_tokens, tally.memory_tokens,
                             int(tally.error))
        try:
            await self.ledger.settle(hold_id, UsageRow(day, key_id, user_id, counts))
        except Exception as exc:  # the database is down: count it as any request is
            log.warning(f"reservation not settled: {type(exc).__name__}: {exc}")
            self.count(key_id, user_id, tally)
        self._reads.pop(key_id, None)  # the month read before this write is short now

    async def month_tokens(self, key_id: str) -> int:
        """The key's input and output tokens this month (UTC), every replica's."""
        month = time.strftime("%Y-%m-01", time.gmtime(self.clock()))
        read = self._reads.get(key_id)
        fresh = read is not None and read.month == month and read.flushes == self._flushes \
            and time.monotonic() - read.at < QUOTA_CACHE_SECONDS
        stored = read.tokens if fresh and read is not None else await self._read(key_id, month)
        return stored + self._unwritten(key_id, month)

    async def _read(self, key_id: str, month: str) -> int:
        """One database read per key at a time; concurrent requests share it."""
        reading = self._reading.get(key_id)
        if reading is not None:
            return await asyncio.shield(reading)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._reading[key_id] = future
        try:
            flushes, at = self._flushes, time.monotonic()
            tokens = (await self.ledger.tokens_since([key_id], month))[key_id]
            self._reads[key_id] = _Read(tokens, at, month, flushes)
            future.set_result(tokens)
            return tokens
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a failure nobody else awaited is not logged twice
            raise
        finally:
            del self._reading[key_id]

    def _unwritten(self, key_id: str, month: str) -> int:
        total = 0
        for batch in (self._pending, self._flushing):
            for (day, key, _), values in batch.items():
                if key == key_id and day >= month:
                    total += values[1] + values[2]
        return total


def count_usage(
    meter: UsageMeter, request: Request, tally: Tally, user_id: str,
    response: Response | RelayResponse | None, status: int,
) -> Awaitable[None] | None:
    """Count a request under its key and user; a stream once it ended (its tokens and
    errors are known then). A whole reply of a quota key returns its settlement, for the
    route to await before answering: the client's next request then finds it settled."""
    key: ApiKey | None = getattr(request.state, "usage_key", None)
    hold: str | None = getattr(request.state, "usage_hold", None)
    key_id = key.key_id if key is not None else NO_KEY
    user = user_id or (key.user_id if key is not None and key.user_id else "")

    def count() -> Awaitable[None] | None:
        if hold is None:
            meter.count(key_id, user, tally)
            return None
        return asyncio.shield(meter.settle(hold, key_id, user, tally))

    if not isinstance(response, RelayResponse):
        tally.error = status >= 400
        return count()
    after = response.on_done

    def done(outcome: StreamOutcome) -> None:
        if after is not None:
            after(outcome)  # the route's own end first: it fills in the stream's tokens
        tally.error = response.status >= 400 or outcome.error is not None \
            or outcome.cut_by_shutdown
        count()  # a stream's settlement: its last byte is out already

    response.on_done = done
    return None


def _next_month(now: float) -> float:
    """The unix time the month after `now`'s starts (UTC)."""
    today = time.gmtime(now)
    year, month = (today.tm_year + 1, 1) if today.tm_mon == 12 else (today.tm_year, today.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))

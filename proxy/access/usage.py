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
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from config import ApiKey
from memory import UsageCounts, UsageLedger, UsageRow
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
        """Stop the periodic flush and write what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
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
            resets = _next_month(self.clock())
            raise RateLimited(
                f"this key's monthly token quota is spent: {used} of {quota} tokens used this"
                f" month; it resets at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(resets))}",
                code="token_quota_exceeded",
                headers={"Retry-After": str(max(1, int(resets - self.clock())))},
            )

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
) -> None:
    """Count a request under its key and user; a stream once it ended (its tokens and
    errors are known then)."""
    key: ApiKey | None = getattr(request.state, "usage_key", None)
    key_id = key.key_id if key is not None else NO_KEY
    user = user_id or (key.user_id if key is not None and key.user_id else "")
    if not isinstance(response, RelayResponse):
        tally.error = status >= 400
        meter.count(key_id, user, tally)
        return
    after = response.on_done

    def done(outcome: StreamOutcome) -> None:
        if after is not None:
            after(outcome)  # the route's own end first: it fills in the stream's tokens
        tally.error = response.status >= 400 or outcome.error is not None \
            or outcome.cut_by_shutdown
        meter.count(key_id, user, tally)

    response.on_done = done


def _next_month(now: float) -> float:
    """The unix time the month after `now`'s starts (UTC)."""
    today = time.gmtime(now)
    year, month = (today.tm_year + 1, 1) if today.tm_mon == 12 else (today.tm_year, today.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))

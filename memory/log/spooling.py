"""The durable local spool: turns of answered requests that the database could not take
(an outage, memory.outages) wait in a local file (memory.storage.spool) and are replayed
into the database, in order, once it answers again.

What is spooled is the turn log's write itself: a session's path of turns (after a stored
turn, or from the start) and whether it ends in a reply. Replaying it is `append_turns`, the
same write the request would have made, so it queues the same jobs in the same transaction
(the index job; after a reply, the learning jobs), and a path the database already holds is
found by its hashes and stored again as nothing (memory.log.turn_log): a replay that runs
twice, or races a client resending its history, stores every turn once.

Order: while anything is spooled, new writes of this process go to the spool too, behind
it, so a session's turns reach the database in the order they were said.

Bounds: the spool holds at most `max_turns`, and one user at most `share` of them, so one
user cannot fill it for everyone (docs/deploy.md, the spool). The caller refuses a request
before it is forwarded while its user's share, or the spool, is full (`full`): refused
rather than answered and then dropped. An entry is put only when it fits under both bounds
(`SpoolFull` otherwise, which the request reports in X-Memory-Error): a request whose own
turns outnumber what is left is answered and not remembered, and nobody else is refused for
it. A request keeps room for its reply: its turns go in only when one more turn fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from memory.learning.learner import DEFAULT_ROUTE
from memory.outages import is_outage
from memory.storage.spool import SpooledEntry, SpoolFile, SpoolFull
from memory.storage.turns import NewTurn

log = logging.getLogger("memproxy.memory.spool")
_POLL_SECONDS = 1.0
_MIN_WAIT = 0.1


@dataclass(frozen=True, slots=True)
class Spooled:
    """Where a request's turns went instead of the database: the path they continue
    (`after`) and the turns, so the reply that follows them is spooled as their sequel."""

    after: int | None
    turns: tuple[NewTurn, ...]


# Replays one entry: (user, session, turns, after, ends in a reply, model, route) -> None.
Replay = Callable[[str, str, list[NewTurn], int | None, bool, str, str], Awaitable[None]]


class Spooling:
    """The spool file, its bound, and the task that replays it."""

    def __init__(
        self, spool: SpoolFile, *, max_turns: int, replay: Replay, backoff_max: float,
        redact: Callable[[str], str], share: int | None = None,
    ) -> None:
        self.file = spool
        self.max_turns = max_turns
        self.share = max_turns if share is None else min(share, max_turns)
        self._replay = replay
        self._backoff_max = max(_MIN_WAIT, backoff_max)
        self._redact = redact
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        """Turns waiting for the database."""
        return self.file.depth

    @property
    def active(self) -> bool:
        """Whether anything waits: new writes then queue behind it."""
        return self.file.depth > 0

    def full(self, user_id: str) -> bool:
        """Whether the spool holds its bound of turns, or `user_id` its share: that user's
        request that would store turns is refused until the database takes some."""
        return (self.file.depth >= self.max_turns
                or self.file.by_user.get(user_id, 0) >= self.share)

    def oldest_age(self, now: float | None = None) -> float | None:
        """Seconds the oldest waiting entry has waited, None when none waits."""
        oldest = self.file.oldest
        return None if oldest is None else (now or time.time()) - oldest

    def start(self) -> None:
        """Start replaying (what a previous run left first)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="spool-replay")

    async def close(self) -> None:
        """Stop replaying (what is left waits for the next start) and close the file."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.file.close)

    async def put(
        self, user_id: str, session_id: str, turns: Sequence[NewTurn], *, after: int | None,
        reply: bool, model: str, route: str = DEFAULT_ROUTE,
    ) -> Spooled:
        """Spool a path of turns (redacted first, as the database would store them)."""
        redacted = tuple(dataclasses.replace(t, content=self._redact(t.content)) for t in turns)
        entry = {"after": after, "reply": reply, "model": model, "route": route,
                 "turns": [dataclasses.asdict(t) for t in redacted]}
        # A client resends its history: count (and bound) only the turns not spooled yet.
        known = {(t.role, t.content) for t in await self.session_turns(user_id, session_id)}
        new = sum((t.role, t.content) not in known for t in redacted)
        try:
            await self.file.put(user_id, session_id, new, entry, room=(self.max_turns, self.share),
                                need=new if reply or new == 0 else new + 1)
        except SpoolFull:
            log.warning("database unreachable: %d new turn(s) of one request do not fit in the"
                        " spool (%d waiting): not remembered", new, self.file.depth)
            raise
        log.warning("database unreachable: %d new turn(s) spooled (%d waiting)", new,
                    self.file.depth)
        self._wake.set()
        return Spooled(after, redacted)

    async def session_turns(self, user_id: str, session_id: str) -> list[NewTurn]:
        """The turns of a session still in the spool, oldest first (each once)."""
        found: dict[tuple[str, str], NewTurn] = {}
        for entry in await self.file.of_session(user_id, session_id):
            for turn in _turns(entry):
                found.setdefault((turn.role, turn.content), turn)
        return list(found.values())

    async def drained(self, timeout: float) -> None:
        """Wait until nothing waits (tests, the chaos script); TimeoutError otherwise."""
        async with asyncio.timeout(timeout):
            while self.active:
                self._wake.set()
                await asyncio.sleep(0.05)

    async def _run(self) -> None:
        waits = 0
        while True:
            entry = await self.file.first()
            if entry is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_POLL_SECONDS):
                        await self._wake.wait()
                continue
            try:
                await self._replay(entry.user_id, entry.session_id, _turns(entry),
                                   entry.entry["after"], bool(entry.entry["reply"]),
                                   str(entry.entry["model"]),
                                   str(entry.entry.get("route", DEFAULT_ROUTE)))
            except Exception as exc:
                if is_outage(exc):
                    waits += 1
                    await asyncio.sleep(min(self._backoff_max, _MIN_WAIT * 2 ** min(waits, 10)))
                    continue
                log.error("a spooled write was refused by the database; kept aside in %s:"
                          " %s: %s", self.file.path, type(exc).__name__, exc)
                await self.file.set_aside(entry, f"{type(exc).__name__}: {exc}")
                continue
            waits = 0
            await self.file.remove(entry)
            if not self.active:
                log.warning("the spool is replayed: the database holds every spooled turn")


def _turns(entry: SpooledEntry) -> list[NewTurn]:
    allowed = {f.name for f in dataclasses.fields(NewTurn)}
    return [NewTurn(**{k: v for k, v in t.items() if k in allowed}) for t in entry.entry["turns"]]

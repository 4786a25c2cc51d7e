"""One clock for the whole shutdown: streams and running jobs drain together, and the process
has closed everything when `MEMPROXY_SHUTDOWN_GRACE_SECONDS` have passed since the signal.

    signal ─────────────────────────────── cut ─────────── deadline (signal + grace)
      streams relay, running jobs run;      │ open streams end, running jobs go back to
      no new connections, no new jobs       │ the queue; partial replies are stored and
                                            │ the stores closed (the reserve)

`begin()` starts the clock: the server calls it when the signal arrives (proxy/cli/main.py), and
the app's lifespan when it is told to shut down (a no-op when the server already did).
Streams watch `cut` (proxy/http/relay.py); the lifespan stops the job worker with `until_cut()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# What closing needs after the cut (storing partial replies, requeueing jobs, closing the
# databases: tens of milliseconds here) with room to spare: a fifth of the grace, at most 1 s.
RESERVE_SHARE = 0.2
RESERVE_MAX = 1.0


class Shutdown:
    """The shutdown's deadline and the moment in-flight work is cut."""

    def __init__(self, grace: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace = grace
        self.reserve = min(RESERVE_MAX, grace * RESERVE_SHARE)
        self.begun = asyncio.Event()
        self.cut = asyncio.Event()
        self.deadline: float | None = None
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None

    @property
    def work_seconds(self) -> float:
        """How long in-flight work may run after the signal: the grace less the reserve."""
        return self.grace - self.reserve

    def begin(self, at: float | None = None) -> None:
        """Start the clock at `at` (a reading of the clock, e.g. when the signal came) or now.

        Idempotent: the first call sets the deadline.
        """
        if self.deadline is not None:
            return
        self.deadline = (self._clock() if at is None else at) + self.grace
        self.begun.set()
        self._timer = asyncio.get_running_loop().call_later(self.until_cut(), self.cut.set)

    def until_cut(self) -> float:
        """Seconds until in-flight work is cut (the whole grace less the reserve before
        `begin()`; 0 once cut)."""
        if self.deadline is None:
            return self.work_seconds
        return max(0.0, self.deadline - self.reserve - self._clock())

    def remaining(self) -> float:
        """Seconds until the deadline (the whole grace before `begin()`)."""
        if self.deadline is None:
            return self.grace
        return max(0.0, self.deadline - self._clock())

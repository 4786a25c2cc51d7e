"""uvicorn in a thread that a test can stop at once.

The tests' memproxy (`tests.conftest.serve`) and the scripted upstream each run a
uvicorn.Server in a thread, and most tests stop one or two of them. uvicorn's main loop
notices `should_exit` by polling it every 0.1 s: a stop waited 0.05 s on average for the
poll alone, about 70 s over the suite's 1,500 server stops. `ThreadedServer.stop_soon()`
wakes the loop at once; what follows (uvicorn's own shutdown: new connections refused, open
ones drained, the lifespan closed) is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn


class ThreadedServer(uvicorn.Server):
    """uvicorn.Server whose main loop `stop_soon()` (from any thread) wakes at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        # uvicorn's loop (a tick every 0.1 s, the tick checks should_exit), woken early.
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._wake.wait()

    def stop_soon(self) -> None:
        """Ask the server to exit and wake its loop now (join its thread to wait for it)."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(wake.set)

"""The streaming response: relay upstream bytes as they arrive, untouched.

Once the first byte went out the status can no longer change, so a failure after that is
one SSE `error` event and the end of the stream; so is the shutdown's cut (proxy/http/shutdown.py)
of a stream still open. The route gives the event's bytes in its API format's own shape
(`error_event`; chat completions: proxy.http.errors.sse_error_event). A client that disconnects
cancels the upstream request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from proxy.http.errors import ProxyError, ShuttingDown, sse_error_event
from proxy.http.shutdown import Shutdown

SHUTDOWN_STATE = "memproxy.shutdown"  # the lifespan state key of the app's Shutdown


@dataclass
class StreamOutcome:
    """How a relayed stream ended."""

    completed: bool = False
    client_disconnected: bool = False
    error: ProxyError | None = None
    cut_by_shutdown: bool = False


class RelayResponse:
    """An ASGI response that copies an async byte iterator to the client."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        status: int,
        headers: dict[str, str],
        close: Callable[[], Awaitable[None]],
        on_error: Callable[[Exception], ProxyError],
        on_done: Callable[[StreamOutcome], None] | None = None,
        sse: bool = True,
        error_event: Callable[[ProxyError], bytes] = sse_error_event,
    ) -> None:
        self.body = body
        self.status = status
        self.headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.close = close
        self.on_error = on_error
        self.on_done = on_done
        self.sse = sse
        self.error_event = error_event  # the route's format renders its own error event
        self.outcome = StreamOutcome()
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        watchers = [loop.create_task(self._watch_disconnect(receive, task))]
        shutdown = scope.get("state", {}).get(SHUTDOWN_STATE)
        if isinstance(shutdown, Shutdown):
            watchers.append(loop.create_task(self._watch_shutdown(shutdown, task)))
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            ours = self.outcome.client_disconnected or self.outcome.cut_by_shutdown
            if not ours or task.uncancel() > 0:
                raise
            if self.outcome.cut_by_shutdown:
                await self._end_cut(send)
        finally:
            for watcher in watchers:
                watcher.cancel()
            await self.close()
            if self.on_done is not None:
                self.on_done(self.outcome)

    async def _watch_disconnect(self, receive: Receive, task: asyncio.Task[None]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.outcome.completed and not self.outcome.cut_by_shutdown:
            self.outcome.client_disconnected = True
            task.cancel()

    async def _watch_shutdown(self, shutdown: Shutdown, task: asyncio.Task[None]) -> None:
        await shutdown.cut.wait()
        if not self.outcome.completed and not self.outcome.client_disconnected:
            self.outcome.cut_by_shutdown = True
            task.cancel()

    async def _end_cut(self, send: Send) -> None:
        """End a stream the shutdown cut with one error event; a plain body cannot say it is
        incomplete, so its connection is aborted instead."""
        if not self.sse:
            raise asyncio.CancelledError
        if not self._started:
            await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        cut = ShuttingDown("memproxy is shutting down: the reply was cut before its end")
        try:
            await send({"type": "http.response.body", "body": self.error_event(cut),
                        "more_body": False})
        except OSError:
            self.outcome.client_disconnected = True

    async def _relay(self, send: Send) -> None:
        self._started = True  # before the await: a cancellation cannot land inside it unsent
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        body = aiter(self.body)
        tail = b""
        while True:
            # Upstream failures and client failures apart: aiohttp's read timeouts are
            # OSErrors too, and must not pass for a client that went away.
            try:
                chunk = await anext(body)
            except StopAsyncIteration:
                self.outcome.completed = True
                break
            except Exception as exc:
                self.outcome.error = self.on_error(exc)
                if not self.sse:
                    raise  # a plain body cannot carry an error: abort the connection instead
                tail = self.error_event(self.outcome.error)
                break
            try:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:
                self.outcome.client_disconnected = True
                return
        try:
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except OSError:
            self.outcome.client_disconnected = True

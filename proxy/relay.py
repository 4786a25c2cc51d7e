"""The streaming response: relay upstream bytes as they arrive, untouched.

Once the first byte went out the status can no longer change, so a failure after that is
one SSE `error` event and the end of the stream. A client that disconnects cancels the
upstream request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from proxy.errors import ProxyError, sse_error_event


@dataclass
class StreamOutcome:
    """How a relayed stream ended."""

    completed: bool = False
    client_disconnected: bool = False
    error: ProxyError | None = None


class RelayResponse:
    """An ASGI response that copies an async byte iterator to the client."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        status: int,
        headers: dict[str, str],
        close: Callable[[], Awaitable[None]],
        on_error: Callable[[Exception], ProxyError] | None = None,
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, task))
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not self.outcome.client_disconnected or task.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
            await self.close()
            if self.on_done is not None:
                self.on_done(self.outcome)

    async def _watch_disconnect(self, receive: Receive, task: asyncio.Task[None]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.outcome.completed:
            self.outcome.client_disconnected = True
            task.cancel()

    async def _relay(self, send: Send) -> None:
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
                if self.on_error is None:
                    raise
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

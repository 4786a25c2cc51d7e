"""How `memproxy serve` runs uvicorn: its settings, and an HTTP protocol that bounds what a
client may cost before any key is checked.

uvicorn's httptools protocol (the one `uvicorn[standard]` picks) keeps every header byte a
client sends (three 150 MB headers grew the process by 440 MB) and waits for a request's
head and body as long as the client trickles them. `BoundedHttpTools` adds three bounds:
the head's size (431), the time the head may take (408; from the connection's start, or
from a request's first byte on a kept-alive connection) and the time the body may idle
between bytes while the app waits for it (408, or a closed connection once the reply has
started). Each costs a timer per request, never work per byte.
"""

from __future__ import annotations

import asyncio
import os
from asyncio import TimerHandle
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from config import Settings
from memory import mallopt
from proxy.http.errors import ProxyError


class RequestTimeout(ProxyError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class HeadersTooLarge(ProxyError):
    status, type, code = 431, "invalid_request_error", "request_header_fields_too_large"


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head and bounded read times."""

    max_head_bytes = 64 * 1024
    head_timeout = 10.0
    body_timeout = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._timer: TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.head_timeout, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        in_head = self._in_head
        super().data_received(data)
        # Counted per read, not per header: a single header that never ends is what grew.
        if in_head and self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(HeadersTooLarge(
                    f"request headers are larger than the {self.max_head_bytes}-byte limit"
                ))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        if self._timer is None:  # a kept-alive connection's next request
            self._arm(self.head_timeout, self._head_too_slow)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.body_timeout, self._body_too_slow)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm(self.body_timeout, self._body_too_slow)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float, then: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_too_slow(self) -> None:
        self._timer = None
        self._refuse(RequestTimeout(
            f"the request headers did not arrive within {self.head_timeout:g} s"
        ))

    def _body_too_slow(self) -> None:
        self._timer = None
        if self.flow.read_paused:  # the app has not read what arrived: not the client's wait
            self._arm(self.body_timeout, self._body_too_slow)
            return
        self._refuse(RequestTimeout(
            f"the request body sent nothing for {self.body_timeout:g} s"
        ), in_head=False)

    def _refuse(self, error: ProxyError, *, in_head: bool = True) -> None:
        """Answer `error` when no reply to this request has started, then close."""
        if self.transport.is_closing():
            return
        cycle = self.cycle  # in a head: the previous request's, if any
        if cycle is None or (cycle.response_complete if in_head else not cycle.response_started):
            body = orjson.dumps(error.envelope())
            self.transport.write(b"".join([
                STATUS_LINE[error.status], b"content-type: application/json\r\n",
                b"content-length: ", str(len(body)).encode(), b"\r\n",
                b"connection: close\r\n\r\n", body,
            ]))
        self.transport.close()


def uvicorn_config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    """uvicorn's config for `app`: the bounded protocol, no access log or server header,
    and forwarding headers trusted only from MEMPROXY_TRUSTED_PROXIES (uvicorn trusts
    127.0.0.1 by default: every client of a local proxy could name itself; docs/security.md)."""
    defaults: dict[str, Any] = {
        "host": settings.host, "port": settings.port, "log_level": settings.log_level,
        "access_log": False, "server_header": False,
        "proxy_headers": settings.trusted_proxies is not None,
        "forwarded_allow_ips": settings.trusted_proxies,
    }
    # The protocol class with this server's bounds.
    bounded = type("BoundedHttpTools", (BoundedHttpTools,), {
        "max_head_bytes": settings.max_header_bytes,
        "head_timeout": settings.header_timeout_seconds,
        "body_timeout": settings.body_timeout_seconds,
    })
    return uvicorn.Config(app, http=bounded, **{**defaults, **options})


# glibc's mallopt parameter for the number of malloc arenas (malloc.h).
_M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def cap_malloc_arenas() -> bool:
    """Cap glibc's malloc arenas at MALLOC_ARENAS (unless MALLOC_ARENA_MAX says otherwise).

    glibc gives each thread that allocates its own arena, up to 8 per core, and an arena
    keeps what it once held: the index jobs' embedding threads (memory/index/embeddings.py)
    each left one behind. scripts/soak.py --quick measured the proxy's growth after warm-up
    at +43 to +57 MB with the default and +23 to +30 MB with two arenas. Called before any
    thread starts; False where there is no glibc (the cap is then the platform's own).
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False  # glibc read the operator's own choice at start
    return mallopt(_M_ARENA_MAX, MALLOC_ARENAS)

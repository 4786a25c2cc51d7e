"""Forwarding to upstreams: pick a route for a model, relay bytes with aiohttp.

aiohttp rather than httpx: measured under load, httpx's connection pool bookkeeping cost
2.5-4 ms CPU per request, aiohttp's client under 1 ms (scripts/bench_overhead.py). The
client keeps no cookies, so one user's upstream cookies can never reach another user.

OpenAI-compatible upstreams get the request body as sent and their response bytes come
back untouched. Providers that are not OpenAI-compatible go through litellm
(`proxy.upstream.litellm_transport`), which is only imported when a route needs it.

Retries (`upstream_retries`, off by default) happen only while no byte has gone to the
client: a failed connection, or a 429/502/503/504 status. A response that started is
never sent twice, whether streamed or not.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import math
import random
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias
from urllib.parse import urlsplit

import aiohttp

from config import Route, Settings
from proxy.http.errors import (
    NotFound,
    ProxyError,
    UpstreamConnectTimeout,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.http.logs import get_logger

# RFC 9110 section 7.6.1 hop-by-hop headers, plus the ones httpx or the server recompute.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
NOT_RELAYED = HOP_BY_HOP | {"date", "timing-allow-origin"}
# CORS answers (Fetch standard): an upstream that sends them (vLLM and LiteLLM do) would let
# any web page read what memproxy relays on the operator's key; memproxy sends none.
CORS_PREFIX = "access-control-"
# W3C Trace Context (https://www.w3.org/TR/trace-context/), swapped for ours while tracing.
TRACE_CONTEXT_HEADERS = frozenset({"traceparent", "tracestate"})
# Credentials the client sent to memproxy itself when proxy keys are on.
PROXY_AUTH_HEADERS = frozenset({"authorization", "api-key", "x-api-key"})
MAX_ERROR_BODY = 1 << 20
RETRY_STATUSES = frozenset({429, 502, 503, 504})
RETRY_BASE_DELAY = 0.25  # seconds before the first retry; doubles each time
RETRY_MAX_DELAY = 4.0  # a longer Retry-After goes back to the client instead of waiting
# A gateway's "the upstream is down" statuses: for memory's background calls (learning,
# embeddings) an outage, like a refused connection (memory/outages.py).
OUTAGE_STATUSES = frozenset({502, 503, 504})

log = get_logger("upstream")


@dataclass(frozen=True)
class Target:
    """Where one request goes and with which credentials."""

    base_url: str
    api_key: str | None
    provider: str | None = None  # set: translate through litellm
    key_header: str = "authorization"  # "x-api-key": how Anthropic's API takes the key
    context_window: int | None = None  # the route's override of litellm's figure (tokens)
    name: str = "default"  # the route's `match`, or the setting it came from: for error texts

    @property
    def via_litellm(self) -> bool:
        """Whether this target speaks a non-OpenAI protocol."""
        return self.provider is not None


# The response headers the routes read: an aiohttp multidict (its `items()` gives a repeated
# header each time), or a plain dict with lower-case names for replies made in-process.
UpstreamHeaders: TypeAlias = Mapping[str, str]


class UpstreamReply(Protocol):
    """What a transport returns: a status, headers and a body still to read. The raw
    upstream (`UpstreamResponse`) and litellm (`proxy.upstream.litellm_transport.LitellmReply`) both
    have this shape, so forwarding, relaying and remembering exist once per API format."""

    status_code: int
    headers: UpstreamHeaders

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives; a failure is raised as a ProxyError or a transport error."""
        ...

    async def aclose(self) -> None:
        """Release the connection (or the provider's stream)."""
        ...


class UpstreamResponse:
    """An upstream response with its body still unread."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers: UpstreamHeaders = response.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def aclose(self) -> None:
        """Back to the pool when the body was read to the end; closed (cancelling) otherwise."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class Upstream:
    """The shared HTTP client and the routing table."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.default = Target(settings.upstream_base_url.rstrip("/"), settings.upstream_api_key)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.upstream_connect_timeout,
                                        sock_read=settings.upstream_timeout)
        reuse = aiohttp.TraceConfig()  # tells open() whether a connection was pooled
        reuse.on_connection_reuseconn.append(_on_reuse)
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=settings.upstream_max_connections, limit_per_host=0),
            timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            # Send only what the client sent: no invented Accept, encodings or content type.
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trace_configs=[reuse],
        )

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self.client.close()

    def target_for(self, model: str | None) -> Target:
        """The route serving `model` (exact names first, then the longest prefix)."""
        if model:
            for route in self.settings.routes:
                if route.matches(model):
                    return _target(route, self.default)
        return self.default

    async def open(
        self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | AsyncIterator[bytes]
    ) -> UpstreamResponse:
        """Send a request and return the response with its body still unread.

        A pooled connection the upstream closed while it sat idle (servers close idle
        keep-alive connections after a few seconds: uvicorn after 5) fails as soon as it is
        written to. Such a request is sent once more on a new connection, like urllib3 and
        httpcore do; aiohttp does it only for idempotent methods, and chat completions are
        POSTs. Measured in the soak before this: 34 of 20,000 requests failed with a 502.
        """
        send = functools.partial(self.client.request, method, url, headers=headers, data=content,
                                 allow_redirects=False)
        reuse = _Reuse()
        try:
            response = await send(trace_request_ctx=reuse)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not reuse.reused or isinstance(exc, aiohttp.ClientConnectorError) or not isinstance(content, bytes):
                raise map_transport_error(exc, sending=True) from None
            log.info("stale upstream connection, sending again", extra={"error": _describe(exc)})
            try:
                response = await send(trace_request_ctx=_Reuse())
            except (TimeoutError, aiohttp.ClientError) as again:
                raise map_transport_error(again, sending=True) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise map_transport_error(exc, sending=True) from None
        return UpstreamResponse(response)

    async def open_ok(
        self, method: str, url: str, headers: list[tuple[str, str]], content: bytes, *, retries: int
    ) -> UpstreamResponse:
        """Send a request and return its successful response, retrying up to `retries` times
        what failed before any response byte was read (the body must be bytes to resend)."""
        for attempt in range(retries + 1):
            try:
                response = await self.open(method, url, headers, content)
                await raise_for_status(response, url)
                return response
            except ProxyError as exc:
                delay = retry_delay(exc, attempt) if attempt < retries else None
                if delay is None:
                    raise
                log.warning("upstream retry", extra={
                    "attempt": attempt + 1, "error": exc.code, "status": exc.status,
                    "delay_s": round(delay, 3),
                })
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # the last attempt returns or raises


class _Reuse:
    """Set by aiohttp's tracing when a request goes out on a pooled connection."""

    reused = False


async def _on_reuse(session: Any, context: Any, params: Any) -> None:
    if isinstance(context.trace_request_ctx, _Reuse):
        context.trace_request_ctx.reused = True


def is_upstream_outage(exc: ProxyError) -> bool:
    """A connection that failed or timed out, or a gateway saying the upstream is down."""
    if isinstance(exc, UpstreamStatus):
        return exc.status in OUTAGE_STATUSES
    return isinstance(exc, (UpstreamUnreachable, UpstreamTimeout))


def retry_delay(exc: ProxyError, attempt: int) -> float | None:
    """Seconds before retry number `attempt + 1`, or None when `exc` must not be retried.

    Retried: connections that failed (nothing was answered), and 429/502/503/504. A
    Retry-After (RFC 9110 section 10.2.3) or OpenAI's retry-after-ms is honoured up to
    RETRY_MAX_DELAY; a longer one is the client's decision, so the error goes back.
    """
    if isinstance(exc, UpstreamStatus):
        if exc.status not in RETRY_STATUSES:
            return None
        asked = retry_after(exc.headers)
        if asked is not None:
            return asked if asked <= RETRY_MAX_DELAY else None
    elif not isinstance(exc, UpstreamUnreachable | UpstreamConnectTimeout):
        return None  # a read timeout: the upstream may still be working on the request
    backoff = min(RETRY_MAX_DELAY, RETRY_BASE_DELAY * 2.0**attempt)
    return backoff * random.uniform(0.5, 1.0)  # jitter, so retrying clients spread out


def retry_after(headers: dict[str, str]) -> float | None:
    """The wait a response asks for, in seconds: retry-after-ms, then Retry-After."""
    lower = {name.lower(): value.strip() for name, value in headers.items()}
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            seconds = float(lower[name]) * scale
        except (KeyError, ValueError):
            continue
        if math.isfinite(seconds):
            return max(0.0, seconds)
    value = lower.get("retry-after")
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def raise_for_status(response: UpstreamReply, url: str | None = None) -> None:
    """Turn an upstream error status into UpstreamStatus, keeping its body; `url`, what
    was asked, lets a 404 say what is likely wrong with the base URL."""
    if response.status_code < 400:
        return
    body = await read_body(response, limit=MAX_ERROR_BODY)
    hint = version_hint(url) if url is not None and response.status_code == 404 else ""
    raise UpstreamStatus(response.status_code, body, relay_headers(response.headers.items()),
                         hint=hint)


def version_hint(url: str) -> str:
    """For a 404: a base URL without its API version (…:11434 for …:11434/v1) is the
    usual cause, and the upstream's own 404 never says so (docs/api-formats.md)."""
    path = urlsplit(url).path
    if re.search(r"/v\d", path):
        return ""
    return (f"memproxy asked {path}: an OpenAI-compatible upstream's base URL usually ends"
            " with its version, such as /v1 (MEMPROXY_UPSTREAM_BASE_URL, or the route's"
            " base_url)")


async def read_body(response: UpstreamReply, *, limit: int | None = None) -> bytes:
    """Read a whole response body (up to `limit` bytes), then release the response; a
    transport failure is raised as our error."""
    try:
        parts = []
        size = 0
        async for part in response.aiter_raw():
            parts.append(part)
            size += len(part)
            if limit is not None and size >= limit:
                break
        return b"".join(parts)
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise map_transport_error(exc) from None
    finally:
        await response.aclose()


def forward_headers(
    incoming: Iterable[tuple[str, str]], target: Target, *, strip_auth: bool, identity_encoding: bool,
    trace: Mapping[str, str] | None = None,
) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop and memproxy's own, with the target's key.

    `trace`: while tracing, the headers the configured propagator writes for memproxy's
    CLIENT span, which replace the client's (its traceparent names the client's span).
    """
    out = []
    for name, value in incoming:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower.startswith("x-memory"):
            continue
        if trace is not None and (lower in TRACE_CONTEXT_HEADERS or lower in trace):
            continue
        if lower in PROXY_AUTH_HEADERS and (strip_auth or target.api_key):
            continue
        if identity_encoding and lower == "accept-encoding":
            continue
        out.append((name, value))
    if target.api_key and target.key_header == "x-api-key":
        out.append(("x-api-key", target.api_key))
    elif target.api_key:
        out.append(("authorization", f"Bearer {target.api_key}"))
    if identity_encoding:
        # Chat replies are read by memproxy (to remember them), so ask for plain bytes.
        out.append(("accept-encoding", "identity"))
    if trace is not None:
        out.extend(trace.items())
    return out


def relay_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The upstream's response headers that go back to the client: not `Date` (uvicorn
    writes its own, and a response must not carry two), nor CORS (docs/security.md)."""
    return {name: value for name, value in headers
            if (lower := name.lower()) not in NOT_RELAYED and not lower.startswith(CORS_PREFIX)}


def url_for(target: Target, path: str, query: str = "") -> str:
    """The upstream URL for a `/v1/...` path (the base URL already ends in its version);
    404 for a path that could leave the base path (`contained_path`)."""
    path = contained_path(path)
    suffix = path[3:] if path.startswith("/v1/") else path
    return f"{target.base_url}{suffix}" + (f"?{query}" if query else "")


# A backslash, a control character, or a dot segment (`.` or `..`, with `;params` or not);
# every segment follows a slash, since the path starts with /v1/.
_UNSAFE_PATH = re.compile(r"[\\\x00-\x1f\x7f]|/\.\.?(?:[;/]|$)")


def contained_path(path: str) -> str:
    """`path` when it starts with /v1/ and no reading of it leaves that prefix, else a 404.

    The client's path goes under the upstream's base path with the upstream key, and the
    HTTP client, the upstream or a proxy in front of it resolve dot segments (RFC 3986
    5.2.4), some after decoding `%2e%2e` or `%2f` once more, some taking a backslash for a
    slash or `..;` for `..`. So every reading of the path (decoded once, twice, three
    times) must be free of dot segments, backslashes and control characters; a path
    that passes goes as sent.
    """
    reading = path
    for _ in range(4):
        if not reading.startswith("/v1/") or _UNSAFE_PATH.search(reading):
            break
        if "%" not in reading:
            return path  # nothing left to decode
        decoded = urllib.parse.unquote(reading)
        if decoded == reading:
            return path
        reading = decoded
    raise NotFound(f"Invalid URL: {path[:200]!r} is not a path under /v1/ (dot segments,"
                   " backslashes and their percent-encodings are refused)", code="invalid_path")


def map_transport_error(exc: Exception, *, sending: bool = False) -> ProxyError:
    """A transport failure as our error (ours pass through as they are): while `sending`
    the request, or during a body read."""
    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectTimeout(f"upstream timed out connecting: {_describe(exc)}")
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"upstream timed out: {_describe(exc)}")
    failed = "unreachable" if sending else "failed mid-response"
    return UpstreamUnreachable(f"upstream {failed}: {_describe(exc)}")


def anthropic_target(base_url: str, api_key: str | None) -> Target:
    """An Anthropic-compatible upstream: its base URL (with or without /v1) and key."""
    base = base_url.rstrip("/").removesuffix("/v1")
    return Target(f"{base}/v1", api_key, key_header="x-api-key", name="anthropic_base_url")


def _target(route: Route, default: Target) -> Target:
    # litellm knows each provider's own endpoint; only an explicit base_url overrides it.
    base_url = route.base_url or ("" if route.provider is not None else default.base_url)
    # A route's own key only: the default key must never leak to another host.
    return Target(base_url.rstrip("/"), route.api_key, route.provider,
                  context_window=route.context_window, name=route.match)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


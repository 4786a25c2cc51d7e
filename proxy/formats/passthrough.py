"""Every other /v1/* path: method, query, headers and body relayed untouched, both ways.

The two that spend tokens, /v1/embeddings and /v1/completions, are metered
(proxy/formats/metered.py): their body is read whole, their reply read on its way for its
`usage` (docs/usage.md), so a key's quota counts them too; for those memproxy asks the
upstream for plain bytes, as the chat routes do. A key with a quota may not write to a path
whose cost memproxy cannot see (proxy/access/quota.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from config import ApiKey
from memory import off_loop
from proxy.access.identity import DEFAULT_USER, authenticate, proxy_key_sent
from proxy.access.limits import limit_keys
from proxy.access.ownership import check_upstream_path
from proxy.access.quota import METERED_PATHS, refuse_unmetered_path
from proxy.access.usage import Tally, count_usage
from proxy.formats.metered import MeteredBody, MeteredReply
from proxy.http.body import read_body
from proxy.http.errors import PayloadTooLarge, ProxyError
from proxy.http.relay import RelayResponse
from proxy.http.tracing import upstream_headers
from proxy.state import AppState
from proxy.upstream.client import (
    Target,
    forward_headers,
    map_transport_error,
    raise_for_status,
    relay_headers,
    url_for,
)

ROUTE = "passthrough"
# POST paths whose replies carry the tokens they spent (OpenAI's `usage`).
COUNTED = METERED_PATHS


async def passthrough(request: Request) -> Response | RelayResponse:
    """Forward a request to the default upstream and stream its response back."""
    state: AppState = request.app.state.memproxy
    started = time.perf_counter()
    status = 500
    response: Response | RelayResponse | None = None
    tally = Tally()
    try:
        response = await relay(request, state, state.upstream.default, tally)
        status = response.status_code if isinstance(response, Response) else response.status
        return response
    except ProxyError as exc:
        status = exc.status
        if exc.status >= 500:
            state.metrics.upstream_errors.labels(exc.code or "error").inc()
        raise
    finally:
        state.metrics.observe(ROUTE, status, time.perf_counter() - started)
        if state.usage is not None and (  # requests and errors, and COUNTED paths' tokens
                settling := count_usage(state.usage, request, tally, "", response, status)):
            await settling


async def relay(
    request: Request, state: AppState, target: Target, tally: Tally | None = None,
) -> Response | RelayResponse:
    """Forward `request` to `target` (same path, query and body) and stream the reply back;
    with `tally`, the tokens a COUNTED path's reply says it spent go in it."""
    settings = state.settings
    key = await authenticate(request.headers, settings, state.keys)
    request.state.usage_key = key
    if key is not None and key.token_quota is not None and state.usage is not None:
        await state.usage.check_quota(key)  # a spent key reaches no upstream path
    await check_upstream_path(request, key, state.memory, settings,
                              shared=target.api_key is not None)
    refuse_unmetered_path(key, request.method, request.url.path)
    if state.limits.applies(key):
        # Only a request without any key counts against its user (the body is not parsed here).
        user_id = request.headers.get("x-memory-user-id") or DEFAULT_USER
        await state.limits.take(key, limit_keys(key, request, user_id, settings), stream=False)
    # Metered only where usage is counted (the memory database): else streamed through.
    counted = tally is not None and state.usage is not None and request.method == "POST" \
        and request.url.path in COUNTED
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise PayloadTooLarge(f"request body is larger than the {settings.max_body_bytes}-byte limit")
    sent = await _metered(request, state, key) if counted else None
    headers = forward_headers(
        request.headers.items(), target, strip_auth=proxy_key_sent(request.headers, settings),
        identity_encoding=counted,
        # While tracing, the upstream continues memproxy's SERVER span, not the client's.
        trace=upstream_headers() if state.tracing is not None else None,
    )
    has_body = request.method not in ("GET", "HEAD", "DELETE", "OPTIONS") or bool(declared)
    too_large: list[PayloadTooLarge] = []
    content: bytes | AsyncIterator[bytes] = b""
    if sent is not None:
        content = sent.payload
        headers.append(("content-length", str(len(content))))
    elif has_body:
        content = _limited(request, settings.max_body_bytes, too_large)
        if declared.isdigit():
            headers.append(("content-length", declared))  # streamed through, so say how long
    # The path as sent (still percent-encoded), checked by url_for: decoded, `%2e%2e` would
    # already be `..` and `%3f` a query.
    raw_path = request.scope.get("raw_path")
    path = raw_path.decode("latin-1") if isinstance(raw_path, bytes) else request.url.path
    url = url_for(target, path, request.url.query)
    try:
        upstream = await state.upstream.open(request.method, url, headers, content)
    except ProxyError:
        if too_large:  # the upload outgrew the limit on its way: 413, not a failed upstream
            raise too_large[0] from None
        raise
    await raise_for_status(upstream, url)
    body, on_done = upstream.aiter_raw(), None
    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    if sent is not None and tally is not None:
        metered = MeteredReply(sent, tally, sse=sse)
        body, on_done = metered.relay(body), metered.done
    return RelayResponse(
        body, status=upstream.status_code,
        headers=relay_headers(upstream.headers.items()), close=upstream.aclose,
        on_error=map_transport_error, on_done=on_done, sse=sse,
    )


async def _metered(request: Request, state: AppState, key: ApiKey | None) -> MeteredBody:
    """A counted request's body, read whole; a quota key's request reserves its estimate
    (settled by count_usage when it ends)."""
    raw = await read_body(request, state.settings.max_body_bytes)
    sent = MeteredBody.read(request.url.path, raw, ask_usage=state.usage is not None
                            and state.settings.usage_stream_options)
    if key is not None and key.token_quota is not None and state.usage is not None:
        request.state.usage_hold = await state.usage.reserve(
            key, await off_loop(len(raw), sent.estimate))
    return sent


async def _limited(
    request: Request, limit: int, too_large: list[PayloadTooLarge]
) -> AsyncIterator[bytes]:
    """The body as it arrives; past `limit` it stops, noting why in `too_large` (the HTTP
    client that reads this iterator reports the failure as its own connection error)."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_large.append(PayloadTooLarge(f"request body is larger than the {limit}-byte limit"))
            raise too_large[-1]
        yield chunk

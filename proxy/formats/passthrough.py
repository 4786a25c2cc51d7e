"""Every other /v1/* path: method, query, headers and body relayed untouched, both ways.

The replies of the two that spend tokens, /v1/embeddings and /v1/completions, are read on
their way for their `usage` (docs/usage.md): a key's quota counts them too. For those,
memproxy asks the upstream for plain bytes, as the chat routes do."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from proxy.access.identity import DEFAULT_USER, authenticate, proxy_key_sent
from proxy.access.limits import limit_keys
from proxy.access.ownership import check_response_path
from proxy.access.usage import Tally, count_usage
from proxy.formats.usage import ReplyUsage
from proxy.http.errors import PayloadTooLarge, ProxyError
from proxy.http.relay import RelayResponse, StreamOutcome
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
# POST paths whose JSON replies carry the tokens they spent (OpenAI's `usage`).
COUNTED = frozenset({"/v1/embeddings", "/v1/completions"})


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
        if state.usage is not None:  # requests and errors, and the tokens of COUNTED paths
            count_usage(state.usage, request, tally, "", response, status)


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
    await check_response_path(request, key, state.memory)
    if state.limits.applies(key):
        # Only a request without any key counts against its user (the body is not parsed here).
        user_id = request.headers.get("x-memory-user-id") or DEFAULT_USER
        state.limits.admit(*limit_keys(key, request, user_id, settings), stream=False,
                           rate=key.rate_limit if key is not None else None)
    counted = tally is not None and request.method == "POST" and request.url.path in COUNTED
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise PayloadTooLarge(f"request body is larger than the {settings.max_body_bytes}-byte limit")
    headers = forward_headers(
        request.headers.items(), target, strip_auth=proxy_key_sent(request.headers, settings),
        identity_encoding=counted,
        # While tracing, the upstream continues memproxy's SERVER span, not the client's.
        trace=state.tracing.current_headers() if state.tracing is not None else None,
    )
    if declared.isdigit():
        headers.append(("content-length", declared))  # streamed through, so say how long
    has_body = request.method not in ("GET", "HEAD", "DELETE", "OPTIONS") or bool(declared)
    too_large: list[PayloadTooLarge] = []
    content = _limited(request, settings.max_body_bytes, too_large) if has_body else b""
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
    content_type = upstream.headers.get("content-type", "")
    if counted and tally is not None and content_type.startswith("application/json") \
            and upstream.headers.get("content-encoding", "identity") == "identity":
        reader = ReplyUsage()
        body = _read_while_relayed(body, reader)
        on_done = partial(_count_reply, reader, tally)
    return RelayResponse(
        body, status=upstream.status_code,
        headers=relay_headers(upstream.headers.multi_items()), close=upstream.aclose,
        on_error=map_transport_error, on_done=on_done,
        sse=content_type.startswith("text/event-stream"),
    )


async def _read_while_relayed(body: AsyncIterator[bytes], reader: ReplyUsage) -> AsyncIterator[bytes]:
    async for chunk in body:
        reader.feed(chunk)
        yield chunk


def _count_reply(reader: ReplyUsage, tally: Tally, outcome: StreamOutcome) -> None:
    """A whole reply's tokens (one cut short holds no usage to read)."""
    if outcome.completed and (seen := reader.seen()) is not None:
        tally.input_tokens = seen.input_tokens or 0
        tally.output_tokens = seen.output_tokens or 0


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

"""Every other /v1/* path: method, query, headers and body relayed untouched, both ways."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import PayloadTooLarge, ProxyError
from proxy.identity import authenticate
from proxy.relay import RelayResponse
from proxy.state import AppState
from proxy.upstream import (
    forward_headers,
    map_transport_error,
    raise_for_status,
    relay_headers,
    url_for,
)

ROUTE = "passthrough"


async def passthrough(request: Request) -> Response | RelayResponse:
    """Forward a request to the default upstream and stream its response back."""
    state: AppState = request.app.state.memproxy
    started = time.perf_counter()
    status = 500
    try:
        response = await _forward(request, state)
        status = response.status_code if isinstance(response, Response) else response.status
        return response
    except ProxyError as exc:
        status = exc.status
        if exc.status >= 500:
            state.metrics.upstream_errors.labels(exc.code or "error").inc()
        raise
    finally:
        state.metrics.observe(ROUTE, status, time.perf_counter() - started)


async def _forward(request: Request, state: AppState) -> Response | RelayResponse:
    settings = state.settings
    authenticate(request.headers, settings.api_keys)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise PayloadTooLarge(f"request body is larger than the {settings.max_body_bytes}-byte limit")
    target = state.upstream.default
    headers = forward_headers(
        request.headers.items(), target, strip_auth=bool(settings.api_keys), identity_encoding=False
    )
    if declared.isdigit():
        headers.append(("content-length", declared))  # streamed through, so say how long
    has_body = request.method not in ("GET", "HEAD", "DELETE", "OPTIONS") or bool(declared)
    content = _limited(request, settings.max_body_bytes) if has_body else b""
    upstream = await state.upstream.open(
        request.method, url_for(target, request.url.path, request.url.query), headers, content
    )
    await raise_for_status(upstream)
    return RelayResponse(
        upstream.aiter_raw(), status=upstream.status_code,
        headers=relay_headers(upstream.headers.multi_items()), close=upstream.aclose,
        on_error=map_transport_error,
        sse=upstream.headers.get("content-type", "").startswith("text/event-stream"),
    )


async def _limited(request: Request, limit: int) -> AsyncIterator[bytes]:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
        yield chunk

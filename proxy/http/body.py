"""Reading request bodies within the configured size limit."""

from __future__ import annotations

from starlette.requests import Request

from proxy.http.errors import InvalidRequest, PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it grows past `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("Content-Length must be a number", param="Content-Length")
        if int(declared) > limit:
            raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
    parts = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
        parts.append(chunk)
    return b"".join(parts)

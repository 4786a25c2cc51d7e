"""memproxy's errors, each carrying what OpenAI's error envelope needs.

    ProxyError                       status  type
    ├── InvalidRequest                  400  invalid_request_error
    │   ├── InvalidHeader               400  invalid_request_error (param = the header)
    │   └── HostNotAllowed              400  invalid_request_error (param = Host)
    ├── AuthenticationFailed            401  authentication_error
    ├── PermissionDenied                403  permission_error
    │   └── OriginRefused               403  permission_error (a web page of another site)
    ├── NotFound                        404  invalid_request_error
    ├── MethodNotAllowed                405  invalid_request_error
    ├── Conflict                        409  invalid_request_error
    ├── PayloadTooLarge                 413  invalid_request_error
    ├── UnsupportedMediaType            415  invalid_request_error (param = Content-Type)
    ├── RateLimited                     429  rate_limit_error
    ├── MemoryUnavailable               503  api_error
    ├── ShuttingDown                    503  api_error (a stream the shutdown cut)
    └── UpstreamError
        ├── UpstreamUnreachable         502  api_error
        ├── UpstreamTimeout             504  api_error
        │   └── UpstreamConnectTimeout  504  api_error (nothing was sent: safe to retry)
        └── UpstreamStatus     (upstream's)  (the upstream's own body is relayed)

Rendered as `{"error": {"message", "type", "param", "code"}}`, the shape the official
SDKs parse, so a client gets `openai.BadRequestError`, `openai.AuthenticationError`, ...
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from proxy.http.sse import encode, json_object


class ProxyError(Exception):
    """Base of every error memproxy renders itself."""

    status = 500
    type = "api_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        """OpenAI's error envelope for this error."""
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param, "code": self.code
            }
        }

    def to_response(self) -> Response:
        """This error as an HTTP response."""
        return error_response(self.status, self.envelope(), self.headers)


class InvalidRequest(ProxyError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class InvalidHeader(InvalidRequest):
    code = "invalid_header"

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message, param=header)


class HostNotAllowed(InvalidRequest):
    """A Host header that is none of this server's names (DNS rebinding; proxy/access/edge.py)."""

    code = "host_not_allowed"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="Host")


class AuthenticationFailed(ProxyError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class PermissionDenied(ProxyError):
    status, type, code = 403, "permission_error", "permission_denied"


class OriginRefused(PermissionDenied):
    """A write sent by a web page of another origin (proxy/access/edge.py)."""

    code = "cross_origin_request"


class NotFound(ProxyError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(ProxyError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class Conflict(ProxyError):
    status, type, code = 409, "invalid_request_error", "conflict"


class MemoryUnavailable(ProxyError):
    status, type, code = 503, "api_error", "memory_unavailable"


class ShuttingDown(ProxyError):
    """memproxy is shutting down: sent as the last event of a stream it had to cut."""

    status, type, code = 503, "api_error", "server_shutting_down"


class PayloadTooLarge(ProxyError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class UnsupportedMediaType(ProxyError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="Content-Type")


class RateLimited(ProxyError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class UpstreamError(ProxyError):
    status, type, code = 502, "api_error", "upstream_error"


class UpstreamUnreachable(UpstreamError):
    status, code = 502, "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    status, code = 504, "upstream_timeout"


class UpstreamConnectTimeout(UpstreamTimeout):
    """The connection was never made, so the request was never sent."""


class UpstreamStatus(UpstreamError):
    """The upstream answered with an error status; its body goes back as it was."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str], *, hint: str = "") -> None:
        super().__init__(f"upstream returned {status}", code="upstream_status")
        self.status = status
        self.body = body
        self.headers = headers
        self.hint = hint  # memproxy's own guess at the cause, added to the upstream's message

    def to_response(self) -> Response:
        """The upstream's own error body, in OpenAI's envelope when it was not already."""
        parsed = json_object(self.body)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "content-type"}
        if parsed is not None and isinstance(parsed.get("error"), dict):
            if not self.hint or not isinstance(parsed["error"].get("message"), str):
                return Response(self.body, self.status, self.headers, media_type="application/json")
            parsed["error"]["message"] += f" ({self.hint})"
            return error_response(self.status, parsed, headers)
        text = self.body.decode("utf-8", "replace").strip()[:2000] or self.message
        if self.hint:
            text += f" ({self.hint})"
        envelope = {"error": {"message": text, "type": _STATUS_TYPES.get(self.status, "api_error"),
                              "param": None, "code": "upstream_status"}}
        return error_response(self.status, envelope, headers)


# The envelope's `type` of an upstream's error status that came without OpenAI's envelope.
_STATUS_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 429: "rate_limit_error",
}


def error_response(status: int, envelope: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    """A JSON response holding an error envelope."""
    return Response(orjson.dumps(envelope), status, headers, media_type="application/json")


def sse_error_event(error: ProxyError) -> bytes:
    """One SSE `error` event: how a stream that already started reports a failure."""
    return encode(orjson.dumps(error.envelope()), "error")


async def handle_proxy_error(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for ProxyError."""
    assert isinstance(exc, ProxyError)
    return exc.to_response()


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Render Starlette's own HTTPExceptions (404 routes, 405 methods) in OpenAI's envelope."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or "error"
    error: ProxyError
    if status == 404:
        error = NotFound(f"{request.method} {request.url.path} is not a memproxy endpoint")
    elif status == 405:
        # RFC 9110: a 405 names the methods the resource does allow.
        error = MethodNotAllowed(
            f"{request.method} is not allowed on {request.url.path}",
            headers=dict(getattr(exc, "headers", None) or {}),
        )
    else:
        error = ProxyError(str(detail))
        error.status = status
    return error.to_response()


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Last resort: a bug in memproxy is still an OpenAI-shaped 500."""
    return ProxyError("internal error in memproxy", code="internal_error").to_response()

"""POST /v1/chat/completions: recall, inject, forward, relay, remember."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config import Flags
from config.flags import FlagError
from memory.engine import Recalled
from memory.inject import inject
from proxy.chat_body import parse_chat_body
from proxy.errors import InvalidHeader, ProxyError
from proxy.identity import Identity, authenticate, resolve_session, resolve_user
from proxy.logs import get_logger
from proxy.memory_step import MemoryStep
from proxy.relay import RelayResponse, StreamOutcome
from proxy.requests import read_body
from proxy.sse import ChatReplyTee, reply_text
from proxy.state import AppState
from proxy.upstream import (
    Target,
    forward_headers,
    map_transport_error,
    raise_for_status,
    relay_headers,
    url_for,
)
from proxy.upstream import (
    read_body as read_upstream_body,
)

ROUTE = "chat"
log = get_logger("chat")


@dataclass
class ChatCall:
    """Everything one chat request carries through its steps."""

    body: dict[str, Any]
    raw: bytes
    identity: Identity
    flags: Flags
    target: Target
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)


async def chat_completions(request: Request) -> Response | RelayResponse:
    """Handle one chat completion, streamed or not."""
    state: AppState = request.app.state.memproxy
    started = time.perf_counter()
    status = 500
    try:
        response = await _handle(request, state)
        status = response.status_code if isinstance(response, Response) else response.status
        return response
    except ProxyError as exc:
        status = exc.status
        if exc.status >= 500:
            state.metrics.upstream_errors.labels(exc.code or "error").inc()
        raise
    finally:
        elapsed = time.perf_counter() - started
        state.metrics.observe(ROUTE, status, elapsed)
        if log.isEnabledFor(logging.INFO):
            log.info("chat", extra=_log_fields(request, status, elapsed))


def _log_fields(request: Request, status: int, elapsed: float) -> dict[str, Any]:
    """What one request's log line says: ids and figures, never keys or message text."""
    fields: dict[str, Any] = {"status": status, "ms": round(elapsed * 1000, 2)}
    call: ChatCall | None = getattr(request.state, "call", None)
    if call is not None:
        fields.update(
            request_id=call.request_id, model=call.body["model"], user_id=call.identity.user_id,
            session_id=call.identity.session_id, stream=bool(call.body.get("stream")),
        )
    return fields


async def _handle(request: Request, state: AppState) -> Response | RelayResponse:
    settings = state.settings
    raw = await read_body(request, settings.max_body_bytes)
    body = parse_chat_body(raw)
    key = authenticate(request.headers, settings.api_keys)
    try:
        flags = Flags.from_headers(request.headers, settings)
    except FlagError as exc:
        raise InvalidHeader(exc.header, str(exc)) from None
    user_id = resolve_user(request.headers, body, key)
    identity = Identity(user_id, resolve_session(request.headers, user_id, body["messages"]))
    call = ChatCall(
        body, raw, identity, flags, state.upstream.target_for(body["model"]),
        request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex[:20]}",
    )
    call.headers["X-Memory-Session-Id"] = identity.session_id
    request.state.call = call
    step = MemoryStep(state, call.identity, call.flags, call.request_id, body)
    recalled = await step.recall()
    if flags.dry_run:
        return _dry_run(call, recalled, step)
    injected = recalled is not None and bool(recalled.items)
    if injected:
        assert recalled is not None
        body = {**body, "messages": inject(body["messages"], recalled.block, flags.placement)}
    step.lend_client_key(request.headers, call.target)
    step.start_remembering()
    try:
        if call.target.via_litellm:
            from proxy.litellm_adapter import forward_litellm

            return await forward_litellm(state, call, body, step)
        # Without an injection the client's own bytes go out: nothing re-encoded, nothing lost.
        return await _forward(request, state, call, orjson.dumps(body) if injected else raw, step)
    except ProxyError:
        step.remember_reply(None, incomplete=True)
        raise


async def _forward(
    request: Request, state: AppState, call: ChatCall, payload: bytes, step: MemoryStep
) -> Response | RelayResponse:
    headers = forward_headers(
        request.headers.items(), call.target,
        strip_auth=bool(state.settings.api_keys), identity_encoding=True,
    )
    upstream = await state.upstream.open(
        "POST", url_for(call.target, "/v1/chat/completions"), headers, payload
    )
    await raise_for_status(upstream)
    # Memory headers last: by now the request's turns are usually stored, so a storage
    # failure can still be reported in X-Memory-Error.
    out_headers = {**relay_headers(upstream.headers.multi_items()), **call.headers, **step.headers()}
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return _relay_stream(state, upstream, out_headers, step)
    try:
        content = await read_upstream_body(upstream)
    finally:
        await upstream.aclose()
    # Parse the reply only when it is going to be stored.
    step.remember_reply(_reply_from_json(content) if step.writing else None, incomplete=False)
    return Response(content, upstream.status_code, out_headers)


def _relay_stream(
    state: AppState, upstream: Any, headers: dict[str, str], step: MemoryStep
) -> RelayResponse:
    tee = ChatReplyTee() if step.writing else None

    async def chunks() -> Any:
        async for chunk in upstream.aiter_raw():
            if tee is not None:
                tee.feed(chunk)
            yield chunk

    def done(outcome: StreamOutcome) -> None:
        state.metrics.inflight_streams.dec()
        if outcome.error is not None:
            state.metrics.upstream_errors.labels(outcome.error.code or "stream").inc()
        if tee is not None:
            step.remember_reply(tee.text, incomplete=not (outcome.completed and tee.finished))

    state.metrics.inflight_streams.inc()
    return RelayResponse(
        chunks(), status=upstream.status_code, headers=headers, close=upstream.aclose,
        on_error=map_transport_error, on_done=done,
    )


def _reply_from_json(content: bytes) -> str | None:
    try:
        completion = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return reply_text(completion) if isinstance(completion, dict) else None


def _dry_run(call: ChatCall, recalled: Recalled | None, step: MemoryStep) -> Response:
    payload = {
        "object": "memory.dry_run",
        "user_id": call.identity.user_id,
        "session_id": call.identity.session_id,
        "placement": call.flags.placement,
        "budget": call.flags.budget,
        **(recalled.as_dict() if recalled is not None else {"block": "", "items": [], "tokens": 0}),
        "errors": step.errors,
    }
    return Response(orjson.dumps(payload), 200, {**call.headers, **step.headers()},
                    media_type="application/json")

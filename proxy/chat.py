"""POST /v1/chat/completions: recall, inject, forward, relay, remember."""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config import Flags
from config.flags import FlagError
from memory import Recalled, inject
from proxy.chat_body import parse_chat_body
from proxy.errors import InvalidHeader, ProxyError, UpstreamError
from proxy.identity import Identity, authenticate, resolve_session, resolve_user
from proxy.limits import StreamSlot, limit_key
from proxy.logs import get_logger
from proxy.memory_step import MemoryStep
from proxy.relay import RelayResponse, StreamOutcome
from proxy.requests import read_body
from proxy.sse import ChatReplyTee, reply_text
from proxy.state import AppState
from proxy.upstream import (
    Target,
    UpstreamReply,
    forward_headers,
    map_transport_error,
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
    slot: StreamSlot | None = None  # the key's stream slot (MEMPROXY_MAX_STREAMS_PER_KEY)


async def chat_completions(request: Request) -> Response | RelayResponse:
    """Handle one chat completion, streamed or not."""
    state: AppState = request.app.state.memproxy
    started = time.perf_counter()
    status = 500
    response: Response | RelayResponse | None = None
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
        call: ChatCall | None = getattr(request.state, "call", None)
        if call is not None and call.slot is not None:
            call.slot.hand_over(response)  # held until a stream ends, else freed now
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
    # Sent back as the UTF-8 bytes it arrived in (headers go out as latin-1).
    call.headers["X-Memory-Session-Id"] = identity.session_id.encode().decode("latin-1")
    request.state.call = call
    if state.limits.enabled:  # hashing the key is wasted work when no limit is set
        call.slot = state.limits.admit(
            limit_key(key, request.headers, user_id), stream=body.get("stream") is True
        )
    step = MemoryStep(state, call.identity, call.flags, call.request_id, body)
    recalled = await step.recall()
    if flags.dry_run:
        return _dry_run(call, recalled, step)
    payload = raw  # without an injection the client's own bytes go out: nothing re-encoded
    if recalled is not None and recalled.items:
        with_memory = {**body, "messages": inject(body["messages"], recalled.block, flags.placement)}
        try:
            payload, body = orjson.dumps(with_memory), with_memory
        except TypeError as exc:  # orjson writes 254 levels of nesting but reads 1024
            step.failed("inject", exc)
    step.lend_client_key(request.headers, call.target)
    step.start_remembering()
    try:
        upstream = await _send(request, state, call, payload, body)
        return await _relay(state, call, upstream, step)
    except ProxyError:
        step.remember_reply(None, incomplete=True)
        raise


async def _send(
    request: Request, state: AppState, call: ChatCall, payload: bytes, body: dict[str, Any]
) -> UpstreamReply:
    """Open the reply: raw bytes to an OpenAI-compatible upstream, or through litellm."""
    if call.target.via_litellm:
        from proxy.litellm_adapter import open_chat

        return await open_chat(call.target, body, timeout=state.settings.upstream_timeout)
    headers = forward_headers(
        request.headers.items(), call.target,
        strip_auth=bool(state.settings.api_keys), identity_encoding=True,
    )
    return await state.upstream.open_ok(
        "POST", url_for(call.target, "/v1/chat/completions"), headers, payload,
        retries=state.settings.upstream_retries,
    )


async def _relay(
    state: AppState, call: ChatCall, upstream: UpstreamReply, step: MemoryStep
) -> Response | RelayResponse:
    """Relay the reply (streamed or whole) and remember what it said."""
    # Memory headers last, once the request's turns are stored (MemoryStep.stored).
    await step.stored()
    out_headers = {**relay_headers(upstream.headers.multi_items()), **call.headers, **step.headers()}
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return _relay_stream(state, upstream, out_headers, step)
    try:
        content = await read_upstream_body(upstream)
    finally:
        await upstream.aclose()
    completion = _completion(content) if upstream.status_code < 300 else None
    text = reply_text(completion) if completion and step.writing else None
    step.remember_reply(text, incomplete=False)
    return Response(content, upstream.status_code, out_headers)


def _relay_stream(
    state: AppState, upstream: UpstreamReply, headers: dict[str, str], step: MemoryStep
) -> RelayResponse:
    # Reading the stream costs about as much CPU as relaying it, so memproxy reads (and
    # checks) it only when it remembers the reply; otherwise the bytes go through as sent.
    tee = ChatReplyTee() if step.writing else None

    async def chunks() -> Any:
        if tee is None:
            async for chunk in upstream.aiter_raw():
                yield chunk
            return
        held = b""
        async for chunk in upstream.aiter_raw():
            # Whole events only, so a malformed one can be replaced by an error event.
            ready, held = _whole_events(held + chunk)
            if ready:
                tee.feed(ready)
                if tee.malformed:
                    if valid := _before_malformed(ready):
                        yield valid
                    raise UpstreamError("upstream sent a malformed stream event",
                                        code="upstream_invalid_response")
                yield ready
        if held:
            tee.feed(held)
            yield held

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


def _completion(content: bytes) -> dict[str, Any]:
    """A successful reply's body, which must be a JSON object (else 502, RFC 9110 15.6.3)."""
    try:
        completion = orjson.loads(content)
    except orjson.JSONDecodeError:
        completion = None
    if not isinstance(completion, dict):
        raise UpstreamError("upstream returned a body that is not a JSON object",
                            code="upstream_invalid_response")
    return completion


def _whole_events(data: bytes) -> tuple[bytes, bytes]:
    """Split SSE bytes after the last blank line: (whole events, the start of the next)."""
    if data.endswith(b"\n\n"):
        return data, b""  # the usual case: the upstream flushes whole events
    ends = [at + len(sep) for sep in (b"\n\n", b"\r\n\r\n", b"\r\r") if (at := data.rfind(sep)) != -1]
    end = max(ends, default=0)
    return data[:end], data[end:]


def _before_malformed(events: bytes) -> bytes:
    """The whole events that precede the first malformed one (a rare path: it re-reads)."""
    tee = ChatReplyTee()
    valid = b""
    for event in re.split(rb"(?:(?<=\r\n\r\n)|(?<=\n\n)|(?<=\r\r))", events):
        tee.feed(event)
        if tee.malformed:
            break
        valid += event
    return valid


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

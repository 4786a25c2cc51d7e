"""One request of any API format, end to end (docs/architecture.md, "Request flow"): parse, authenticate, identify,
recall, inject, forward, relay, remember.

The format (`proxy.formats.base.ApiFormat`) says how its body reads, where the memory block
goes and how its replies and errors look; the transport says how the bytes travel (raw to
an upstream that speaks the format, or through litellm). Everything else happens here, once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config import Flags
from config.flags import FlagError
from memory import Recalled, ReplyChain, off_loop
from proxy.access.decision import chat_flags, identify
from proxy.access.identity import (
    Identity,
    proxy_key_sent,
    resolve_org,
    resolve_session,
    resolve_user,
)
from proxy.access.limits import limit_keys
from proxy.access.ownership import previous_response_not_found, stored_elsewhere
from proxy.access.quota import KeptReply, estimate, refuse_unmetered
from proxy.access.usage import Tally, count_usage
from proxy.flow.call import Call
from proxy.flow.compaction import compact
from proxy.flow.counting import count_error, count_reply, kept_text
from proxy.flow.memory_step import MemoryStep
from proxy.flow.memory_tool.loop import MemoryTool
from proxy.formats.base import ApiFormat
from proxy.formats.chat import CHAT
from proxy.formats.usage import UsageTap, ask_stream_usage
from proxy.http.body import read_body
from proxy.http.errors import InvalidHeader, ProxyError, UpstreamError
from proxy.http.logs import get_logger
from proxy.http.relay import RelayResponse, StreamOutcome
from proxy.http.sse import ReplyTee, SSEDecoder, frames, json_object
from proxy.state import AppState
from proxy.upstream import genai_span
from proxy.upstream.client import (
    UpstreamReply,
    forward_headers,
    map_transport_error,
    relay_headers,
    url_for,
)
from proxy.upstream.client import (
    read_body as read_upstream_body,
)

# How much of a continued conversation recall reads (it is already in the model's context).
CHAIN_TURNS = 40


def endpoint(fmt: ApiFormat) -> Callable[[Request], Awaitable[Response | RelayResponse]]:
    """The route handler of one API format (`POST /v1/chat/completions`, ...)."""

    async def run(request: Request) -> Response | RelayResponse:
        return await handle(request, fmt)

    run.__name__ = f"{fmt.route}_endpoint"
    return run


async def handle(request: Request, fmt: ApiFormat) -> Response | RelayResponse:
    """Handle one request of `fmt`, streamed or not; errors in the format's envelope."""
    state: AppState = request.app.state.memproxy
    started = time.perf_counter()
    status = 500
    response: Response | RelayResponse | None = None
    try:
        response = await _handle(request, state, fmt)
        status = response.status_code if isinstance(response, Response) else response.status
        return response
    except ProxyError as exc:
        status = exc.status
        if exc.status >= 500:
            state.metrics.upstream_errors.labels(exc.code or "error").inc()
        error = fmt.error_response(exc)
        # Once identity is resolved, errors carry the session id like every chat response.
        known: Call | None = getattr(request.state, "call", None)
        if known is not None:
            error.headers.update(known.headers)
        return error
    finally:
        call: Call | None = getattr(request.state, "call", None)
        if call is not None and call.slot is not None:
            call.slot.hand_over(response)  # held until a stream ends, else freed now
        if state.usage is not None and (settling := count_usage(
                state.usage, request, call.tally if call else Tally(),
                call.identity.user_id if call else "", response, status)) is not None:
            await settling
        elapsed = time.perf_counter() - started
        state.metrics.observe(fmt.route, status, elapsed)
        log = get_logger(fmt.route)
        if log.isEnabledFor(logging.INFO):
            fields = _log_fields(call, status, elapsed)
            if state.tracing is not None:  # the line joins the request's trace
                fields.update(state.tracing.log_ids())
            log.info(fmt.route, extra=fields)


def _log_fields(call: Call | None, status: int, elapsed: float) -> dict[str, Any]:
    """What one request's log line says: ids and figures, never keys or message text."""
    fields: dict[str, Any] = {"status": status, "ms": round(elapsed * 1000, 2)}
    if call is not None:
        fields.update(
            request_id=call.request_id, model=call.body["model"], user_id=call.identity.user_id,
            session_id=call.identity.session_id, stream=bool(call.body.get("stream")),
        )
    return fields


async def _handle(request: Request, state: AppState, fmt: ApiFormat) -> Response | RelayResponse:
    settings = state.settings
    # The key first: a wrong one must not cost reading and parsing a body of up to 32 MB.
    principal = await identify(request, settings, admin_allowed=False, stored=state.keys)
    key = principal.key
    request.state.usage_key = key
    if key is not None and key.token_quota is not None and state.usage is not None:
        await state.usage.check_quota(key)  # before the body: a spent key costs nothing
    raw = await read_body(request, settings.max_body_bytes)
    parsed = fmt.parse(raw)
    body = parsed.body
    refuse_unmetered(key, fmt.route, body)
    try:
        flags = Flags.from_headers(request.headers, settings)
    except FlagError as exc:
        raise InvalidHeader(exc.header, str(exc)) from None
    user_id = resolve_user(request.headers, body, key)
    org_id = resolve_org(request.headers, key)
    # Memory the caller may not reach is off for this request (a dry run gets the refusal).
    flags, refused = chat_flags(principal, settings, flags, user_id=user_id, org_id=org_id)
    chain, chain_error = await _chain(state, flags, user_id, parsed.continues)
    session_id = resolve_session(
        request.headers, user_id, parsed.conversation,
        continued=chain.session_id if chain is not None else None,
    )
    call = Call(
        fmt, parsed, Identity(user_id, session_id, org_id), flags,
        fmt.target(state.upstream, body["model"], request.headers),
        request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex[:20]}",
    )
    # Sent back as the UTF-8 bytes it arrived in (headers go out as latin-1).
    call.headers["X-Memory-Session-Id"] = session_id.encode().decode("latin-1")
    request.state.call = call
    if state.limits.applies(key):  # hashing the key is wasted work when no limit is set
        call.slot = await state.limits.take(
            key, limit_keys(key, request, user_id, settings), stream=body.get("stream") is True,
        )
    if key is not None and key.token_quota is not None and state.usage is not None:
        # Admitted: hold its estimate of the quota until it ends (settled by count_usage).
        request.state.usage_hold = await state.usage.reserve(key, await off_loop(
            len(raw), partial(
                estimate, body, body["model"], raw_size=len(raw), route=fmt.route,
                memory_tokens=flags.budget if flags.active else 0,
            )))
    tool = MemoryTool.plan(state, call)  # X-Memory-Mode: tool; its recall is the pre-fetch
    step = MemoryStep(state, call, chain, tool.prefetch if tool is not None else call.flags)
    if chain_error is not None:
        step.failed("chain", chain_error)
    if refused is not None:
        step.failed("access", refused)
    recalled = await step.recall()
    if flags.dry_run:
        return _dry_run(call, recalled, step)
    step.lend_client_key(request.headers, call.target)
    step.check_room()  # the turns are stored once the upstream answered (_relay)
    # Without a change the client's own bytes go out: nothing re-encoded.
    payload, body = await _outgoing(call, step) or (raw, body)
    call.sent, call.sent_size = body, len(payload)  # a reply without usage counts this prompt
    if recalled is not None and recalled.items:
        call.tally.memory_tokens = recalled.tokens  # as X-Memory-Injected-Tokens says
    if tool is None and fmt is CHAT and body.get("stream") is True and state.usage is not None \
            and settings.usage_stream_options:
        payload, body, call.strip_usage = ask_stream_usage(payload, body)
    try:
        if tool is None:
            upstream = await _send(request, state, call, payload, body)
        else:
            upstream = await tool.open(partial(_send, request, state, call), body, step)
        return await _relay(call, upstream, step)
    except ProxyError:
        step.remember_reply(None, incomplete=True)
        raise


async def _outgoing(call: Call, step: MemoryStep) -> tuple[bytes, dict[str, Any]] | None:
    """The bytes and body to send when memory changes the request (compaction, the
    block); None when it goes as sent."""
    body, recalled = call.body, step.recalled
    if call.flags.compact:
        body = await compact(call, step, recalled.tokens if recalled else 0) or body
    if step.placed:
        body = call.fmt.place(body, step.placed)
    elif step.placed is None and recalled is not None and recalled.items:
        body = call.fmt.inject(body, recalled.block, call.flags.placement)
    if body is call.body:
        return None
    try:
        return orjson.dumps(body), body
    except TypeError as exc:  # orjson writes 254 levels of nesting but reads 1024
        step.failed("inject", exc)
        return None


async def _chain(
    state: AppState, flags: Flags, user_id: str, reply_id: str | None
) -> tuple[ReplyChain | None, Exception | None]:
    """The stored conversation a request continues, when it names one and memory is on;
    404 when memproxy stored that reply for another user, memory on or off for this
    request (`proxy.access.ownership`)."""
    if reply_id is None or state.memory is None:
        return None, None
    try:
        elsewhere = await stored_elsewhere(state.memory, user_id, reply_id)
        chain = None if elsewhere or not flags.active else \
            await state.memory.reply_chain(user_id, reply_id, limit=CHAIN_TURNS)
    except Exception as exc:  # memory never breaks the chat: reported in X-Memory-Error
        return None, exc
    if elsewhere:
        raise previous_response_not_found(reply_id)
    return chain, None


async def _send(
    request: Request, state: AppState, call: Call, payload: bytes, body: dict[str, Any]
) -> UpstreamReply:
    """Open the reply: raw bytes to an upstream that speaks the format, or through litellm;
    while tracing, inside the call's CLIENT span (proxy/upstream/genai_span.py)."""
    if state.tracing is None:
        return await _open(request, state, call, payload, body, None)
    return await genai_span.traced(
        state.tracing, call.target, body, api=call.fmt.route,
        messages=lambda: call.fmt.conversation(body),
        read_text=lambda reply: call.fmt.read_reply(reply).text, tee=call.fmt.tee,
        send=partial(_open, request, state, call, payload, body),
    )


async def _open(
    request: Request, state: AppState, call: Call, payload: bytes, body: dict[str, Any],
    trace: Mapping[str, str] | None,
) -> UpstreamReply:
    if call.target.via_litellm:
        return await call.fmt.open_litellm(
            call.target, body, timeout=state.settings.upstream_timeout, trace=trace
        )
    headers = forward_headers(
        request.headers.items(), call.target,
        strip_auth=proxy_key_sent(request.headers, state.settings), identity_encoding=True,
        trace=trace,
    )
    return await state.upstream.open_ok(
        "POST", url_for(call.target, call.fmt.path), headers, payload,
        retries=state.settings.upstream_retries,
    )


async def _relay(call: Call, upstream: UpstreamReply, step: MemoryStep) -> Response | RelayResponse:
    """Relay the reply (streamed or whole) and remember what it said."""
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        if upstream.status_code < 300:
            step.start_remembering()  # the stream has started: a cut keeps the user's turn
        return _relay_stream(call, upstream, await _out_headers(call, upstream, step), step)
    content = await read_upstream_body(upstream)  # and released
    if upstream.status_code >= 300:
        step.remember_reply(None, incomplete=False)  # not an answer: nothing is stored
        if step.state.usage is not None:
            count_error(call, content)
        return Response(content, upstream.status_code, await _out_headers(call, upstream, step))
    # A successful reply's body must be a JSON object (else 502, RFC 9110 15.6.3), checked
    # even when not remembered: the SDKs need it.
    if (reply_body := json_object(content)) is None:
        raise UpstreamError("upstream returned a body that is not a JSON object",
                            code="upstream_invalid_response")
    reply = call.fmt.read_reply(reply_body) if step.writing else None
    if step.state.usage is not None:  # counted only where usage is kept (the memory database)
        seen = call.fmt.read_usage(reply_body)
        count_reply(
            call, seen.input_tokens if seen else None, seen.output_tokens if seen else None,
            relayed=lambda: (reply or call.fmt.read_reply(reply_body)).text,
        )
    step.start_remembering()  # the exchange completed
    step.remember_reply(
        reply.text if reply else None, incomplete=not (reply is None or reply.complete),
        reply_id=reply.reply_id if reply else None,
    )
    headers = await _out_headers(call, upstream, step)
    if call.fmt.continuable:
        await step.reply_stored()
    return Response(content, upstream.status_code, headers)


async def _out_headers(call: Call, upstream: UpstreamReply, step: MemoryStep) -> dict[str, str]:
    """The response's headers: the upstream's, the call's, then memory's, once the
    request's turns are stored (MemoryStep.stored) so a failure to store them shows."""
    await step.stored()
    return {**relay_headers(upstream.headers.items()), **call.headers, **step.headers()}


def _relay_stream(
    call: Call, upstream: UpstreamReply, headers: dict[str, str], step: MemoryStep
) -> RelayResponse:
    # Reading the stream costs about as much CPU as relaying it, so memproxy reads (and
    # checks) it only when it remembers the reply; otherwise the bytes go through as sent,
    # but for the usage tap's byte search (proxy/formats/usage.py).
    fmt, state = call.fmt, step.state
    tee = fmt.tee() if step.writing else None
    tap = fmt.usage_tap(strip=call.strip_usage) if state.usage is not None else None
    # Counted, a stream keeps its first bytes: if its usage never comes, its text is counted.
    kept = KeptReply() if tap is not None else None
    source = kept.watch(upstream.aiter_raw()) if kept is not None else upstream.aiter_raw()
    last_sent = [b""]  # the last chunk relayed, for formats that number their events

    async def chunks() -> Any:
        if tee is None:
            async for chunk in source:
                if tap is not None and not (chunk := tap.feed(chunk)):
                    continue  # held (an event split between reads) or the usage chunk taken out
                last_sent[0] = chunk
                yield chunk
            if tap is not None and (out := tap.end()):
                yield out
            return
        # Whole events only, so a malformed one can be replaced by an error event.
        events = SSEDecoder()
        async for chunk in (source if tap is None else _tapped(source, tap)):
            if ready := events.whole(chunk):
                tee.feed(ready)
                if tee.malformed:
                    if valid := _before_malformed(fmt, ready):
                        last_sent[0] = valid
                        yield valid
                    raise UpstreamError("upstream sent a malformed stream event",
                                        code="upstream_invalid_response")
                if tee.finished and fmt.continuable:
                    # The end goes out once the reply is stored, so a request that
                    # continues from it (by its id) finds it.
                    step.remember_reply(tee.text, incomplete=False, reply_id=tee.reply_id)
                    await step.reply_stored()
                last_sent[0] = ready
                yield ready
        if held := events.end():
            tee.feed(held)
            yield held

    def done(outcome: StreamOutcome) -> None:
        state.metrics.inflight_streams.dec()
        if tap is not None and kept is not None:
            count_reply(call, tap.input_tokens, tap.output_tokens,
                        relayed=lambda: kept_text(fmt, kept, tee), scale=kept.scaled,
                        cut=not outcome.completed or outcome.error is not None)
        if outcome.error is not None:
            state.metrics.upstream_errors.labels(outcome.error.code or "stream").inc()
        if tee is not None:
            step.remember_reply(tee.text, incomplete=not (outcome.completed and tee.finished),
                                reply_id=tee.reply_id)

    state.metrics.inflight_streams.inc()
    return RelayResponse(
        chunks(), status=upstream.status_code, headers=headers, close=upstream.aclose,
        on_error=map_transport_error, on_done=done,
        error_event=lambda error: fmt.error_event(error, last_sent[0]),
    )


async def _tapped(source: AsyncIterator[bytes], tap: UsageTap) -> AsyncIterator[bytes]:
    """The upstream's stream through the usage tap."""
    async for chunk in source:
        if out := tap.feed(chunk):
            yield out
    if out := tap.end():
        yield out


def _before_malformed(fmt: ApiFormat, events: bytes) -> bytes:
    """The whole events that precede the first malformed one (a rare path: it re-reads)."""
    tee: ReplyTee = fmt.tee()
    valid = b""
    for event in frames(events):
        tee.feed(event)
        if tee.malformed:
            break
        valid += event
    return valid


def _dry_run(call: Call, recalled: Recalled | None, step: MemoryStep) -> Response:
    payload = {
        "object": "memory.dry_run",
        "user_id": call.identity.user_id,
        "session_id": call.identity.session_id,
        "placement": call.flags.placement,
        "budget": step.flags.budget,  # in tool mode the pre-fetch's
        **(recalled.as_dict(step.state.memory.redact)
           if recalled is not None and step.state.memory is not None
           else {"block": "", "items": [], "tokens": 0}),
        "errors": step.errors,
    }
    return Response(orjson.dumps(payload), 200, {**call.headers, **step.headers()},
                    media_type="application/json")

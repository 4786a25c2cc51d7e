"""The upstream call's CLIENT span, with the GenAI semantic conventions (docs/tracing.md,
https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/).

The span wraps the transport's reply, so a streamed call's span ends at its last byte and
records the time to the first chunk. What the reply said is read once at the end from
bounded buffers: a whole body, or a stream's first events (the model) and last ones (usage,
finish reasons). Message contents go on the span only when
OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true, and only through `content`.
"""

from __future__ import annotations

import functools
import time
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.http.sse import ReplyTee, SSEDecoder, event_payload, json_object
from proxy.upstream.captured_messages import captured_messages
from proxy.upstream.client import Target, UpstreamHeaders, UpstreamReply

if TYPE_CHECKING:
    from proxy.http.tracing import Span, Tracing

# litellm's provider names that the semantic conventions spell otherwise.
_PROVIDERS = {
    "gemini": "gcp.gemini", "vertex_ai": "gcp.vertex_ai", "bedrock": "aws.bedrock",
    "azure": "azure.ai.openai", "mistral": "mistral_ai", "xai": "x_ai",
    "watsonx": "ibm.watsonx.ai",
}
_HEAD_BYTES = 8192  # a stream's first events (its model)
_TAIL_CHUNKS = 16  # and its last chunks (usage, finish reasons)
_TAIL_EVENTS = 4
_REQUEST_PARAMS = (
    ("max_tokens", "gen_ai.request.max_tokens"), ("max_output_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
)
_PARAM_FIELDS = frozenset(field for field, _ in _REQUEST_PARAMS)
# Where a reply's objects carry it: the object itself, and a Responses event's `response`
# or a Messages event's `message`.
_NESTED = ("response", "message")
# The usage counts each format names, for the GenAI attributes (output in this order).
_TOKENS = (("prompt_tokens", "input_tokens"), ("input_tokens", "input_tokens"),
           ("completion_tokens", "output_tokens"), ("output_tokens", "output_tokens"))
_FINISHED = frozenset({"completed", "incomplete", "failed"})  # a Responses reply's end


def provider_name(target: Target, fallback: str) -> str:
    """`gen_ai.provider.name` of a target: litellm's provider, else what the format speaks."""
    if target.provider is None:
        return fallback
    return _PROVIDERS.get(target.provider, target.provider)


async def traced(
    tracing: Tracing, target: Target, body: Mapping[str, Any], *, api: str,
    messages: Callable[[], Sequence[Mapping[str, Any]]], read_text: Callable[[dict[str, Any]], str],
    tee: Callable[[], ReplyTee],
    send: Callable[[Mapping[str, str] | None], Awaitable[UpstreamReply]],
) -> UpstreamReply:
    """Send one upstream call (`send` gets the Trace Context headers to add, None when
    memproxy propagates none) inside its CLIENT span; the reply ends the span when it is
    closed. `api` is the client's API format (`chat`, `responses`, `messages`), whose
    protocol a route without a provider speaks."""
    provider = provider_name(target, "anthropic" if api == "messages" else "openai")
    call = start(tracing, target, body, provider=provider, messages=messages)
    try:
        reply = await send(call.headers)
    except BaseException as exc:
        call.failed(exc)
        raise
    if not call.span.is_recording():  # sampled out: the headers went, nothing to read
        call.span.end()
        return reply
    return TracedReply(call, reply, read_text=read_text, tee=tee)


def start(
    tracing: Tracing, target: Target, body: Mapping[str, Any], *, provider: str,
    operation: str = "chat", messages: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
) -> GenAICall:
    """Open the CLIENT span of one upstream call, its request attributes given at its start
    (one call into the SDK, and a sampler sees them); `messages` gives the conversation
    sent, captured only when contents are."""
    if tracing.drops_children():  # a span sampled out: only its Trace Context headers matter
        span, headers = tracing.start_client(operation)
        return GenAICall(tracing, span, headers, 0)
    model = body.get("model")
    model = model if isinstance(model, str) else ""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": provider,
        "gen_ai.system": provider,  # the name before semconv 1.37, which tools still read
        "gen_ai.request.model": model,
    }
    if not _PARAM_FIELDS.isdisjoint(body):
        for field, name in _REQUEST_PARAMS:
            value = body.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[name] = value
    if target.base_url:
        attributes.update(_server(target.base_url))
    if tracing.capture_content and messages is not None:
        attributes["gen_ai.input.messages"] = captured_messages(messages(), tracing.redact)
    started = time.time_ns()  # the span's start, which the time to the first chunk counts from
    span, headers = tracing.start_client(f"{operation} {model}".strip(), attributes, start_ns=started)
    return GenAICall(tracing, span, headers, started)


@dataclass
class GenAICall:
    """One upstream call's open span and the headers that carry it upstream."""

    tracing: Tracing
    span: Span
    headers: dict[str, str] | None
    started_ns: int

    def failed(self, exc: BaseException) -> None:
        """The call failed before a reply: end the span so."""
        self.tracing.fail(self.span, exc)

    def finished(self, reply: Mapping[str, Any]) -> None:
        """The call answered `reply`, a whole JSON body memproxy read itself (a learning
        call, embeddings): record what it said and end the span."""
        if self.span.is_recording():
            self.span.set_attributes(reply_attributes([dict(reply)]))
        self.span.end()


class TracedReply:
    """An `UpstreamReply` that keeps what its call's span needs of what passes (a whole
    body; a stream's first bytes and last chunks, and the time of its first), reads it once
    at the end, and ends the span at close."""

    def __init__(
        self, call: GenAICall, reply: UpstreamReply, *, read_text: Callable[[dict[str, Any]], str],
        tee: Callable[[], ReplyTee],
    ) -> None:
        self._call = call
        self._reply = reply
        self.status_code = reply.status_code
        self.headers: UpstreamHeaders = reply.headers
        self._stream = reply.headers.get("content-type", "").startswith("text/event-stream")
        self._first_ns = 0
        self._head: list[bytes] = []
        self._tail: deque[bytes] = deque(maxlen=_TAIL_CHUNKS)
        self._tailed = 0
        self._read_text = read_text
        self._tee = tee() if call.tracing.capture_content and self._stream else None
        self._error: BaseException | None = None
        self._ended = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The reply's bytes, as they come."""
        head, tail, tee = self._head, self._tail, self._tee
        # A whole body is kept (and read once, at the end); a stream, its first events
        # (the model) and then only its last chunks (usage, finish reasons), in C.
        room = _HEAD_BYTES if self._stream else 1 << 62
        try:
            async for chunk in self._reply.aiter_raw():
                if not self._first_ns:
                    self._first_ns = time.time_ns()
                if tee is not None:
                    tee.feed(chunk)
                if room > 0:
                    head.append(chunk)
                    room -= len(chunk)
                else:
                    tail.append(chunk)  # a bounded deque: the oldest falls out
                    self._tailed += 1
                yield chunk
        except BaseException as exc:
            self._error = exc
            raise

    async def aclose(self) -> None:
        """Close the reply and end the span."""
        try:
            await self._reply.aclose()
        finally:
            self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        span = self._call.span
        try:
            objects = self._objects()
            found = reply_attributes(objects)
            if self._first_ns and self._stream:
                found["gen_ai.response.time_to_first_chunk"] = \
                    (self._first_ns - self._call.started_ns) / 1e9
                span.add_event("gen_ai.first_chunk", timestamp=self._first_ns)
            if self._call.tracing.capture_content:
                text = self._tee.text if self._tee is not None else self._whole_text(objects)
                if text:
                    found["gen_ai.output.messages"] = captured_messages(
                        [{"role": "assistant", "content": text}], self._call.tracing.redact)
            span.set_attributes(found)
        finally:
            if self._error is not None:
                self._call.tracing.fail(span, self._error)
            elif self.status_code >= 400:
                self._call.tracing.fail(span, None, error_type=str(self.status_code))
            else:
                span.end()

    def _objects(self) -> list[dict[str, Any]]:
        if not self._stream:
            found = json_object(b"".join(self._head))
            return [found] if found is not None else []
        if self._tailed <= _TAIL_CHUNKS:  # all of it is here
            return _objects_in(b"".join(self._head) + b"".join(self._tail))
        # The middle fell out: the first object (the model), the last few (usage, reasons).
        return _objects_in(b"".join(self._head))[:1] + _objects_in(b"".join(self._tail))[-_TAIL_EVENTS:]

    def _whole_text(self, objects: list[dict[str, Any]]) -> str:
        if self._stream or not objects or self.status_code >= 300:
            return ""
        try:
            return self._read_text(objects[0])
        except Exception:  # a reply the format cannot read has no text to capture
            return ""


def reply_attributes(objects: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The GenAI response attributes in a reply's JSON objects (a whole body, or stream
    events), in any of the three API formats. JSON gives plain types, told by `type` (an
    int is not a bool there)."""
    model: str | None = None
    reply_id: str | None = None
    tokens: dict[str, int] = {}
    reasons: list[str] = []
    for found in objects:
        parts = [found]
        for key in _NESTED:
            if type(nested := found.get(key)) is dict:
                parts.append(nested)
        for part in parts:
            if model is None and type(value := part.get("model")) is str:
                model = value
            if reply_id is None and type(value := part.get("id")) is str:
                reply_id = value
            if type(usage := part.get("usage")) is dict:
                for name, ours in _TOKENS:
                    if type(count := usage.get(name)) is int:
                        tokens[ours] = count
            if type(choices := part.get("choices")) is list:  # chat
                for choice in choices:
                    if type(choice) is dict and type(reason := choice.get("finish_reason")) is str:
                        reasons.append(reason)
            if type(reason := part.get("stop_reason")) is str:  # Messages
                reasons.append(reason)
            if part.get("object") == "response" and part.get("status") in _FINISHED:  # Responses
                details = part.get("incomplete_details")
                reason = details.get("reason") if type(details) is dict else None
                reasons.append(reason if type(reason) is str else part["status"])
        if type(delta := found.get("delta")) is dict and type(reason := delta.get("stop_reason")) is str:
            reasons.append(reason)  # Messages: message_delta
    out: dict[str, Any] = {f"gen_ai.usage.{name}": value for name, value in tokens.items()}
    if model is not None:
        out["gen_ai.response.model"] = model
    if reply_id is not None:
        out["gen_ai.response.id"] = reply_id
    if reasons:
        out["gen_ai.response.finish_reasons"] = list(dict.fromkeys(reasons))
    return out


@functools.lru_cache(maxsize=64)
def _server(base_url: str) -> dict[str, str | int]:
    """`server.address` and `server.port` of an upstream (a route's, so few)."""
    address = urllib.parse.urlsplit(base_url)
    if not address.hostname:
        return {}
    return {"server.address": address.hostname,
            "server.port": address.port or (443 if address.scheme == "https" else 80)}


def _objects_in(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects the whole SSE events in `data` carry (`[DONE]` is none)."""
    return [found for event in SSEDecoder().feed(data) if (found := event_payload(event)) is not None]


"""Token counts from the upstream's own `usage`, in every format's replies and streams.

    format      whole reply                        stream
    chat        usage.prompt/completion_tokens     the last chunk (`choices: []`), sent only
                                                   with stream_options.include_usage
    responses   usage.input/output_tokens          response.completed / incomplete / failed
    messages    usage.input(+cache)/output_tokens  message_start (input), message_delta (output)

A chat stream gets `include_usage` from memproxy where its client did not ask
(`proxy.flow.exchange`); then the tap takes the usage chunk out, so the client sees no chunk
it did not ask for. (The `"usage": null` OpenAI then adds to every other chunk stays: the
SDKs read it as absent, and taking it out would cost a rewrite of every chunk.) A chunk
that carries usage next to real choices (some providers send it on the finish chunk) is
never taken out. The tap reads only events that hold its format's mark, a byte search per
chunk: a stream costs one JSON parse or two (docs/usage.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.http.sse import SSEDecoder, decode, event_payload, frames

_DECODER = json.JSONDecoder()

MAX_TOKENS = 10**12  # a count beyond this is not a count
# A key every usage object of the format holds (whatever the JSON's spacing): the tap's mark.
CHAT_MARK = b'"completion_tokens"'
RESPONSES_MARK = MESSAGES_MARK = b'"output_tokens"'
# A stream that never ends an event would otherwise be held whole: past this it goes through.
MAX_HELD = 1024 * 1024
_ASK = b'{"stream_options":{"include_usage":true},'


def ask_stream_usage(payload: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any], bool]:
    """A streamed chat completion's bytes and body asking for the usage chunk, and whether
    memproxy asked (then the client must not see it). A client that asked itself, or sent
    an include_usage the upstream must judge (not a boolean), goes as it came."""
    options = body.get("stream_options")
    if options is None:
        asked: dict[str, Any] = {"include_usage": True}
    elif isinstance(options, dict) and options.get("include_usage") in (None, False):
        asked = {**options, "include_usage": True}
    else:
        return payload, body, False
    changed = {**body, "stream_options": asked}
    start = payload.lstrip()
    if "stream_options" not in body and start.startswith(b"{"):
        # Two short copies instead of encoding the whole body again.
        return _ASK + start[1:], changed, True
    return orjson.dumps(changed), changed, True


@dataclass(frozen=True)
class Seen:
    """What one reply or event said about tokens (None: nothing)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    only_usage: bool = False  # a chat chunk with no choices: the usage chunk itself


Reader = Callable[[Mapping[str, Any]], Seen | None]


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS:
        return value
    return None


def _sum(*values: Any) -> int | None:
    counts = [c for c in map(_count, values) if c is not None]
    return sum(counts) if counts else None


def chat_usage(payload: Mapping[str, Any]) -> Seen | None:
    """A chat.completion or chat.completion.chunk's usage."""
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    choices = payload.get("choices")
    return Seen(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")),
                only_usage=not choices and payload.get("object") != "chat.completion")


def responses_usage(payload: Mapping[str, Any]) -> Seen | None:
    """A response object's usage, or a `response.completed|incomplete|failed` event's."""
    response = payload.get("response") if "type" in payload else payload
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    return Seen(_count(usage.get("input_tokens")), _count(usage.get("output_tokens")))


def messages_usage(payload: Mapping[str, Any]) -> Seen | None:
    """A message's usage, or a `message_start` / `message_delta` event's. Anthropic counts
    cached input apart: input is input_tokens plus the cache's creation and reads."""
    kind = payload.get("type")
    holder = payload.get("message") if kind == "message_start" else payload
    usage = holder.get("usage") if isinstance(holder, dict) else None
    if not isinstance(usage, dict):
        return None
    return Seen(
        _sum(usage.get("input_tokens"), usage.get("cache_creation_input_tokens"),
             usage.get("cache_read_input_tokens")),
        _count(usage.get("output_tokens")),
    )


class UsageTap:
    """Reads a relayed event stream's token counts; with `strip`, takes out the usage chunk
    memproxy asked for and the client did not.

    `mark` is a key every usage object of the format holds and nothing else does (a quote
    inside a JSON string is escaped, so content cannot hold it): one byte search per chunk
    finds the events to read. Whole events only pass on (an event split between two reads
    waits for its end, at most MAX_HELD bytes): the usual chunk is one or more whole events.
    """

    def __init__(self, read: Reader, mark: bytes, *, strip: bool = False) -> None:
        self.read = read
        self.mark = mark
        self.strip = strip
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self._events = SSEDecoder()  # cuts the stream after its events, reads none

    def feed(self, chunk: bytes) -> bytes:
        """Take upstream bytes; return what goes to the client now."""
        data = self._events.whole(chunk)  # the usual chunk: a byte check, the same bytes
        if self._events.held_size > MAX_HELD:
            data += self._events.end()
        return self._look(data) if self.mark in data else data

    def end(self) -> bytes:
        """The bytes still held when the upstream's stream ended."""
        rest = self._events.end()
        return self._look(rest) if self.mark in rest else rest

    def _look(self, data: bytes) -> bytes:
        """Read every event that holds the mark; drop the usage chunk when stripping."""
        events = frames(data)
        kept = [event for event in events if self.mark not in event or not self._usage_only(event)]
        return data if len(kept) == len(events) else b"".join(kept)

    def _usage_only(self, event: bytes) -> bool:
        """Read the event's counts; whether it is a usage chunk the client did not ask for."""
        decoded = decode(event)
        payload = event_payload(decoded[0]) if decoded else None
        seen = self.read(payload) if payload is not None else None
        if seen is None:
            return False
        if seen.input_tokens is not None:
            self.input_tokens = seen.input_tokens
        if seen.output_tokens is not None:
            self.output_tokens = seen.output_tokens
        return self.strip and seen.only_usage


class ReplyUsage:
    """Reads the `usage` of a whole JSON reply relayed as bytes, unparsed: the
    pass-through's /v1/embeddings and /v1/completions (docs/usage.md).

    Their replies can be megabytes of vectors, so only the first and the last KEPT bytes are
    kept, and the last top-level-looking `"usage":{...}` in them is read. OpenAI and the
    servers that copy its API end a reply with its usage; a reply of up to 2 * KEPT bytes is
    kept whole, wherever its usage is. A quote inside a JSON string is escaped, so no text a
    model wrote can hold the key `"usage"`."""

    KEPT = 8192

    def __init__(self) -> None:
        self._head = bytearray()
        self._tail = bytearray()
        self._whole = True  # nothing between the head and the tail was let go

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the reply."""
        if len(self._head) < self.KEPT:
            room = self.KEPT - len(self._head)
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > self.KEPT:
                del self._tail[: len(self._tail) - self.KEPT]
                self._whole = False

    def seen(self) -> Seen | None:
        """The reply's counts: input is `prompt_tokens` (or `input_tokens`), output
        `completion_tokens` (or `output_tokens`; an embedding has none). None: no usage."""
        parts = (self._head + self._tail,) if self._whole else (self._tail, self._head)
        for part in parts:
            at = part.rfind(b'"usage"')
            while at != -1:
                usage = _object_after(bytes(part), at + len(b'"usage"'))
                if usage is not None:
                    return Seen(_count(usage.get("prompt_tokens", usage.get("input_tokens"))),
                                _count(usage.get("completion_tokens", usage.get("output_tokens"))))
                at = part.rfind(b'"usage"', 0, at)
        return None


def _object_after(data: bytes, at: int) -> dict[str, Any] | None:
    """The JSON object after `:` at `at` (a key's value), if it is whole there."""
    rest = data[at:].lstrip()
    if not rest.startswith(b":"):
        return None
    text = rest[1:].lstrip().decode("utf-8", "replace")
    if not text.startswith("{"):
        return None
    try:
        found, _ = _DECODER.raw_decode(text)  # the object, nested ones and all, and no more
    except ValueError:
        return None
    return found if isinstance(found, dict) else None

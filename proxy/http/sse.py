"""Server-Sent Events, both ways: the one decoder and the one encoder of the event streams
memproxy relays and writes, and the chat-reply tee built on the decoder.

Follows the WHATWG event-stream parsing rules: lines end in CRLF, LF or CR; a blank line
dispatches the event; `data` lines join with LF; lines starting with ':' are comments.
Bytes may arrive split anywhere, including inside a CRLF pair or a UTF-8 sequence.

The decoder cuts the stream after its last blank line (`SSEDecoder.whole`) before it reads a
line, so a relay that must pass whole events only (to replace a malformed one, or take one
out) gets them from the same cut, as the bytes came: the usual chunk, one or more whole
events, costs a byte check and no copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

# Each blank line holds one of these pairs (a terminator, then the next line's; the LF of a
# CRLF pair may follow), and each pair is one: LF ends a terminator, CR begins one.
_BLANK_LINE_PAIRS = (b"\n\n", b"\r\r", b"\n\r")
_BLANK_LINES = (b"\n", b"\r", b"\r\n")  # a blank line on its own, with its terminator


@dataclass(frozen=True)
class ServerSentEvent:
    """One dispatched event."""

    data: str
    event: str | None = None
    id: str | None = None


class SSEDecoder:
    """Feed bytes, get whole events back."""

    def __init__(self) -> None:
        # The start of the next event, as it came, not yet whole: joined once it is, so an
        # event that comes in many reads is copied once, not once a read.
        self._held: list[bytes] = []
        self.held_size = 0
        self._id: str | None = None  # the last event id, which persists (WHATWG)

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Decode a chunk; return the events it completed."""
        return self._events(self.whole(chunk).splitlines())

    def whole(self, chunk: bytes) -> bytes:
        """Take a chunk; return the whole events it completes, as their bytes came (those
        held before first), and hold the start of the next."""
        held = self._held
        if not held and chunk.endswith(b"\n\n"):
            return chunk  # the usual chunk: whole events
        # A blank line not seen before ends in the chunk; its pair may start on the held
        # byte before it.
        end = max(chunk.rfind(pair) for pair in _BLANK_LINE_PAIRS) + 2
        if end == 1 and not (held and held[-1][-1:] + chunk[:1] in _BLANK_LINE_PAIRS):
            if chunk:
                held.append(chunk)
                self.held_size += len(chunk)
            return b""
        if chunk[end - 1 : end] == b"\r" and chunk[end : end + 1] == b"\n":
            end += 1  # the blank line ends in CRLF
        out = b"".join([*held, chunk[:end]]) if held else chunk[:end]
        self._held = [chunk[end:]] if end < len(chunk) else []
        self.held_size = len(chunk) - end
        return out

    def end(self) -> bytes:
        """The bytes still held (an unfinished event), now let go."""
        rest = b"".join(self._held)
        self._held, self.held_size = [], 0
        return rest

    def _events(self, lines: list[bytes]) -> list[ServerSentEvent]:
        events = []
        data: list[str] = []
        name: str | None = None
        for line in lines:
            if not line:
                if data or name is not None:
                    events.append(ServerSentEvent("\n".join(data), name, self._id))
                    data, name = [], None
                continue
            key, _, raw = line.partition(b":")  # a comment's key is empty
            value = (raw[1:] if raw[:1] == b" " else raw).decode("utf-8", "replace")
            if key == b"data":
                data.append(value)
            elif key == b"event":
                name = value
            elif key == b"id" and "\0" not in value:
                self._id = value
        return events


def decode(data: bytes) -> list[ServerSentEvent]:
    """Every event in a stream's bytes, an unfinished last one too (for reading what passed,
    not for relaying it)."""
    return SSEDecoder()._events([*data.splitlines(), b""])


def frames(data: bytes) -> list[bytes]:
    """`data` cut after each blank line: each event's bytes as they came, then any rest (a
    rare path's tool: it cuts line by line)."""
    out: list[bytes] = []
    lines: list[bytes] = []
    for line in data.splitlines(keepends=True):
        lines.append(line)
        if line in _BLANK_LINES:
            out.append(b"".join(lines))
            lines = []
    if lines:
        out.append(b"".join(lines))
    return out


def encode(data: bytes | str, event: str | None = None) -> bytes:
    """One event as SSE bytes: its name when it has one, then a `data:` line for each line of
    `data`, which is JSON or a decoded event's data, so LF is its only line end (memproxy's
    events carry no id)."""
    raw = data.encode() if isinstance(data, str) else data
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    return head + b"data: " + raw.replace(b"\n", b"\ndata: ") + b"\n\n"


def event_payload(event: ServerSentEvent) -> dict[str, Any] | None:
    """An event's data as a JSON object (None when it is not one)."""
    return json_object(event.data)


def json_object(data: str | bytes) -> dict[str, Any] | None:
    """An event's or a whole reply's data as a JSON object (None when it is not one)."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class ReplyTee(Protocol):
    """Reads a relayed event stream as it passes, for the reply's text (each API format has
    one: `proxy.formats.base.ApiFormat.tee`)."""

    finished: bool  # the stream reached its normal, complete end
    malformed: bool  # an event the client's SDK could not parse: the relay stops before it
    reply_id: str | None

    def feed(self, chunk: bytes) -> None:
        """Take relayed bytes (whole events or not)."""
        ...

    @property
    def text(self) -> str:
        """The reply so far, as text."""
        ...


@dataclass
class ChatReplyTee:
    """Collects the assistant's reply (choice 0) from chat.completion.chunk events."""

    decoder: SSEDecoder = field(default_factory=SSEDecoder)
    parts: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    model: str | None = None
    finished: bool = False
    errored: bool = False
    malformed: bool = False  # an unnamed event whose data is neither a JSON object nor [DONE]
    # The upstream's id of the completion (`chatcmpl-...`): the reply is remembered under
    # it, so memproxy knows whose a stored completion is (proxy/access/ownership.py).
    reply_id: str | None = None

    def feed(self, chunk: bytes) -> None:
        """Take relayed bytes."""
        for event in self.decoder.feed(chunk):
            self._event(event)

    def _event(self, event: ServerSentEvent) -> None:
        if self.malformed:
            return  # the relay stops at a malformed event: nothing after it reaches the client
        if event.data.startswith("[DONE]"):
            self.finished = True
            return
        payload = event_payload(event)
        if payload is None:
            # What the SDKs would fail on: an unnamed event whose data is not an object.
            self.malformed = self.malformed or (event.event is None and bool(event.data))
            return
        if event.event == "error" or "error" in payload:
            self.errored = True
            return
        # Any field may hold any type: the relay must never fail on what it only reads.
        model = payload.get("model")
        self.model = self.model or (model if isinstance(model, str) else None)
        if self.reply_id is None and isinstance(reply_id := payload.get("id"), str) and reply_id:
            self.reply_id = reply_id
        for choice in _list(payload.get("choices")):
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        if isinstance(delta.get("content"), str):
            self.parts.append(delta["content"])
        for call in _list(delta.get("tool_calls")):
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            slot = self.tool_calls.setdefault(
                index if isinstance(index, int) else 0, {"name": "", "arguments": ""}
            )
            function = _dict(call.get("function"))
            slot["name"] += _str(function.get("name"))
            slot["arguments"] += _str(function.get("arguments"))
        if choice.get("finish_reason"):
            self.finished = True

    @property
    def text(self) -> str:
        """The reply as text, tool calls rendered after the content."""
        calls = [f"[tool call] {c['name']}({c['arguments']})" for c in self.tool_calls.values()]
        return "\n".join(filter(None, ["".join(self.parts), *calls]))


def reply_text(completion: dict[str, Any]) -> str:
    """The assistant's reply (choice 0) of a non-streamed chat.completion, as text."""
    choices = _list(completion.get("choices"))
    message = _dict(_dict(choices[0] if choices else None).get("message"))
    content = message.get("content")
    parts = [content] if isinstance(content, str) else []
    for call in _list(message.get("tool_calls")):
        function = _dict(_dict(call).get("function"))
        parts.append(f"[tool call] {function.get('name', '')}({function.get('arguments', '')})")
    return "\n".join(filter(None, parts))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""

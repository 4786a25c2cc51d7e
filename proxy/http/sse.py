"""A small incremental Server-Sent Events decoder and the chat-reply tee built on it.

Follows the WHATWG event-stream parsing rules: lines end in CRLF, LF or CR; a blank line
dispatches the event; `data` lines join with LF; lines starting with ':' are comments.
Bytes may arrive split anywhere, including inside a CRLF pair or a UTF-8 sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True)
class ServerSentEvent:
    """One dispatched event."""

    data: str
    event: str | None = None
    id: str | None = None


class SSEDecoder:
    """Feed bytes, get whole events back."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Decode a chunk; return the events it completed."""
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split across chunks
        self._pending_cr = False
        self._buffer += chunk
        events = []
        while True:
            line, found = self._next_line()
            if not found:
                break
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _next_line(self) -> tuple[bytes, bool]:
        buf = self._buffer
        cr, lf = buf.find(b"\r"), buf.find(b"\n")
        if cr == -1 and lf == -1:
            return b"", False
        if cr != -1 and (lf == -1 or cr < lf):
            if cr == len(buf) - 1:
                # A lone trailing CR ends the line; a following LF may still be in flight.
                self._pending_cr = True
                self._buffer = b""
                return buf[:cr], True
            end = cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            self._buffer = buf[end:]
            return buf[:cr], True
        self._buffer = buf[lf + 1 :]
        return buf[:lf], True

    def _line(self, raw: bytes) -> ServerSentEvent | None:
        if not raw:
            return self._dispatch()
        line = raw.decode("utf-8", "replace")
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data and self._event is None:
            return None
        event = ServerSentEvent("\n".join(self._data), self._event, self._id)
        self._data, self._event = [], None
        return event


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
        try:
            payload = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict):
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

"""The memory tool loop in Anthropic Messages (`proxy.flow.memory_tool.loop`): a tool with an
`input_schema`, `tool_use` blocks answered by `tool_result` blocks in a user message, and
the stream's filter.

The API refuses `tool_use` blocks in a conversation whose request defines no tools, so in the
last round memory_search stays defined (with `tool_choice: none` when the client has no
tools of its own) and a call to it there is dropped.

In a stream, text (and thinking) blocks go out as they arrive, numbered on from the rounds
before; memory_search's blocks are dropped; the client's tool_use blocks, `message_delta` and
`message_stop` are held until the round ends (a memory_search call may follow a client call).
A later round's `message_start` is not sent: the client sees one message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import count
from typing import Any, ClassVar

import orjson

from proxy.flow.memory_tool.dialect import (
    DESCRIPTION,
    PARAMETERS,
    TOOL_NAME,
    Dialect,
    Payload,
    Search,
    StreamRound,
    add_usage,
    dicts,
    encoded,
    reencoded,
    search_query,
)
from proxy.formats.base import as_dict
from proxy.http.sse import ServerSentEvent

# Stream deltas by type, and the field each one carries and extends in its block: a tool use's
# input arrives as JSON text, gathered in `partial_json` until the block is whole (`_finished`).
DELTA_FIELDS = {"text_delta": "text", "input_json_delta": "partial_json",
                "thinking_delta": "thinking", "signature_delta": "signature"}


class MessagesDialect(Dialect):
    """Anthropic Messages' side of the tool loop."""

    tool: ClassVar[Payload] = {"name": TOOL_NAME, "description": DESCRIPTION, "input_schema": PARAMETERS}
    no_calls: ClassVar[Payload] = {"type": "none"}

    def forbids_calls(self, choice: Any) -> bool:
        """A tool_choice of type none."""
        return as_dict(choice).get("type") == "none"

    def searches(self, reply: Payload) -> list[Search]:
        """The message's memory_search tool_use blocks."""
        return [Search(str(b.get("id") or ""), search_query(b.get("input")))
                for b in dicts(reply.get("content")) if _ours(b)]

    def followup(self, reply: Payload, answers: Sequence[tuple[Search, str]]) -> list[Payload]:
        """The assistant message without the client's tool uses, then the tool results."""
        kept = [b for b in dicts(reply.get("content")) if b.get("type") != "tool_use" or _ours(b)]
        results = [{"type": "tool_result", "tool_use_id": search.id, "content": text}
                   for search, text in answers]
        return [{"role": "assistant", "content": kept}, {"role": "user", "content": results}]

    def without_ours(self, reply: Payload) -> Payload:
        """The message without memory_search's blocks (end_turn when no tool use is left)."""
        blocks = dicts(reply.get("content"))
        if not any(_ours(b) for b in blocks):
            return reply
        out = {**reply, "content": [b for b in blocks if not _ours(b)]}
        if reply.get("stop_reason") == "tool_use" and not any(b.get("type") == "tool_use" for b in out["content"]):
            out["stop_reason"] = "end_turn"
        return out

    def stream_round(self, previous: StreamRound | None, usage_before: Payload | None) -> MessagesRound:
        """The next round, numbering its blocks after those the client already has."""
        return MessagesRound(previous if isinstance(previous, MessagesRound) else None, usage_before)


class MessagesRound(StreamRound):
    """Reads one round's Messages events; relays some, holds the rest."""

    def __init__(self, previous: MessagesRound | None, usage_before: Payload | None) -> None:
        super().__init__(usage_before)
        self.first = previous is None
        # The client's numbers for the next blocks: rounds go on from the blocks it has.
        self.numbering: Iterator[int] = previous.numbering if previous is not None else count()
        self._blocks: dict[int, Payload] = {}  # upstream index -> the block rebuilt
        self._numbers: dict[int, int] = {}  # upstream index -> the client's index
        self._stop_reason: Any = None
        self._usage: Payload = {}

    def reply(self) -> Payload:
        """The round as a whole message: its blocks in order, stop reason and usage."""
        blocks = [_finished(b) for _, b in sorted(self._blocks.items())]
        return {"type": "message", "role": "assistant", "content": blocks,
                "stop_reason": self._stop_reason, "usage": self._usage or None}

    def end(self) -> bytes:
        """The held events: the client's tool uses numbered on, then the message's end."""
        client_uses = any(b.get("type") == "tool_use" for b in self._blocks.values() if not _ours(b))
        out = []
        for event, payload in self._held:
            if payload is not None and payload.get("type") == "message_delta":
                out.append(self._message_delta(event, payload, client_uses))
            elif payload is not None and isinstance(index := payload.get("index"), int):
                if index not in self._numbers:
                    self._numbers[index] = next(self.numbering)
                out.append(self._numbered(event, payload))
            else:
                out.append(encoded(event))
        return b"".join(out)

    def _take(self, event: ServerSentEvent, payload: Payload | None) -> bytes:
        """What happens to one event: relayed, renumbered (a block), held or dropped."""
        if payload is None:
            return encoded(event)
        kind, index = payload.get("type"), payload.get("index")
        if kind == "message_start":
            self._usage = {**as_dict(as_dict(payload.get("message")).get("usage"))}
            return encoded(event) if self.first else b""
        if kind in ("message_delta", "message_stop"):
            if kind == "message_delta":
                self._stop_reason = as_dict(payload.get("delta")).get("stop_reason")
                self._usage.update(as_dict(payload.get("usage")))
            return self._hold(event, payload)
        if not isinstance(index, int) or not str(kind).startswith("content_block"):
            return encoded(event)  # ping, error, anything new
        if kind == "content_block_start":
            self._blocks[index] = {**as_dict(payload.get("content_block"))}
        block = self._blocks.setdefault(index, {})
        if kind == "content_block_delta":
            _extend(block, as_dict(payload.get("delta")))
        if _ours(block):
            return b""  # memory_search's: the client never sees it
        if block.get("type") == "tool_use":
            # The client's: sent after the round, unless the round searched.
            return self._hold(event, payload)
        if kind == "content_block_start":
            self._numbers[index] = next(self.numbering)
        return self._numbered(event, payload)

    def _numbered(self, event: ServerSentEvent, payload: Payload) -> bytes:
        index = payload["index"]
        number = self._numbers.get(index, index)
        if number == index:
            return encoded(event)
        return reencoded(event, {**payload, "index": number})

    def _message_delta(self, event: ServerSentEvent, payload: Payload, client_uses: bool) -> bytes:
        delta = as_dict(payload.get("delta"))
        stripped = any(_ours(b) for b in self._blocks.values())
        if not stripped and self.usage_before is None:
            return encoded(event)
        out = {**payload}
        if stripped and delta.get("stop_reason") == "tool_use" and not client_uses:
            out["delta"] = {**delta, "stop_reason": "end_turn"}
        if self.usage_before is not None:
            # Every round's tokens, in the field the SDKs take the final usage from.
            out["usage"] = add_usage(self.usage_before, self._usage)
        return reencoded(event, out)


def _extend(block: Payload, delta: Payload) -> None:
    """Add a stream delta to the block it belongs to."""
    field = DELTA_FIELDS.get(str(delta.get("type")))
    if field is not None and isinstance(delta.get(field), str):
        block[field] = str(block.get(field) or "") + delta[field]


def _finished(block: Payload) -> Payload:
    """A streamed block as a whole message holds it (a tool use's input parsed)."""
    out = {k: v for k, v in block.items() if k != "partial_json"}
    if "partial_json" in block:
        try:
            out["input"] = orjson.loads(block["partial_json"] or "{}")
        except orjson.JSONDecodeError:
            out["input"] = {}
    return out


def _ours(block: Payload) -> bool:
    return block.get("type") == "tool_use" and block.get("name") == TOOL_NAME

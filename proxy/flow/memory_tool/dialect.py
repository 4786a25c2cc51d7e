"""What an API format tells the memory tool loop (`proxy.flow.memory_tool.loop`): how the tool is
offered, how its calls and their answers look, and how a stream's round is filtered.

What the three formats do alike is written once here, on what each format declares (its
tool, its conversation's field, the `tool_choice` that forbids calls); each format's module
holds only what differs. A streamed round is rebuilt into the shape of a whole reply
(`StreamRound.reply`), so the loop reads calls, usage and the turn that goes on the same way
for both.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from proxy.formats.base import as_list
from proxy.http.sse import ServerSentEvent, SSEDecoder, encode, event_payload

Payload = dict[str, Any]
TOOL_NAME = "memory_search"
DESCRIPTION = (
    "Search long-term memory of earlier conversations with this user: facts, preferences, "
    "decisions and past messages. Use it when the answer may depend on something said before "
    "that is not in this conversation or the recalled context."
)
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "What to look for."}},
    "required": ["query"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Search:
    """One memory_search call: its id and its query (None when the arguments hold none)."""

    id: str
    query: str | None


class StreamRound(ABC):
    """One round's events on their way to the client: some relayed at once, some held
    (`_held`) until the round ends."""

    def __init__(self, usage_before: Payload | None) -> None:
        self.usage_before = usage_before  # of the rounds before this one
        self._decoder = SSEDecoder()
        self._held: list[tuple[ServerSentEvent, Payload | None]] = []

    def feed(self, chunk: bytes) -> bytes:
        """Take upstream bytes; return the whole events that go to the client now."""
        return b"".join(self._take(event, event_payload(event)) for event in self._decoder.feed(chunk))

    def _hold(self, event: ServerSentEvent, payload: Payload | None) -> bytes:
        """Keep an event back until the round ends: nothing goes to the client now."""
        self._held.append((event, payload))
        return b""

    @abstractmethod
    def _take(self, event: ServerSentEvent, payload: Payload | None) -> bytes:
        """One event (`payload`: its data as a JSON object): what goes to the client now."""

    @abstractmethod
    def reply(self) -> Payload:
        """The round so far as a whole reply of the format."""

    @abstractmethod
    def end(self) -> bytes:
        """The events held back, as the client gets them when this round is the last."""


class Dialect(ABC):
    """One API format's side of the tool loop."""

    tool: ClassVar[Payload]  # memory_search as the format defines a tool
    field: ClassVar[str] = "messages"  # the body's conversation
    no_calls: ClassVar[Any]  # the tool_choice that forbids every call

    def unsupported(self, body: Payload) -> str | None:
        """Why the loop cannot serve this body (None: it can): what the format refuses, tools
        that are not a list or hold a memory_search, a tool_choice that forbids calls."""
        if (reason := self.refusal(body)) is not None:
            return reason
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return "tools is not an array"
        if any(self.tool_name(t) == TOOL_NAME for t in tools or ()):
            return f"the request has its own {TOOL_NAME} tool"
        if self.forbids_calls(body.get("tool_choice")):
            return "tool_choice is none"
        return None

    def refusal(self, body: Payload) -> str | None:
        """What else of this format's body the loop cannot serve."""
        return None

    def tool_name(self, tool: Any) -> Any:
        """The name a tool definition of the body gives."""
        return tool.get("name") if isinstance(tool, dict) else None

    def forbids_calls(self, choice: Any) -> bool:
        """Whether the body's tool_choice forbids every call."""
        return bool(choice == self.no_calls)

    def items(self, body: Payload) -> list[Any]:
        """The body's conversation as the format lists it."""
        return list(body[self.field])

    def with_items(self, body: Payload, items: list[Any]) -> Payload:
        """The body carrying `items` as its conversation."""
        return {**body, self.field: items}

    def offer(self, body: Payload) -> Payload:
        """The body with memory_search after the client's tools."""
        return {**body, "tools": [*(body.get("tools") or ()), self.tool]}

    def last_round(self, body: Payload) -> Payload:
        """The body of a round where memory_search is no longer to be called: still defined,
        as the conversation holds its calls, with the tool_choice that forbids calls when
        the client has no tools of its own."""
        if body.get("tools") or "tool_choice" in body:
            return self.offer(body)
        # Each body its own tool_choice object: the class's is shared by every request.
        return {**self.offer(body), "tool_choice": copy.copy(self.no_calls)}

    @abstractmethod
    def searches(self, reply: Payload) -> list[Search]:
        """A whole reply's memory_search calls, in order."""

    @abstractmethod
    def followup(self, reply: Payload, answers: Sequence[tuple[Search, str]]) -> list[Payload]:
        """The messages that go on from a reply that searched: its turn without the
        client's calls, then the answers."""

    def final(self, reply: Payload, usage_before: Payload | None) -> Payload:
        """The last reply as the client gets it: no memory_search, usage of every round (the
        reply itself when there is nothing to change)."""
        if isinstance(reply.get("usage"), dict) and usage_before is not None:
            reply = {**reply, "usage": add_usage(usage_before, reply["usage"])}
        return self.without_ours(reply)

    @abstractmethod
    def without_ours(self, reply: Payload) -> Payload:
        """The reply without memory_search's calls (itself when it holds none)."""

    @abstractmethod
    def stream_round(self, previous: StreamRound | None, usage_before: Payload | None) -> StreamRound:
        """A filter for the next round of a stream (`previous`: the round before, or None)."""


def add_usage(before: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    """Token usage of two rounds together: top-level counts summed, the rest as the later."""
    if not isinstance(usage, dict):
        return before
    if before is None:
        return usage
    summed = {**usage}
    for key, value in before.items():
        if _count(value) and _count(usage.get(key)):
            summed[key] = value + usage[key]
    return summed


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def encoded(event: ServerSentEvent) -> bytes:
    """One event as SSE bytes, as it came (proxy.http.sse.encode)."""
    return encode(event.data, event.event)


def reencoded(event: ServerSentEvent, payload: Payload) -> bytes:
    """An event with its data replaced by `payload`."""
    return encode(orjson.dumps(payload), event.event)


def dicts(value: Any) -> list[Payload]:
    """The objects an array holds (none when `value` is not an array): a reply's calls,
    blocks or items, any of which may be malformed."""
    return [item for item in as_list(value) if isinstance(item, dict)]


def search_query(arguments: Any) -> str | None:
    """A memory_search call's query, from its arguments as JSON text (chat, Responses) or
    as an object (Messages); None when they hold none."""
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
    query = arguments.get("query") if isinstance(arguments, dict) else None
    return query.strip() or None if isinstance(query, str) else None

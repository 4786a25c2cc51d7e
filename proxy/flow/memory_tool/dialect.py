"""What an API format tells the memory tool loop (`proxy.flow.memory_tool.loop`): how the tool is
offered, how its calls and their answers look, and how a stream's round is filtered.

A streamed round is rebuilt into the shape of a whole reply (`StreamRound.reply`), so the
loop reads calls, usage and the turn that goes on the same way for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

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


class StreamRound(Protocol):
    """One round's events on their way to the client."""

    def feed(self, chunk: bytes) -> bytes:
        """Take upstream bytes; return the whole events that go to the client now."""
        ...

    def reply(self) -> dict[str, Any]:
        """The round so far as a whole reply of the format."""
        ...

    def end(self) -> bytes:
        """The events held back, as the client gets them when this round is the last."""
        ...


class Dialect(Protocol):
    """One API format's side of the tool loop."""

    def unsupported(self, body: dict[str, Any]) -> str | None:
        """Why the loop cannot serve this body (None: it can)."""
        ...

    def items(self, body: dict[str, Any]) -> list[Any]:
        """The body's conversation as the format lists it (chat: `messages`)."""
        ...

    def with_items(self, body: dict[str, Any], items: list[Any]) -> dict[str, Any]:
        """The body carrying `items` as its conversation."""
        ...

    def offer(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body with memory_search among its tools."""
        ...

    def last_round(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body of a round where memory_search is no longer offered."""
        ...

    def searches(self, reply: dict[str, Any]) -> list[Search]:
        """A whole reply's memory_search calls, in order."""
        ...

    def followup(self, reply: dict[str, Any], answers: Sequence[tuple[Search, str]]) -> list[dict[str, Any]]:
        """The messages that go on from a reply that searched: its turn without the
        client's calls, then the answers."""
        ...

    def final(self, reply: dict[str, Any], usage_before: dict[str, Any] | None) -> dict[str, Any]:
        """The last reply as the client gets it: no memory_search, usage of every round."""
        ...

    def usage(self, reply: dict[str, Any]) -> Any:
        """A whole reply's usage object."""
        ...

    def stream_round(self, previous: Any, usage_before: dict[str, Any] | None) -> StreamRound:
        """A filter for the next round of a stream (`previous`: the round before, or None)."""
        ...


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

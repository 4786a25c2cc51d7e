"""Placing the rendered memory block into a request's messages (docs/architecture.md, "Request flow")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memory.log.messages import last_user_index


def inject(messages: Sequence[Mapping[str, Any]], block: str, placement: str) -> list[Any]:
    """A copy of `messages` carrying `block`; the caller's list is never changed.

    `system`: appended to the first system message, or a new system message at the top.
    `last_user`: a system message right before the last user message, so everything before
    it stays byte-identical across requests and provider prompt caches keep hitting.
    """
    out: list[Any] = list(messages)
    if not block:
        return out
    if placement == "last_user":
        index = last_user_index(out)
        out.insert(len(out) if index is None else index, {"role": "system", "content": block})
        return out
    for i, message in enumerate(out):
        if message.get("role") == "system":
            out[i] = {**message, "content": _append(message.get("content"), block)}
            return out
    out.insert(0, {"role": "system", "content": block})
    return out


def _append(content: Any, block: str) -> Any:
    if isinstance(content, list):
        return [*content, {"type": "text", "text": block}]
    if isinstance(content, str) and content:
        return f"{content}\n\n{block}"
    return block


@dataclass(frozen=True)
class Placed:
    """A block and where it goes: before the conversation's user message number `user`
    (counted from 0), or (placement `system`) appended to the system prompt."""

    user: int
    block: str
    placement: str


def place(messages: Sequence[Mapping[str, Any]], placed: Sequence[Placed]) -> list[Any]:
    """A copy of `messages` carrying every block at its place (stable injection).

    The same blocks at the same places give the same bytes: a later request of the session
    repeats an earlier one's prompt up to where that one ended.
    """
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    out: list[Any] = list(messages)
    for p in placing_order(placed):
        if p.placement == "system":
            out = inject(out, p.block, "system")
        elif p.user < len(users):
            out.insert(users[p.user], {"role": "system", "content": p.block})
    return out


def placing_order(placed: Sequence[Placed]) -> list[Placed]:
    """The order to insert blocks in: from the last place to the first, so each insert
    leaves the places before it as they were; a block for the system prompt last, as it
    may add a message at the top."""
    return sorted(placed, key=lambda p: (p.placement == "system", -p.user))

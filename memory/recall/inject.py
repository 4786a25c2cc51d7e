"""Placing the rendered memory block into a request's messages (DESIGN.md 2.7)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

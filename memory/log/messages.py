"""Reading OpenAI chat messages: the text memory keeps of each."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Roles whose messages are turns of the conversation (system prompts are configuration).
TURN_ROLES = frozenset({"user", "assistant", "tool"})


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
        return "\n".join(texts)
    return ""


def tool_calls_text(message: Mapping[str, Any]) -> str:
    """An assistant message's tool calls rendered as text lines."""
    lines = []
    calls = message.get("tool_calls")
    # Only a list holds calls; clients send anything here and memproxy forwards it unchecked.
    for call in calls if isinstance(calls, list) else ():
        if isinstance(call, Mapping):
            function = call.get("function") or {}
            if isinstance(function, Mapping):
                lines.append(
                    f"[tool call] {function.get('name', '')}({function.get('arguments', '')})"
                )
    return "\n".join(lines)


def turn_text(message: Mapping[str, Any]) -> str:
    """Everything of one message worth remembering, as text."""
    return "\n".join(filter(None, [message_text(message.get("content")), tool_calls_text(message)]))


def last_user_index(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """Index of the last user message, if any."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """Text of the last user message ("" when there is none)."""
    index = last_user_index(messages)
    return "" if index is None else message_text(messages[index].get("content"))

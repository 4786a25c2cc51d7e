"""Anthropic Messages request bodies: the checks, the conversation memory reads, and where
the memory block goes (https://docs.anthropic.com/en/api/messages).

Prompt caching reads the prompt in the order tools, system, messages, and a
`cache_control` breakpoint caches everything before it. A block that changes per request
must therefore come after the last breakpoint, or every later cached prefix misses:

- placement `system`: a text block at the end of `system`, unless a breakpoint lies in the
  messages; then, as below, in the last user message after that breakpoint.
- placement `last_user`: a text block in the last user message, after its tool results
  (Anthropic requires them first) and after any breakpoint in it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from memory import Placed, placing_order
from proxy.formats.chat_body import check_types, parse_json_object
from proxy.http.errors import InvalidRequest

ROLES = frozenset({"user", "assistant"})
# The body fields litellm receives (the Messages parameters of Anthropic's API reference,
# `model` apart); nothing that names a host, a key, headers or a provider goes to litellm.
# Not `mcp_servers`: it names hosts (and their tokens). It reaches Anthropic only through
# `anthropic_base_url`, where the body goes as sent.
MESSAGES_PARAMS = frozenset({
    "messages", "max_tokens", "container", "context_management", "metadata", "service_tier",
    "stop_sequences", "stream", "system", "temperature", "thinking", "tool_choice", "tools",
    "top_k", "top_p",
})


def parse_messages_body(raw: bytes) -> dict[str, Any]:
    """Decode and check what memproxy relies on; the upstream judges the rest."""
    body = parse_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: a non-empty string is required", param="model")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequest("max_tokens: a positive integer is required", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: a non-empty array is required", param="messages")
    for i, message in enumerate(messages):
        _check_message(i, message)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks("system", system)
    check_types(body, {"stream": (bool, "boolean"), "metadata": (dict, "object")},
                "{key}: must be a {name}")
    return body


def conversation(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`system` and the messages as chat messages (text, tool uses and tool results)."""
    out: list[dict[str, Any]] = []
    system = _text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for message in body["messages"]:
        blocks = _blocks(message.get("content"))
        if message["role"] == "assistant":
            calls = [{"function": {"name": b.get("name"), "arguments": json_text(b.get("input"))}}
                     for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
            out.append({"role": "assistant", "content": _text(blocks), "tool_calls": calls})
            continue
        out += [{"role": "tool", "content": _text(b.get("content"))}
                for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        if _is_user_turn(blocks):
            out.append({"role": "user", "content": _text(blocks)})
    return out


def has_message_breakpoint(body: Mapping[str, Any]) -> bool:
    """Whether a `cache_control` breakpoint lies in the messages."""
    return _last_breakpoint(body["messages"]) is not None


def place_messages(body: dict[str, Any], placed: Sequence[Placed]) -> dict[str, Any]:
    """A copy of `body` with each block at its place: at the end of `system` (placement
    `system`), else in its user message right before the last content block (the user's
    words, which a client caching its conversation marks), after any tool results.

    In stable injection a block never changes once sent, so it may sit before a breakpoint:
    it is written to the cache with the request that brings it, and each request's prompt
    starts with the previous one's. Its place does not depend on breakpoints, which clients
    move from message to message.
    """
    messages: list[Any] = list(body["messages"])
    users = [i for i, m in enumerate(messages)
             if m.get("role") == "user" and _is_user_turn(_blocks(m.get("content")))]
    system = body.get("system")
    for p in placing_order(placed):
        if p.placement == "system":
            system = _with_block(system, p.block)
        elif p.user < len(users):
            message = messages[users[p.user]]
            last = len(_blocks(message.get("content"))) - 1
            messages[users[p.user]] = {**message, "content": _after_results(message, p.block, last - 1)}
    changed = {**body, "messages": messages}
    if system is not None:
        changed["system"] = system
    return changed


def inject_messages(body: dict[str, Any], block: str, placement: str) -> dict[str, Any]:
    """A copy of `body` carrying the memory block (see the module docstring)."""
    messages: list[Any] = body["messages"]
    last_user = next((i for i in range(len(messages) - 1, -1, -1)
                      if messages[i].get("role") == "user"), None)
    in_messages = _last_breakpoint(messages)
    if last_user is None or (placement != "last_user" and in_messages is None):
        return {**body, "system": _with_block(body.get("system"), block)}
    message = messages[last_user]
    after = in_messages[1] if in_messages is not None and in_messages[0] == last_user else -1
    changed = list(messages)
    changed[last_user] = {**message, "content": _after_results(message, block, after)}
    return {**body, "messages": changed}


def _after_results(message: Mapping[str, Any], block: str, after: int) -> list[Any]:
    """The message's content blocks with `block` as a text block after its tool results
    (Anthropic requires them first) and after the content block numbered `after`."""
    blocks = _blocks(message.get("content"))
    results = [j for j, part in enumerate(blocks)
               if isinstance(part, dict) and part.get("type") == "tool_result"]
    at = max(results[-1] + 1 if results else 0, after + 1)
    blocks.insert(at, {"type": "text", "text": block})
    return blocks


def _blocks(content: Any) -> list[Any]:
    return list(content) if isinstance(content, list) else [{"type": "text", "text": content}]


def _is_user_turn(blocks: list[Any]) -> bool:
    """Whether a user message is a turn of its own (as memory reads it): it has text, or it
    is not only tool results."""
    return bool(_text(blocks)) or not any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks
    )


def _with_block(system: Any, block: str) -> Any:
    if isinstance(system, list):
        return [*system, {"type": "text", "text": block}]
    return f"{system}\n\n{block}" if system else block


def _last_breakpoint(messages: list[Any]) -> tuple[int, int] | None:
    """(message, block) of the last `cache_control` breakpoint in the messages."""
    found = None
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("cache_control"):
                found = (i, j)
    return found


def _check_message(i: int, message: Any) -> None:
    param = f"messages.{i}"
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param}: must be an object", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(f"{param}.role: must be 'user' or 'assistant', got {role!r}",
                             param=f"{param}.role")
    content = message.get("content")
    if not isinstance(content, str):
        _check_blocks(f"{param}.content", content)


def _check_blocks(param: str, blocks: Any) -> None:
    if not isinstance(blocks, list):
        raise InvalidRequest(f"{param}: must be a string or an array of content blocks",
                             param=param)
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidRequest(f"{param}.{j}: must be an object with a string type",
                                 param=f"{param}.{j}")


def _text(content: Any) -> str:
    """The text of a string or of a list of blocks (text blocks only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text"
                     and isinstance(b.get("text"), str))


def json_text(value: Any) -> str:
    """A value as JSON text ("" when it cannot be written: a tool use's input as memory keeps it)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return ""

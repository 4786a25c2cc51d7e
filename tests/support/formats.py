"""The scripted upstream's other API formats: OpenAI's Responses API and Anthropic's Messages.

Bodies and event streams in the real wire formats, for default echo replies and for tests
that queue their own (``SSEReply(response_events("Hi"), done=False)``)::

    upstream.enqueue(JSONReply(message_object("Bonjour")), path="/v1/messages")

Event streams are lists of bytes (named events), written as they are by ``SSEReply``; neither
format ends with ``data: [DONE]``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson


def named_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One SSE event with an ``event:`` line, as both formats send them."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def split_text(text: str, parts: int) -> list[str]:
    """``text`` in ``parts`` pieces of near-equal length (at least one)."""
    parts = max(1, min(parts, len(text)))
    size, extra = divmod(len(text), parts)
    pieces, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        pieces.append(text[start:end])
        start = end
    return pieces


# -- OpenAI Responses API ---------------------------------------------------------------------


def response_object(
    text: str | None,
    *,
    model: str = "gpt-4o-mini",
    response_id: str | None = None,
    status: str = "completed",
    function_calls: Sequence[Mapping[str, str]] = (),
    request: Mapping[str, Any] | None = None,
    input_tokens: int = 10,
) -> dict[str, Any]:
    """A ``response`` object; ``function_calls`` are ``{"name", "arguments"}``."""
    request = request or {}
    output: list[dict[str, Any]] = []
    if text is not None:
        output.append(_output_message(text, "completed"))
    for i, call in enumerate(function_calls):
        output.append({"id": f"fc_{i}_{os.urandom(6).hex()}", "type": "function_call",
                       "status": "completed", "call_id": f"call_{i}_{os.urandom(6).hex()}",
                       "name": call["name"], "arguments": call["arguments"]})
    out_tokens = (len(text or "") + 3) // 4
    return {
        "id": response_id or "resp_" + os.urandom(12).hex(), "object": "response",
        "created_at": int(time.time()), "status": status, "error": None,
        "incomplete_details": None, "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"), "model": model,
        "output": output, "parallel_tool_calls": True,
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": request.get("store", True),
        "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
        "tools": [], "top_p": 1.0, "truncation": "disabled", "user": request.get("user"),
        "metadata": request.get("metadata") or {},
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input_tokens + out_tokens},
    }


def response_events(
    text: str | None,
    *,
    model: str = "gpt-4o-mini",
    split: int = 3,
    response_id: str | None = None,
    request: Mapping[str, Any] | None = None,
    input_tokens: int = 10,
    function_calls: Sequence[Mapping[str, str]] = (),
) -> list[bytes]:
    """The ``response.*`` events of a streamed reply (text, then function calls), numbered
    from 0."""
    final = response_object(text, model=model, response_id=response_id, request=request,
                            input_tokens=input_tokens, function_calls=function_calls)
    start = {**final, "status": "in_progress", "output": [], "usage": None}
    payloads: list[dict[str, Any]] = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for index, item in enumerate(final["output"]):
        payloads += _item_events(index, item, split)
    payloads.append({"type": "response.completed", "response": final})
    return [named_event(p["type"], {**p, "sequence_number": n}) for n, p in enumerate(payloads)]


def _item_events(index: int, item: dict[str, Any], split: int) -> list[dict[str, Any]]:
    """One output item's events: added, its deltas, done."""
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": {**item, "status": "in_progress", "arguments": ""}},
            *({"type": "response.function_call_arguments.delta", **at, "delta": piece}
              for piece in split_text(item["arguments"], split)),
            {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]
    text = item["content"][0]["text"]
    part = {**at, "content_index": 0}
    return [
        {"type": "response.output_item.added", "output_index": index,
         "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **part,
         "part": {"type": "output_text", "text": "", "annotations": []}},
        *({"type": "response.output_text.delta", **part, "delta": piece, "logprobs": []}
          for piece in split_text(text, split)),
        {"type": "response.output_text.done", **part, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **part, "part": item["content"][0]},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]


def responses_input_text(body: Any) -> str:
    """The last user text of a Responses request's ``input``."""
    items = body.get("input") if isinstance(body, dict) else None
    if isinstance(items, str):
        return items
    for item in reversed(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            return _text_of(item.get("content"), ("input_text", "text"))
    return ""


def _output_message(text: str, status: str) -> dict[str, Any]:
    return {"id": "msg_" + os.urandom(12).hex(), "type": "message", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


# -- Anthropic Messages -----------------------------------------------------------------------


def message_object(
    text: str,
    *,
    model: str = "claude-scripted-1",
    stop_reason: str = "end_turn",
    tool_uses: Sequence[Mapping[str, Any]] = (),
    input_tokens: int = 10,
) -> dict[str, Any]:
    """A ``message`` object; ``tool_uses`` are ``{"name", "input"}``."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", "id": f"toolu_{i}_{os.urandom(6).hex()}",
                 "name": use["name"], "input": use["input"]} for i, use in enumerate(tool_uses)]
    return {
        "id": "msg_" + os.urandom(12).hex(), "type": "message", "role": "assistant",
        "model": model, "content": content, "stop_reason": stop_reason, "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": (len(text) + 3) // 4},
    }


def message_events(
    text: str, *, model: str = "claude-scripted-1", split: int = 3, input_tokens: int = 10
) -> list[bytes]:
    """The events of a streamed Messages reply: message_start ... message_stop."""
    final = message_object(text, model=model, input_tokens=input_tokens)
    start = {**final, "content": [], "stop_reason": None,
             "usage": {"input_tokens": input_tokens, "output_tokens": 1}}
    payloads: list[dict[str, Any]] = [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        *({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
          for piece in split_text(text, split)),
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": {"output_tokens": final["usage"]["output_tokens"]}},
        {"type": "message_stop"},
    ]
    return [named_event(p["type"], p) for p in payloads]


def anthropic_error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """Anthropic's error envelope."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def messages_input_text(body: Any) -> str:
    """The last user text of a Messages request."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for message in reversed(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and message.get("role") == "user":
            return _text_of(message.get("content"), ("text",))
    return ""


def count_tokens(body: Any) -> dict[str, int]:
    """A count_tokens answer: a quarter of the body's length, as the defaults estimate."""
    return {"input_tokens": len(orjson.dumps(body)) // 4}


def _text_of(content: Any, kinds: Sequence[str]) -> str:
    """The text parts of a content list, without a memory block memproxy put among them."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(
        p.get("text", "") for p in parts
        if isinstance(p, dict) and p.get("type") in kinds
        and not str(p.get("text", "")).startswith("<memory>")
    )

"""POST /v1/responses: OpenAI's Responses API in the shared flow (`proxy.flow.exchange`).

The memory block goes into `instructions` (placement `system`) or, as a system input item,
right before the last user input item (`last_user`); every other input item (images, files,
function calls and their outputs, reasoning) is relayed untouched. A request naming
`previous_response_id` carries only its new input: memory stores that after the reply it
continues, in that reply's session (the reply turn is stored under its response id).
Errors use OpenAI's envelope; a stream that already started ends with the Responses API's
own `error` event (https://platform.openai.com/docs/api-reference/responses-streaming/error).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from memory import Placed, placing_order
from proxy.formats.base import (
    ApiFormat,
    EventTee,
    Parsed,
    Reply,
    TextParts,
    as_list,
    tool_call_line,
)
from proxy.formats.chat_body import check_types, parse_model_body
from proxy.formats.shape import Shape, pairs_by_id
from proxy.formats.usage import RESPONSES_MARK, responses_usage
from proxy.http.errors import InvalidRequest, ProxyError
from proxy.http.sse import encode

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')
# The body fields litellm receives (the parameters of OpenAI's Responses API reference,
# https://platform.openai.com/docs/api-reference/responses/create, `model` apart); nothing
# that names a host, a key, headers or a provider goes to litellm.
RESPONSES_PARAMS = frozenset({
    "input", "background", "conversation", "include", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "parallel_tool_calls", "previous_response_id", "prompt",
    "prompt_cache_key", "prompt_cache_retention", "reasoning", "safety_identifier",
    "service_tier", "store", "stream", "stream_options", "temperature", "text", "tool_choice",
    "tools", "top_logprobs", "top_p", "truncation", "user",
})


def conversation(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and the input items as chat messages (text only)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    listed = items if isinstance(items, list) else []
    return messages + [message for message in map(_as_message, listed) if message is not None]


def output_text(response: Mapping[str, Any]) -> str:
    """The text of a response object's output: message text, then function calls."""
    gathered = TextParts()
    for item in as_list(response.get("output")):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            gathered.parts += [p["text"] for p in as_list(item.get("content"))
                               if isinstance(p, dict) and p.get("type") == "output_text"
                               and isinstance(p.get("text"), str)]
        elif item.get("type") == "function_call":
            gathered.calls.append(tool_call_line(item.get("name"), item.get("arguments")))
    return gathered.text()


@dataclass
class ResponsesTee(EventTee):
    """Collects the reply from `response.*` events: the text deltas as they come, then the
    whole output from `response.completed`, which also says the reply ended complete."""

    completed_text: str | None = None
    skip = "[DONE]"

    def _read(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        if kind == "response.output_text.delta" and isinstance(payload.get("delta"), str):
            self.gathered.parts.append(payload["delta"])
        elif kind == "response.output_item.done":
            item = payload.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                self.gathered.calls.append(tool_call_line(item.get("name"), item.get("arguments")))
        elif kind in ("response.created", "response.completed", "response.incomplete"):
            response = payload.get("response")
            response = response if isinstance(response, dict) else {}
            if isinstance(response.get("id"), str):
                self.reply_id = response["id"]
            if kind != "response.created":
                self.completed_text = output_text(response)
                self.finished = kind == "response.completed"

    @property
    def text(self) -> str:
        """The whole output once the response completed, else what the deltas said."""
        return self.completed_text or self.gathered.text()


def _check_item(i: int, item: Any) -> None:
    param = f"input[{i}]"
    if not isinstance(item, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    kind = item.get("type")
    if kind is not None and not isinstance(kind, str):
        raise InvalidRequest(f"{param}.type must be a string", param=f"{param}.type")
    if kind not in (None, "message"):
        return  # function calls, outputs, reasoning, ...: the upstream checks them
    role = item.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise InvalidRequest(
            f"{param}.role must be one of {', '.join(sorted(MESSAGE_ROLES))}, got {role!r}",
            param=f"{param}.role",
        )
    content = item.get("content")
    if not isinstance(content, (str, list)) or any(
        not isinstance(part, dict) or not isinstance(part.get("type"), str) for part in content
        if isinstance(content, list)
    ):
        raise InvalidRequest(
            f"{param}.content must be a string or an array of content parts with a type",
            param=f"{param}.content",
        )


def _as_message(item: Any) -> dict[str, Any] | None:
    """One input item as a chat message, or None for items memory does not keep."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind in (None, "message") and _role(item) in MESSAGE_ROLES:
        return {"role": item["role"], "content": _content_text(item.get("content"))}
    if kind == "function_call":
        call = {"function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, str) else _content_text(output)}
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(
        p["text"] for p in as_list(content)
        if isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
    )


def input_items(items: Any) -> list[Any]:
    """The input items as a list (a string input is one user item)."""
    return [{"role": "user", "content": items}] if isinstance(items, str) else list(items or [])


def _role(item: Any) -> str | None:
    if isinstance(item, dict) and item.get("type") in (None, "message"):
        role = item.get("role")
        return role if isinstance(role, str) else None
    return None


class ResponsesFormat(ApiFormat):
    """The Responses API's side of the flow."""

    route = "responses"
    continuable = True
    path = "/v1/responses"
    params = RESPONSES_PARAMS
    items_field = "input"
    usage_mark = RESPONSES_MARK
    read_usage = staticmethod(responses_usage)  # proxy.formats.usage

    def parse(self, raw: bytes) -> Parsed:
        """Check what memproxy relies on; the upstream judges every other field."""
        body = parse_model_body(raw)
        items = body.get("input")
        if items is not None and not isinstance(items, (str, list)):
            raise InvalidRequest("input must be a string or an array of input items", param="input")
        for i, item in enumerate(items if isinstance(items, list) else ()):
            _check_item(i, item)
        check_types(body, {"instructions": (str, "string"), "previous_response_id": (str, "string"),
                           "stream": (bool, "boolean"), "store": (bool, "boolean"),
                           "user": (str, "string"), "metadata": (dict, "object")})
        return Parsed(body, conversation(body), body.get("previous_response_id"))

    def inject(self, body: dict[str, Any], block: str, placement: str) -> dict[str, Any]:
        """`instructions` + the block, or a system item before the last user item."""
        if placement != "last_user":
            instructions = body.get("instructions")
            return {**body, "instructions": f"{instructions}\n\n{block}" if instructions else block}
        listed = input_items(body.get("input"))
        last_user = next((i for i in range(len(listed) - 1, -1, -1) if _role(listed[i]) == "user"), len(listed))
        listed.insert(last_user, {"role": "system", "content": block})
        return {**body, "input": listed}

    def place(self, body: dict[str, Any], placed: Sequence[Placed]) -> dict[str, Any]:
        """Like `inject`, each block before its user input item (or in `instructions`)."""
        for p in placing_order(placed):
            if p.placement == "system":
                body = self.inject(body, p.block, "system")
                continue
            listed = input_items(body.get("input"))
            users = [i for i, item in enumerate(listed) if _role(item) == "user"]
            if p.user < len(users):
                listed.insert(users[p.user], {"role": "system", "content": p.block})
                body = {**body, "input": listed}
        return body

    conversation = staticmethod(conversation)  # `instructions` and the input items
    tee = ResponsesTee  # a `response.*` event reader

    def compaction_shape(self, body: dict[str, Any]) -> Shape | None:
        """Input items with their roles; function calls paired with their outputs and
        reasoning items with the item after them. None for a continuation (the upstream
        holds its history) or a string input."""
        items = body.get("input")
        if body.get("previous_response_id") or not isinstance(items, list):
            return None
        calls = [(i, it.get("call_id")) for i, it in enumerate(items) if it.get("type") == "function_call"]
        results = [(i, it.get("call_id")) for i, it in enumerate(items)
                   if it.get("type") == "function_call_output"]
        reasoning = [(i, i + 1) for i, it in enumerate(items[:-1]) if it.get("type") == "reasoning"]
        return Shape([_role(it) for it in items], [*pairs_by_id(calls, results), *reasoning])

    def read_reply(self, body: dict[str, Any]) -> Reply:
        """The response's output text and function calls; its id, for continuations."""
        reply_id = body.get("id")
        return Reply(output_text(body), reply_id if isinstance(reply_id, str) else None,
                     complete=body.get("status") in (None, "completed"))

    def error_event(self, error: ProxyError, last_sent: bytes) -> bytes:
        """The Responses API's `error` event, numbered after the last event relayed."""
        numbers = _SEQUENCE.findall(last_sent)
        event = {"type": "error", "code": error.code, "message": error.message,
                 "param": error.param, "sequence_number": int(numbers[-1]) + 1 if numbers else 0}
        return encode(orjson.dumps(event), "error")


RESPONSES = ResponsesFormat()

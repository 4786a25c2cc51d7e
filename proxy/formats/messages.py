"""POST /v1/messages: Anthropic's Messages API in the shared flow (`proxy.flow.exchange`).

Upstream: `anthropic_base_url` when set (bytes both ways, `x-api-key` forwarded or the
configured one), else the model's route through litellm's translation: a route with a
provider goes to that provider, any other (and the default upstream) gets OpenAI chat
completions. Errors, before and during a stream, use Anthropic's envelope
`{"type": "error", "error": {"type", "message"}}` (https://docs.anthropic.com/en/api/errors).
`/v1/messages/count_tokens` goes to `anthropic_base_url` untouched, or is estimated here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from memory import count_tokens
from proxy.access.identity import authenticate, presented_key, proxy_key_sent
from proxy.formats.base import (
    ApiFormat,
    EventTee,
    Parsed,
    Reply,
    TextParts,
    as_dict,
    as_list,
    tool_call_line,
)
from proxy.formats.chat_body import parse_json_object
from proxy.formats.messages_body import (
    MESSAGES_PARAMS,
    conversation,
    has_message_breakpoint,
    inject_messages,
    json_text,
    parse_messages_body,
    place_messages,
)
from proxy.formats.passthrough import relay
from proxy.formats.shape import Shape, pairs_by_id
from proxy.formats.usage import MESSAGES_MARK, messages_usage
from proxy.http.body import read_body
from proxy.http.errors import ProxyError, UpstreamStatus
from proxy.http.relay import RelayResponse
from proxy.http.sse import encode, json_object
from proxy.state import AppState
from proxy.upstream.client import Target, Upstream, anthropic_target

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    529: "overloaded_error",
}


async def count_message_tokens(request: Request) -> Response | RelayResponse:
    """POST /v1/messages/count_tokens: relayed to `anthropic_base_url`, else estimated here
    with the model's tokenizer (tiktoken's, so an estimate for Claude models)."""
    state: AppState = request.app.state.memproxy
    settings = state.settings
    try:
        if settings.anthropic_base_url:
            target = anthropic_target(settings.anthropic_base_url, settings.anthropic_api_key)
            return await relay(request, state, target)
        await authenticate(request.headers, settings, state.keys)
        raw = await read_body(request, settings.max_body_bytes)
        # The same body as /v1/messages, without max_tokens.
        body = parse_messages_body(orjson.dumps({"max_tokens": 1, **parse_json_object(raw)}))
        text = "\n".join(m["content"] or "" for m in conversation(body))
        tokens = count_tokens(text, body["model"]) + _json_tokens(body.get("tools"), body["model"])
        return Response(orjson.dumps({"input_tokens": tokens}), media_type="application/json")
    except ProxyError as exc:
        return MESSAGES.error_response(exc)


def envelope(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope for a status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass
class MessagesTee(EventTee):
    """Collects the reply from Messages events: text deltas and tool uses, in block order
    (a Messages reply is never named by a later request: no reply_id)."""

    tools: dict[int, list[str]] = field(default_factory=dict)  # block index -> [name, json]
    stop_reason: str | None = None

    def _read(self, payload: dict[str, Any]) -> None:
        kind, index = payload.get("type"), payload.get("index")
        if kind == "content_block_start" and isinstance(index, int):
            block = as_dict(payload.get("content_block"))
            if block.get("type") == "tool_use":
                self.tools[index] = [str(block.get("name") or ""), ""]
        elif kind == "content_block_delta":
            delta = as_dict(payload.get("delta"))
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                self.gathered.parts.append(delta["text"])
            elif delta.get("type") == "input_json_delta" and index in self.tools:
                self.tools[index][1] += str(delta.get("partial_json") or "")
        elif kind == "message_delta":
            self.stop_reason = as_dict(payload.get("delta")).get("stop_reason") or self.stop_reason
        elif kind == "message_stop":
            self.finished = self.stop_reason != "max_tokens"

    @property
    def text(self) -> str:
        """Text first, then each tool use."""
        calls = [tool_call_line(name, arguments) for name, arguments in self.tools.values()]
        return TextParts(self.gathered.parts, calls).text()


def _json_tokens(value: Any, model: str) -> int:
    return count_tokens(orjson.dumps(value).decode(), model) if value else 0


class MessagesFormat(ApiFormat):
    """Anthropic Messages' side of the flow."""

    route = "messages"
    path = "/v1/messages"
    params = MESSAGES_PARAMS
    continuable = False
    usage_mark = MESSAGES_MARK
    read_usage = staticmethod(messages_usage)  # proxy.formats.usage
    tee = MessagesTee  # a Messages event reader
    conversation = staticmethod(conversation)  # `system` and the messages as chat messages
    # Into `system`, after the last cache_control breakpoint (`proxy.formats.messages_body`).
    inject = staticmethod(inject_messages)
    # Each block in its user message, the first maybe in `system` (`proxy.formats.messages_body`).
    place = staticmethod(place_messages)

    def parse(self, raw: bytes) -> Parsed:
        """The checked body and its conversation as chat messages."""
        body = parse_messages_body(raw)
        return Parsed(body, conversation(body))

    def target(self, upstream: Upstream, model: str, headers: Mapping[str, str]) -> Target:
        """`anthropic_base_url`, else the model's route translated by litellm."""
        settings = upstream.settings
        route = upstream.target_for(model)
        if settings.anthropic_base_url:
            # A route's context_window still counts here (compaction).
            target = anthropic_target(settings.anthropic_base_url, settings.anthropic_api_key)
            return replace(target, context_window=route.context_window)
        if route.via_litellm:
            return route
        # litellm calls this upstream itself, so it needs the key a raw forward would send.
        key = route.api_key or (
            None if proxy_key_sent(headers, settings) else presented_key(headers)
        )
        return Target(route.base_url, key, provider="openai", name=route.name)

    def first_placement(self, body: dict[str, Any], placement: str) -> str:
        """Not `system` when a breakpoint in the messages caches a prefix shared beyond
        this conversation (`proxy.formats.messages_body`)."""
        return "last_user" if has_message_breakpoint(body) else placement

    def compaction_shape(self, body: dict[str, Any]) -> Shape | None:
        """Message roles; each tool_use paired with the message holding its tool_result."""
        messages = body["messages"]
        blocks = [(i, b) for i, m in enumerate(messages)
                  for b in as_list(m.get("content")) if isinstance(b, dict)]
        calls = [(i, b.get("id")) for i, b in blocks if b.get("type") == "tool_use"]
        results = [(i, b.get("tool_use_id")) for i, b in blocks if b.get("type") == "tool_result"]
        return Shape([m.get("role") for m in messages], pairs_by_id(calls, results))

    def summary_item(self, summary: str) -> dict[str, Any]:
        """A user message (the API joins it with a user message next to it)."""
        return {"role": "user", "content": [{"type": "text", "text": summary}]}

    def read_reply(self, body: dict[str, Any]) -> Reply:
        """The message's text and tool uses."""
        gathered = TextParts()
        for block in as_list(body.get("content")):
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                gathered.parts.append(block["text"])
            elif isinstance(block, dict) and block.get("type") == "tool_use":
                gathered.calls.append(tool_call_line(block.get("name"), json_text(block.get("input"))))
        return Reply(gathered.text(), complete=body.get("stop_reason") != "max_tokens")

    def error_response(self, error: ProxyError) -> Response:
        """Anthropic's error envelope (an Anthropic upstream's own error body as it was)."""
        message = error.message
        if isinstance(error, UpstreamStatus):
            parsed = json_object(error.body) or {}
            if parsed.get("type") == "error" and isinstance(parsed.get("error"), dict):
                return Response(error.body, error.status, error.headers, media_type="application/json")
            inner = parsed.get("error")
            message = (inner.get("message") if isinstance(inner, dict) else None) or \
                error.body.decode("utf-8", "replace").strip()[:2000] or message
        headers = {k: v for k, v in error.headers.items() if k.lower() != "content-type"}
        return Response(orjson.dumps(envelope(error.status, message)), error.status, headers,
                        media_type="application/json")

    def error_event(self, error: ProxyError, last_sent: bytes) -> bytes:
        """Anthropic's `error` event, which its SDKs raise as an APIStatusError."""
        return encode(orjson.dumps(envelope(error.status, error.message)), "error")


MESSAGES = MessagesFormat()

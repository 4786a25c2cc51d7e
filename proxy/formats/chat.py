"""POST /v1/chat/completions: OpenAI's chat format in the shared flow (`proxy.flow.exchange`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory import Placed, inject, place
from proxy.formats.base import ApiFormat, Parsed, Reply, as_list
from proxy.formats.chat_body import CHAT_PARAMS, parse_chat_body
from proxy.formats.shape import Shape, pairs_by_id
from proxy.formats.usage import CHAT_MARK, chat_usage
from proxy.http.errors import ProxyError, sse_error_event
from proxy.http.sse import ChatReplyTee, reply_text


class ChatFormat(ApiFormat):
    """Chat completions: memory goes into the system message or before the last user one."""

    route = "chat"
    continuable = False
    path = "/v1/chat/completions"
    params = CHAT_PARAMS
    usage_mark = CHAT_MARK
    read_usage = staticmethod(chat_usage)  # proxy.formats.usage
    tee = ChatReplyTee  # a chat.completion.chunk reader

    def parse(self, raw: bytes) -> Parsed:
        """The body, whose messages are already what memory reads."""
        body = parse_chat_body(raw)
        return Parsed(body, body["messages"])

    def inject(self, body: dict[str, Any], block: str, placement: str) -> dict[str, Any]:
        """`memory.inject` on the messages."""
        return {**body, "messages": inject(body["messages"], block, placement)}

    def place(self, body: dict[str, Any], placed: Sequence[Placed]) -> dict[str, Any]:
        """`memory.place` on the messages."""
        return {**body, "messages": place(body["messages"], placed)}

    def conversation(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The messages themselves."""
        return list(body["messages"])

    def compaction_shape(self, body: dict[str, Any]) -> Shape | None:
        """Roles, and each tool message paired with the assistant message that called it."""
        messages = body["messages"]
        calls = [(i, c.get("id")) for i, m in enumerate(messages)
                 for c in as_list(m.get("tool_calls")) if isinstance(c, dict)]
        results = [(i, m.get("tool_call_id")) for i, m in enumerate(messages) if m.get("role") == "tool"]
        return Shape([m.get("role") for m in messages], pairs_by_id(calls, results))

    def read_reply(self, body: dict[str, Any]) -> Reply:
        """Choice 0's content and tool calls, under the completion's id (a stored
        completion's owner is then known: proxy/access/ownership.py)."""
        reply_id = body.get("id")
        return Reply(reply_text(body), reply_id if isinstance(reply_id, str) and reply_id else None)

    def error_event(self, error: ProxyError, last_sent: bytes) -> bytes:
        """`event: error` with OpenAI's envelope, which the SDKs raise as APIError."""
        return sse_error_event(error)


CHAT = ChatFormat()

"""POST /v1/chat/completions: OpenAI's chat format in the shared flow (`proxy.flow.exchange`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memory import Placed, inject, place
from proxy.formats.base import ApiFormat, Parsed, Reply
from proxy.formats.chat_body import CHAT_PARAMS, parse_chat_body
from proxy.formats.shape import Shape, pairs_by_id
from proxy.formats.usage import CHAT_MARK, Seen, UsageTap, chat_usage
from proxy.http.errors import ProxyError, sse_error_event
from proxy.http.sse import ChatReplyTee, ReplyTee, reply_text
from proxy.upstream.client import Target, Upstream


class ChatFormat(ApiFormat):
    """Chat completions: memory goes into the system message or before the last user one."""

    route = "chat"
    continuable = False
    path = "/v1/chat/completions"
    params = CHAT_PARAMS

    def parse(self, raw: bytes) -> Parsed:
        """The body, whose messages are already what memory reads."""
        body = parse_chat_body(raw)
        return Parsed(body, body["messages"])

    def target(self, upstream: Upstream, model: str, headers: Mapping[str, str]) -> Target:
        """The model's route (the routing table, else the default upstream)."""
        return upstream.target_for(model)

    def inject(self, body: dict[str, Any], block: str, placement: str) -> dict[str, Any]:
        """`memory.inject` on the messages."""
        return {**body, "messages": inject(body["messages"], block, placement)}

    def first_placement(self, body: dict[str, Any], placement: str) -> str:
        """Where the flags say."""
        return placement

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
                 for c in _list(m.get("tool_calls")) if isinstance(c, dict)]
        results = [(i, m.get("tool_call_id")) for i, m in enumerate(messages) if m.get("role") == "tool"]
        return Shape([m.get("role") for m in messages], pairs_by_id(calls, results))

    def compacted(self, body: dict[str, Any], span: tuple[int, int], summary: str) -> dict[str, Any]:
        """The span becomes one system message holding the summary."""
        messages, (start, end) = body["messages"], span
        return {**body, "messages": [*messages[:start], {"role": "system", "content": summary},
                                     *messages[end:]]}

    def read_reply(self, body: dict[str, Any]) -> Reply:
        """Choice 0's content and tool calls, under the completion's id (a stored
        completion's owner is then known: proxy/access/ownership.py)."""
        reply_id = body.get("id")
        return Reply(reply_text(body), reply_id if isinstance(reply_id, str) and reply_id else None)

    def read_usage(self, payload: Mapping[str, Any]) -> Seen | None:
        """The tokens a reply or one of its stream's events reports (`proxy.formats.usage`)."""
        return chat_usage(payload)

    def usage_tap(self, *, strip: bool) -> UsageTap:
        """A reader of this format's streamed usage (`proxy.formats.usage`)."""
        return UsageTap(chat_usage, CHAT_MARK, strip=strip)

    def tee(self) -> ReplyTee:
        """A chat.completion.chunk reader."""
        return ChatReplyTee()

    def error_event(self, error: ProxyError, last_sent: bytes) -> bytes:
        """`event: error` with OpenAI's envelope, which the SDKs raise as APIError."""
        return sse_error_event(error)


CHAT = ChatFormat()


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []

"""The memory tool loop in chat completions (`proxy.flow.memory_tool.loop`): a function tool,
`tool_calls` answered by `tool` messages, and the stream's filter.

In a stream, content goes out as it arrives. Tool-call deltas, the finish chunk, the usage
chunk and `[DONE]` are held until the round ends, because a memory_search call may come
after a client call in the same turn: a round that searched drops what it held (the next
round goes on where it stopped); the last round sends it without memory_search's calls, the
client's calls numbered from 0, and usage summed over every round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import orjson

from proxy.flow.memory_tool.dialect import (
    DESCRIPTION,
    PARAMETERS,
    TOOL_NAME,
    Dialect,
    Payload,
    Search,
    StreamRound,
    add_usage,
    dicts,
    encoded,
    search_query,
)
from proxy.formats.base import as_dict, as_list
from proxy.http.sse import ServerSentEvent, encode


class ChatDialect(Dialect):
    """Chat completions' side of the tool loop."""

    tool: ClassVar[Payload] = {
        "type": "function",
        "function": {"name": TOOL_NAME, "description": DESCRIPTION, "parameters": PARAMETERS},
    }
    no_calls = "none"

    def refusal(self, body: Payload) -> str | None:
        """n > 1, legacy functions."""
        if body.get("n") not in (None, 1):
            return "tool mode needs n=1"
        if body.get("functions") is not None:
            return "the request uses the legacy functions field"
        return None

    def tool_name(self, tool: Any) -> Any:
        """The function's name."""
        return _name(tool)

    def last_round(self, body: Payload) -> Payload:
        """The client's own tools only."""
        return body

    def searches(self, reply: Payload) -> list[Search]:
        """Choice 0's memory_search calls."""
        return [Search(_str(c.get("id")), search_query(as_dict(c.get("function")).get("arguments")))
                for c in dicts(_message(reply).get("tool_calls")) if _name(c) == TOOL_NAME]

    def followup(self, reply: Payload, answers: Sequence[tuple[Search, str]]) -> list[Payload]:
        """The assistant message with memory_search's calls only, then a tool message each."""
        message = _message(reply)
        ours = [c for c in dicts(message.get("tool_calls")) if _name(c) == TOOL_NAME]
        said = {"role": "assistant", "content": message.get("content"), "tool_calls": ours}
        return [said, *({"role": "tool", "tool_call_id": search.id, "content": text}
                        for search, text in answers)]

    def without_ours(self, reply: Payload) -> Payload:
        """Choice 0 without memory_search's calls (finish_reason stop when none is left)."""
        calls = dicts(_message(reply).get("tool_calls"))
        if not calls:
            return reply
        theirs = [c for c in calls if _name(c) != TOOL_NAME]
        choices = list(reply["choices"])  # the calls came from choice 0's message
        message = {**choices[0]["message"]}
        choice = {**choices[0], "message": message}
        if theirs:
            message["tool_calls"] = theirs
        else:
            message.pop("tool_calls", None)
            if choice.get("finish_reason") == "tool_calls":
                choice["finish_reason"] = "stop"
        return {**reply, "choices": [choice, *choices[1:]]}

    def stream_round(self, previous: StreamRound | None, usage_before: Payload | None) -> ChatRound:
        """Rounds of a chat stream are independent: each starts its own chunks."""
        return ChatRound(usage_before)


class ChatRound(StreamRound):
    """Reads one round's chat.completion.chunk events; relays some, holds the rest."""

    def __init__(self, usage_before: Payload | None) -> None:
        super().__init__(usage_before)
        self.content = ""  # choice 0's text this round (already relayed)
        self.usage: Payload | None = None
        self._calls: dict[int, Payload] = {}  # index -> the call gathered from its deltas

    def _take(self, event: ServerSentEvent, payload: Payload | None) -> bytes:
        return self._hold(event, payload) if self._holds(event, payload) else encoded(event)

    def reply(self) -> Payload:
        """The round as a chat.completion: choice 0's text and tool calls, the usage."""
        message: Payload = {"role": "assistant", "content": self.content or None}
        if self._calls:
            message["tool_calls"] = [call for _, call in sorted(self._calls.items())]
        return {"choices": [{"index": 0, "message": message}], "usage": self.usage}

    def end(self) -> bytes:
        """The held events as the client gets them, once the round is the last."""
        usage_before = self.usage_before
        kept = sorted(i for i, call in self._calls.items() if _name(call) != TOOL_NAME)
        renumber = {old: new for new, old in enumerate(kept)}
        stripped = len(kept) < len(self._calls)
        out = []
        for event, payload in self._held:
            if payload is None or (not stripped and usage_before is None):
                out.append(encoded(event))
            elif (rewritten := _rewritten(payload, renumber, stripped, usage_before)) is not None:
                out.append(encode(orjson.dumps(rewritten)))
        return b"".join(out)

    def _holds(self, event: ServerSentEvent, payload: Payload | None) -> bool:
        if payload is None:
            return event.data.startswith("[DONE]")  # anything else that is not JSON: relayed
        if event.event == "error" or "error" in payload:
            return False
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choice = _choice0(payload)
        if choice is None:
            return isinstance(usage, dict)  # the usage chunk, after the finish
        delta = as_dict(choice.get("delta"))
        if isinstance(delta.get("content"), str):
            self.content += delta["content"]
        calls = as_list(delta.get("tool_calls"))
        for call in calls:
            self._gather(as_dict(call))
        return bool(calls) or bool(choice.get("finish_reason"))

    def _gather(self, delta: Payload) -> None:
        call = self._calls.setdefault(_index(delta), {
            "id": "", "type": "function", "function": {"name": "", "arguments": ""},
        })
        if isinstance(delta.get("id"), str):
            call["id"] = delta["id"]
        function = as_dict(delta.get("function"))
        for key in ("name", "arguments"):
            if isinstance(function.get(key), str):
                call["function"][key] += function[key]


def _rewritten(
    payload: Payload, renumber: dict[int, int], stripped: bool, usage_before: Payload | None
) -> Payload | None:
    """A held chunk without memory_search's calls (None when nothing is left of it)."""
    out = {**payload}
    if isinstance(payload.get("usage"), dict):
        out["usage"] = add_usage(usage_before, payload["usage"])
    choice = _choice0(payload)
    if choice is None or not stripped:
        return out
    choice = {**choice}
    delta = {**as_dict(choice.get("delta"))}
    if "tool_calls" in delta:
        calls = [
            {**call, "index": renumber[index]}
            for call in as_list(delta["tool_calls"])
            if (index := _index(call)) in renumber
        ]
        if calls:
            delta["tool_calls"] = calls
        else:
            del delta["tool_calls"]
            if not delta.get("content") and not choice.get("finish_reason"):
                return None  # only memory_search was in this chunk
    if choice.get("finish_reason") == "tool_calls" and not renumber:
        choice["finish_reason"] = "stop"
    choice["delta"] = delta
    out["choices"] = [choice, *payload["choices"][1:]]
    return out


def _choice0(payload: Payload) -> Payload | None:
    first = (as_list(payload.get("choices")) or [None])[0]
    return first if isinstance(first, dict) and first.get("index", 0) == 0 else None


def _index(call: Any) -> int:
    index = as_dict(call).get("index", 0)
    return index if isinstance(index, int) else 0


def _message(reply: Payload) -> Payload:
    """Choice 0's message ({} when the reply has none)."""
    first = (as_list(reply.get("choices")) or [None])[0]
    return as_dict(as_dict(first).get("message"))


def _name(tool_or_call: Any) -> str | None:
    """The function name of a tool definition or a tool call."""
    name = as_dict(as_dict(tool_or_call).get("function")).get("name")
    return name if isinstance(name, str) else None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""

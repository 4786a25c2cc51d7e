"""One round of the memory tool loop's stream (`proxy.memory_tool`), on its way to the client.

Content goes out as it arrives. Tool-call deltas, the finish chunk, the usage chunk and
`[DONE]` are held until the round ends, because a memory_search call may come after a client
call in the same turn: a round that searched drops what it held (the next round goes on
where it stopped); the last round sends it without memory_search's calls, the client's
calls numbered from 0, and usage summed over every round.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.sse import ServerSentEvent, SSEDecoder

Payload = dict[str, Any]


class RoundFilter:
    """Reads one round's chat.completion.chunk events; relays some, holds the rest."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name
        self.content = ""  # choice 0's text this round (already relayed)
        self.usage: Payload | None = None
        self._decoder = SSEDecoder()
        self._held: list[tuple[ServerSentEvent, Payload | None]] = []
        self._calls: dict[int, Payload] = {}  # index -> the call gathered from its deltas

    def feed(self, chunk: bytes) -> bytes:
        """Take upstream bytes; return the whole events that go to the client now."""
        out = []
        for event in self._decoder.feed(chunk):
            payload = _payload(event)
            if self._holds(event, payload):
                self._held.append((event, payload))
            else:
                out.append(_encoded(event))
        return b"".join(out)

    def ours(self) -> list[Payload]:
        """The round's memory_search calls, in order, in the chat message shape."""
        return [call for _, call in sorted(self._calls.items()) if self._is_ours(call)]

    def end(self, usage_before: Payload | None) -> bytes:
        """The held events as the client gets them, once the round is the last."""
        kept = sorted(i for i, call in self._calls.items() if not self._is_ours(call))
        renumber = {old: new for new, old in enumerate(kept)}
        stripped = len(kept) < len(self._calls)
        out = []
        for event, payload in self._held:
            if payload is None or (not stripped and usage_before is None):
                out.append(_encoded(event))
            elif (rewritten := _rewritten(payload, renumber, stripped, usage_before)) is not None:
                out.append(b"data: " + orjson.dumps(rewritten) + b"\n\n")
        return b"".join(out)

    def _is_ours(self, call: Payload) -> bool:
        return bool(call["function"]["name"] == self.tool_name)

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
        delta = _dict(choice.get("delta"))
        if isinstance(delta.get("content"), str):
            self.content += delta["content"]
        calls = _list(delta.get("tool_calls"))
        for call in calls:
            self._gather(_dict(call))
        return bool(calls) or bool(choice.get("finish_reason"))

    def _gather(self, delta: Payload) -> None:
        index = delta.get("index", 0)
        call = self._calls.setdefault(index if isinstance(index, int) else 0, {
            "id": "", "type": "function", "function": {"name": "", "arguments": ""},
        })
        if isinstance(delta.get("id"), str):
            call["id"] = delta["id"]
        function = _dict(delta.get("function"))
        for key in ("name", "arguments"):
            if isinstance(function.get(key), str):
                call["function"][key] += function[key]


def add_usage(before: Payload | None, usage: Any) -> Payload | None:
    """Token usage of two rounds together (the counts summed, the rest as the later says)."""
    if not isinstance(usage, dict):
        return before
    if before is None:
        return usage
    summed = {**usage}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(before.get(key), int) and isinstance(usage.get(key), int):
            summed[key] = before[key] + usage[key]
    return summed


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
    delta = {**_dict(choice.get("delta"))}
    if "tool_calls" in delta:
        calls = [
            {**call, "index": renumber[index]}
            for call in _list(delta["tool_calls"])
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


def _encoded(event: ServerSentEvent) -> bytes:
    """One event as SSE bytes (chat completion chunks carry no ids)."""
    lines = [f"event: {event.event}"] if event.event is not None else []
    lines += [f"data: {line}" for line in event.data.split("\n")]
    return ("\n".join(lines) + "\n\n").encode()


def _payload(event: ServerSentEvent) -> Payload | None:
    try:
        value = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _choice0(payload: Payload) -> Payload | None:
    choices = payload.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) and first.get("index", 0) == 0 else None


def _index(call: Any) -> int:
    index = _dict(call).get("index", 0)
    return index if isinstance(index, int) else 0


def _dict(value: Any) -> Payload:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []

"""The memory tool loop in OpenAI's Responses API (`proxy.flow.memory_tool.loop`): a function tool,
and `function_call` output items answered by `function_call_output` input items.

Each round is a response of its own, and the client must get the last one's id: that is the
response whose stored context holds the answered searches, so a request continuing from it
(`previous_response_id`) goes on where the loop ended. A stream announces its id in its first
event, and the SDKs refuse a stream whose id changes, so a streamed round is held until its
first output item shows what it is: memory_search (or reasoning before it) and the round is
held to its end, answered and dropped; anything else and the round is the one the client
gets, relayed from its first event on. A search asked for after that point is dropped, as in
the last round, and the items after it are numbered on without it.

Like Messages, the last round keeps memory_search defined (its calls are in the input), with
`tool_choice: none` when the client has no tools of its own, and a call to it there is
dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from proxy.flow.memory_tool.dialect import (
    DESCRIPTION,
    PARAMETERS,
    TOOL_NAME,
    Search,
    add_usage,
    search_query,
)
from proxy.http.sse import ServerSentEvent, SSEDecoder, encode, event_payload

Payload = dict[str, Any]
TOOL: Payload = {"type": "function", "name": TOOL_NAME, "description": DESCRIPTION,
                 "parameters": PARAMETERS}


class ResponsesDialect:
    """The Responses API's side of the tool loop."""

    def unsupported(self, body: Payload) -> str | None:
        """Tools that are not a list or hold a memory_search, `tool_choice: none` and
        background responses."""
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return "tools is not an array"
        if any(isinstance(t, dict) and t.get("name") == TOOL_NAME for t in tools or ()):
            return f"the request has its own {TOOL_NAME} tool"
        if body.get("tool_choice") == "none":
            return "tool_choice is none"
        if body.get("background") is True:
            return "background responses are not awaited"
        return None

    def items(self, body: Payload) -> list[Any]:
        """`input`, a string read as one user message."""
        given = body.get("input")
        if isinstance(given, str):
            return [{"role": "user", "content": given}]
        return list(given or [])

    def with_items(self, body: Payload, items: list[Any]) -> Payload:
        """`input` replaced."""
        return {**body, "input": items}

    def offer(self, body: Payload) -> Payload:
        """memory_search after the client's tools."""
        return {**body, "tools": [*(body.get("tools") or ()), TOOL]}

    def last_round(self, body: Payload) -> Payload:
        """Still defined (the input holds its calls), not to be called."""
        if body.get("tools") or "tool_choice" in body:
            return self.offer(body)
        return {**self.offer(body), "tool_choice": "none"}

    def searches(self, reply: Payload) -> list[Search]:
        """The response's memory_search function calls."""
        return [Search(str(item.get("call_id") or ""), search_query(item.get("arguments")))
                for item in _output(reply) if _ours(item)]

    def followup(self, reply: Payload, answers: Sequence[tuple[Search, str]]) -> list[Payload]:
        """The output items without the client's function calls, then the outputs."""
        kept = [item for item in _output(reply) if item.get("type") != "function_call" or _ours(item)]
        return [*kept, *({"type": "function_call_output", "call_id": search.id, "output": text}
                         for search, text in answers)]

    def final(self, reply: Payload, usage_before: Payload | None) -> Payload:
        """The response without memory_search's calls, usage of every round."""
        out = {**reply}
        if isinstance(reply.get("usage"), dict) and usage_before is not None:
            out["usage"] = add_usage(usage_before, reply["usage"])
        if any(_ours(item) for item in _output(reply)):
            out["output"] = [item for item in _output(reply) if not _ours(item)]
        return out

    def usage(self, reply: Payload) -> Any:
        """The response's usage."""
        return reply.get("usage")

    def stream_round(self, previous: Any, usage_before: Payload | None) -> ResponsesRound:
        """The next round: a response of its own, so nothing carries over but the usage."""
        return ResponsesRound(usage_before)


# The events that end a response, carrying it whole.
_ENDS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesRound:
    """Reads one round's Responses events: held until an output item shows what the round
    is, then relayed without memory_search's items."""

    def __init__(self, usage_before: Payload | None) -> None:
        self.usage_before = usage_before
        self._decoder = SSEDecoder()
        self._held: list[tuple[ServerSentEvent, Payload | None]] = []
        self._relaying = False
        self._response: Payload = {}  # the latest whole response an event carried
        self._items: dict[int, Payload] = {}  # output index -> the item as last sent
        self._ours: list[int] = []  # output indexes of memory_search calls, ascending
        self._sequence = 0  # the client's number for the next event

    def feed(self, chunk: bytes) -> bytes:
        """Take upstream bytes; return the whole events that go to the client now."""
        out = []
        for event in self._decoder.feed(chunk):
            payload = event_payload(event)
            if payload is not None:
                self._read(payload)
            if not self._relaying and payload is not None and self._answers(payload):
                self._relaying = True
                out += [self._relayed(e, p) for e, p in self._held]
                self._held = []
            if self._relaying:
                out.append(self._relayed(event, payload))
            else:
                self._held.append((event, payload))
        return b"".join(out)

    def reply(self) -> Payload:
        """The round as a whole response; once relayed, without memory_search calls (the
        client has this round's id: it is the last)."""
        output = [item for _, item in sorted(self._items.items())]
        whole = {**self._response}
        if not isinstance(whole.get("output"), list) or len(whole["output"]) < len(output):
            whole["output"] = output
        if self._relaying:
            whole["output"] = [item for item in _output(whole) if not _ours(item)]
        return whole

    def end(self) -> bytes:
        """The events held back, as the client gets them when this round is the last."""
        out = b"".join(self._relayed(e, p) for e, p in self._held)
        self._held = []
        return out

    def _read(self, payload: Payload) -> None:
        response, index, item = payload.get("response"), payload.get("output_index"), payload.get("item")
        if isinstance(response, dict):
            self._response = response
        if isinstance(index, int) and isinstance(item, dict):
            self._items[index] = item
            if _ours(item) and index not in self._ours:
                self._ours.append(index)

    def _answers(self, payload: Payload) -> bool:
        """Whether this event shows the round answering rather than searching: an output
        item that is not reasoning, before any memory_search call."""
        item = payload.get("item")
        return (payload.get("type") == "response.output_item.added" and isinstance(item, dict)
                and item.get("type") != "reasoning" and not _ours(item) and not self._ours)

    def _relayed(self, event: ServerSentEvent, payload: Payload | None) -> bytes:
        """One event as the client gets it: memory_search's dropped, the rest numbered on."""
        if payload is None:
            return encode(event.data, event.event)
        index = payload.get("output_index")
        if isinstance(index, int) and index in self._ours:
            return b""
        out = payload
        if isinstance(index, int) and (before := sum(i < index for i in self._ours)):
            out = {**out, "output_index": index - before}
        if payload.get("type") in _ENDS and isinstance(payload.get("response"), dict):
            if (final := self._final(payload["response"])) is not payload["response"]:
                out = {**out, "response": final}
        if isinstance(payload.get("sequence_number"), int):
            if payload["sequence_number"] != self._sequence:
                out = {**out, "sequence_number": self._sequence}
            self._sequence += 1
        if out is payload:
            return encode(event.data, event.event)
        return encode(orjson.dumps(out), event.event)

    def _final(self, response: Payload) -> Payload:
        """The ending response without memory_search's calls, with every round's usage (the
        same object when there is nothing to change)."""
        if self.usage_before is None and not any(map(_ours, _output(response))):
            return response
        out = {**response}
        if any(map(_ours, _output(response))):
            out["output"] = [item for item in _output(response) if not _ours(item)]
        if self.usage_before is not None and isinstance(response.get("usage"), dict):
            out["usage"] = add_usage(self.usage_before, response["usage"])
        return out


def _output(reply: Payload) -> list[Payload]:
    output = reply.get("output")
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []


def _ours(item: Payload) -> bool:
    return item.get("type") == "function_call" and item.get("name") == TOOL_NAME


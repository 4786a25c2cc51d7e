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
from typing import Any, ClassVar

from proxy.flow.memory_tool.dialect import (
    DESCRIPTION,
    PARAMETERS,
    TOOL_NAME,
    Dialect,
    Payload,
    Search,
    StreamRound,
    dicts,
    encoded,
    reencoded,
    search_query,
)
from proxy.formats.responses import input_items
from proxy.http.sse import ServerSentEvent


class ResponsesDialect(Dialect):
    """The Responses API's side of the tool loop."""

    tool: ClassVar[Payload] = {"type": "function", "name": TOOL_NAME, "description": DESCRIPTION,
                               "parameters": PARAMETERS}
    field = "input"
    no_calls = "none"

    def refusal(self, body: Payload) -> str | None:
        """Background responses."""
        if body.get("background") is True:
            return "background responses are not awaited"
        return None

    def items(self, body: Payload) -> list[Any]:
        """`input`, a string read as one user message."""
        return input_items(body.get("input"))

    def searches(self, reply: Payload) -> list[Search]:
        """The response's memory_search function calls."""
        return [Search(str(item.get("call_id") or ""), search_query(item.get("arguments")))
                for item in dicts(reply.get("output")) if _ours(item)]

    def followup(self, reply: Payload, answers: Sequence[tuple[Search, str]]) -> list[Payload]:
        """The output items without the client's function calls, then the outputs."""
        kept = [item for item in dicts(reply.get("output"))
                if item.get("type") != "function_call" or _ours(item)]
        return [*kept, *({"type": "function_call_output", "call_id": search.id, "output": text}
                         for search, text in answers)]

    def without_ours(self, reply: Payload) -> Payload:
        """The response without memory_search's calls."""
        output = dicts(reply.get("output"))
        if not any(_ours(item) for item in output):
            return reply
        return {**reply, "output": [item for item in output if not _ours(item)]}

    def stream_round(self, previous: StreamRound | None, usage_before: Payload | None) -> ResponsesRound:
        """The next round: a response of its own, so nothing carries over but the usage."""
        return ResponsesRound(self, usage_before)


# The events that end a response, carrying it whole.
_ENDS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesRound(StreamRound):
    """Reads one round's Responses events: held until an output item shows what the round
    is, then relayed without memory_search's items."""

    def __init__(self, dialect: ResponsesDialect, usage_before: Payload | None) -> None:
        super().__init__(usage_before)
        self._dialect = dialect
        self._relaying = False
        self._response: Payload = {}  # the latest whole response an event carried
        self._items: dict[int, Payload] = {}  # output index -> the item as last sent
        self._ours: list[int] = []  # output indexes of memory_search calls, ascending
        self._sequence = 0  # the client's number for the next event

    def _take(self, event: ServerSentEvent, payload: Payload | None) -> bytes:
        out = []
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
        return self._dialect.without_ours(whole) if self._relaying else whole

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
            return encoded(event)
        index = payload.get("output_index")
        if isinstance(index, int) and index in self._ours:
            return b""
        out = payload
        if isinstance(index, int) and (before := sum(i < index for i in self._ours)):
            out = {**out, "output_index": index - before}
        if payload.get("type") in _ENDS and isinstance(payload.get("response"), dict):
            if (final := self._dialect.final(payload["response"], self.usage_before)) is not payload["response"]:
                out = {**out, "response": final}
        if isinstance(payload.get("sequence_number"), int):
            if payload["sequence_number"] != self._sequence:
                out = {**out, "sequence_number": self._sequence}
            self._sequence += 1
        if out is payload:
            return encoded(event)
        return reencoded(event, out)


def _ours(item: Payload) -> bool:
    return item.get("type") == "function_call" and item.get("name") == TOOL_NAME


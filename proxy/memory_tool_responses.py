"""The memory tool loop in OpenAI's Responses API (`proxy.memory_tool`): a function tool,
and `function_call` output items answered by `function_call_output` input items.

Whole responses only. Each round is a response of its own, and the client must get the last
one's id: that is the response whose stored context holds the answered searches, so a
request continuing from it (`previous_response_id`) goes on where the loop ended. A stream
announces its id in its first event, before anyone knows which round is the last, and the
SDKs refuse a stream whose id changes; streamed requests get the normal injection.

Like Messages, the last round keeps memory_search defined (its calls are in the input), with
`tool_choice: none` when the client has no tools of its own, and a call to it there is
dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.memory_tool_dialect import (
    DESCRIPTION,
    PARAMETERS,
    TOOL_NAME,
    Search,
    add_usage,
    search_query,
)

Payload = dict[str, Any]
TOOL: Payload = {"type": "function", "name": TOOL_NAME, "description": DESCRIPTION,
                 "parameters": PARAMETERS}


class ResponsesDialect:
    """The Responses API's side of the tool loop."""

    def unsupported(self, body: Payload) -> str | None:
        """Tools that are not a list or hold a memory_search, `tool_choice: none`,
        background and streamed responses."""
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return "tools is not an array"
        if any(isinstance(t, dict) and t.get("name") == TOOL_NAME for t in tools or ()):
            return f"the request has its own {TOOL_NAME} tool"
        if body.get("tool_choice") == "none":
            return "tool_choice is none"
        if body.get("background") is True:
            return "background responses are not awaited"
        if body.get("stream") is True:
            return "a streamed response keeps its first round's id"
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


def _output(reply: Payload) -> list[Payload]:
    output = reply.get("output")
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []


def _ours(item: Payload) -> bool:
    return item.get("type") == "function_call" and item.get("name") == TOOL_NAME


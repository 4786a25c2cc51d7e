"""Memory as a tool (`X-Memory-Mode: tool`): the model searches memory when it needs to.

A small block is pre-fetched into the prompt (`memory_tool_prefetch` tokens) and a
`memory_search` function tool is added to the request's tools. When the model calls it,
memproxy runs recall for the call's query (the request's user, session and scope, the
request's budget) and sends the answer upstream itself: a server-side tool loop of at most
`memory_tool_rounds` rounds, after which the tool is no longer offered. The client never
sees the tool, in a whole reply or in a stream; its own tools go through as before.

A turn that calls memory_search and a client tool together: every call of an assistant
message must be answered before the model goes on, and only the client can answer its own.
So memory_search is answered first and the client's calls of that turn are withheld; the
model, now holding what memory found, makes its next move (usually the same call again,
which then reaches the client).

Chat completions only: other formats, and chat requests the loop cannot serve (n > 1, a
client tool of the same name, `tool_choice: none`), get the normal injection, and the
`X-Memory-Mode` response header says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from config import Flags
from memory import MemoryEngine, RecallRequest
from proxy.memory_tool_stream import RoundFilter, add_usage
from proxy.upstream import UpstreamHeaders, UpstreamReply
from proxy.upstream import read_body as read_upstream_body

if TYPE_CHECKING:
    from proxy.exchange import Call
    from proxy.memory_step import MemoryStep
    from proxy.state import AppState

TOOL_NAME = "memory_search"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Search long-term memory of earlier conversations with this user: facts, "
            "preferences, decisions and past messages. Use it when the answer may depend on "
            "something said before that is not in this conversation or the recalled context."
        ),
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to look for."}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
# Parallel calls answered in one round; a model that asks for more gets this many.
MAX_SEARCHES_PER_ROUND = 4
NO_MATCH = "Nothing in memory matched this query."
FAILED = "Memory search failed; answer without it."
BAD_CALL = 'memory_search takes a JSON object with a string "query".'
SKIPPED = f"Not searched: at most {MAX_SEARCHES_PER_ROUND} memory searches per turn."

# Sends one round upstream: the body's bytes and the body.
Send = Callable[[bytes, dict[str, Any]], Awaitable[UpstreamReply]]


@dataclasses.dataclass
class MemoryTool:
    """The tool loop of one chat request."""

    memory: MemoryEngine
    budget: int  # each search's budget (X-Memory-Budget)
    rounds: int
    prefetch: Flags  # the request's flags with the pre-fetched block's budget
    headers: dict[str, str]  # the request's response headers
    searches: int = 0

    @classmethod
    def plan(cls, state: AppState, call: Call) -> MemoryTool | None:
        """The loop when tool mode serves `call`; a request that asked for the tool and
        cannot have it gets injection, and `X-Memory-Mode` says why."""
        flags, memory = call.flags, state.memory
        if flags.mode != "tool" or not flags.read or memory is None:
            return None
        reason = _unsupported(call)
        if reason is not None:
            call.headers["X-Memory-Mode"] = f"inject ({reason})"
            return None
        call.headers["X-Memory-Mode"] = "tool"
        settings = state.settings
        prefetch = dataclasses.replace(flags, budget=min(flags.budget, settings.memory_tool_prefetch))
        return cls(memory, flags.budget, settings.memory_tool_rounds, prefetch, call.headers)

    async def open(self, send: Send, body: dict[str, Any], step: MemoryStep) -> UpstreamReply:
        """The reply the client gets: the last round's, with memory_search taken out."""
        first = await self._send(send, body, list(body["messages"]), offer=True)
        if first.headers.get("content-type", "").startswith("text/event-stream"):
            return _Rounds(self, send, body, step, first)
        return await self._whole(send, body, step, first)

    async def _send(
        self, send: Send, body: dict[str, Any], messages: list[Any], *, offer: bool
    ) -> UpstreamReply:
        out = {**body, "messages": messages}
        if offer:
            out["tools"] = [*(body.get("tools") or ()), TOOL]
        return await send(orjson.dumps(out), out)

    async def _whole(
        self, send: Send, body: dict[str, Any], step: MemoryStep, reply: UpstreamReply
    ) -> UpstreamReply:
        messages = list(body["messages"])
        usage: dict[str, Any] | None = None  # of the rounds before this one
        for round_ in range(self.rounds + 1):
            if round_:
                reply = await self._send(send, body, messages, offer=round_ < self.rounds)
            try:
                content = await read_upstream_body(reply)
            finally:
                await reply.aclose()
            completion = _json(content)
            if reply.status_code >= 300 or completion is None:
                return _WholeReply(reply, content)  # exchange reports what is wrong with it
            message = _message(completion)
            calls = _calls(message)
            ours = [c for c in calls if _name(c) == TOOL_NAME]
            if not ours or round_ == self.rounds:
                self.headers["X-Memory-Tool-Searches"] = str(self.searches)
                if not ours and usage is None:
                    return _WholeReply(reply, content)  # untouched: the client's bytes
                return _WholeReply(reply, orjson.dumps(_final(completion, calls, usage)))
            messages += await self.answer(message.get("content"), ours, messages, step)
            usage = add_usage(usage, completion.get("usage"))
        raise AssertionError("unreachable")  # the last round returns

    async def answer(
        self, content: Any, ours: list[dict[str, Any]], messages: list[Any], step: MemoryStep
    ) -> list[dict[str, Any]]:
        """The assistant message of a round that searched, then one tool message per call."""
        said = {"role": "assistant", "content": content, "tool_calls": ours}
        answers = [
            {"role": "tool", "tool_call_id": call.get("id"),
             "content": await self._search(call, messages, step) if i < MAX_SEARCHES_PER_ROUND else SKIPPED}
            for i, call in enumerate(ours)
        ]
        return [said, *answers]

    async def _search(self, call: Mapping[str, Any], messages: list[Any], step: MemoryStep) -> str:
        """Recall for one call's query, as the tool's answer (never raises)."""
        query = _query(call)
        if query is None:
            return BAD_CALL
        self.searches += 1
        counted = step.state.metrics.memory_tool_searches
        # The conversation as sent so far (pre-fetched block and earlier answers included):
        # recall leaves out what it already holds.
        asked = [*step.context, *messages, {"role": "user", "content": query}]
        try:
            recalled = await self.memory.recall(RecallRequest(
                step.identity.user_id, step.identity.session_id, asked, step.model,
                self.budget, step.flags.scope,
            ))
        except Exception as exc:  # memory never breaks the chat: the model goes on without it
            step.failed(TOOL_NAME, exc)
            counted.labels("failed").inc()
            return FAILED
        counted.labels("found" if recalled.block else "nothing").inc()
        return recalled.block or NO_MATCH


class _Rounds:
    """A streamed reply over the loop's rounds: each round's events go to the client as they
    come, except memory_search's calls and the ends of rounds that searched."""

    def __init__(
        self, tool: MemoryTool, send: Send, body: dict[str, Any], step: MemoryStep,
        first: UpstreamReply,
    ) -> None:
        self.status_code = first.status_code
        self.headers = first.headers
        self._tool, self._send, self._body, self._step = tool, send, body, step
        self._current = first

    async def aiter_raw(self) -> Any:
        tool = self._tool
        messages = list(self._body["messages"])
        usage: dict[str, Any] | None = None
        for round_ in range(tool.rounds + 1):
            if round_:
                await self._current.aclose()
                self._current = await tool._send(
                    self._send, self._body, messages, offer=round_ < tool.rounds
                )
            events = RoundFilter(TOOL_NAME)
            async for chunk in self._current.aiter_raw():
                if relayed := events.feed(chunk):
                    yield relayed
            ours = events.ours()
            if not ours or round_ == tool.rounds:
                if end := events.end(usage):
                    yield end
                return
            messages += await tool.answer(events.content or None, ours, messages, self._step)
            usage = add_usage(usage, events.usage)

    async def aclose(self) -> None:
        await self._current.aclose()


class _WholeReply:
    """A whole reply already read: its status and headers, and the body the client gets."""

    def __init__(self, reply: UpstreamReply, content: bytes) -> None:
        self.status_code: int = reply.status_code
        self.headers: UpstreamHeaders = reply.headers
        self._content = content

    async def aiter_raw(self) -> Any:
        yield self._content

    async def aclose(self) -> None:
        return None


def _unsupported(call: Call) -> str | None:
    """Why the tool loop cannot serve this request (None: it can)."""
    body = call.body
    if call.fmt.route != "chat":
        return f"tool mode serves chat completions only, not {call.fmt.path}"
    if body.get("n") not in (None, 1):
        return "tool mode needs n=1"
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return "tools is not an array"
    if any(_name(t) == TOOL_NAME for t in tools or ()):
        return f"the request has its own {TOOL_NAME} tool"
    if body.get("functions") is not None:
        return "the request uses the legacy functions field"
    if body.get("tool_choice") == "none":
        return "tool_choice is none"
    return None


def _final(
    completion: dict[str, Any], calls: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """The last round's completion without memory_search calls, usage over every round."""
    out = {**completion}
    if isinstance(completion.get("usage"), dict) and usage is not None:
        out["usage"] = add_usage(usage, completion["usage"])
    if not calls:
        return out
    theirs = [c for c in calls if _name(c) != TOOL_NAME]
    choices = list(completion["choices"])  # calls came from choice 0's message
    message = {**choices[0]["message"]}
    choice = {**choices[0], "message": message}
    if theirs:
        message["tool_calls"] = theirs
    else:
        message.pop("tool_calls", None)
        if choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "stop"
    out["choices"] = [choice, *choices[1:]]
    return out


def _json(content: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _message(completion: dict[str, Any]) -> dict[str, Any]:
    """Choice 0's message ({} when the reply has none)."""
    choices = completion.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    return message if isinstance(message, dict) else {}


def _calls(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls")
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def _name(tool_or_call: Any) -> str | None:
    """The function name of a tool definition or a tool call."""
    function = tool_or_call.get("function") if isinstance(tool_or_call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _query(call: Mapping[str, Any]) -> str | None:
    """A memory_search call's query (None when its arguments do not hold one)."""
    function = call.get("function")
    arguments = function.get("arguments") if isinstance(function, dict) else None
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str) else None
    except orjson.JSONDecodeError:
        return None
    query = parsed.get("query") if isinstance(parsed, dict) else None
    return query.strip() or None if isinstance(query, str) else None

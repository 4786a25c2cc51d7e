"""Memory as a tool (`X-Memory-Mode: tool`): the model searches memory when it needs to.

A small block is pre-fetched into the prompt (`memory_tool_prefetch` tokens) and a
`memory_search` tool is added to the request's tools. When the model calls it, memproxy runs
recall for the call's query (the request's user, session and scope, the request's budget)
and sends the answer upstream itself: a server-side tool loop of at most
`memory_tool_rounds` rounds, after which the tool is no longer offered. The client never
sees the tool, in a whole reply or in a stream; its own tools go through as before.

A turn that calls memory_search and a client tool together: every call of an assistant
turn must be answered before the model goes on, and only the client can answer its own.
So memory_search is answered first and the client's calls of that turn are withheld; the
model, now holding what memory found, makes its next move (usually the same call again,
which then reaches the client).

Each API format speaks the loop in its own dialect (how the tool is offered, how calls and
answers look, how a stream is filtered): chat completions (`proxy.flow.memory_tool.chat`),
Anthropic Messages (`proxy.flow.memory_tool.messages`) and Responses
(`proxy.flow.memory_tool.responses`). A request its dialect cannot serve (n > 1, a client tool of
the same name, `tool_choice: none`, ...) gets the normal injection, and the `X-Memory-Mode`
response header says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from config import Flags
from memory import MemoryEngine, RecallRequest, trace_span
from proxy.flow.memory_tool.chat import ChatDialect
from proxy.flow.memory_tool.dialect import (
    TOOL_NAME,
    Dialect,
    Search,
    StreamRound,
    add_usage,
)
from proxy.flow.memory_tool.messages import MessagesDialect
from proxy.flow.memory_tool.responses import ResponsesDialect
from proxy.http.sse import json_object
from proxy.upstream.client import UpstreamHeaders, UpstreamReply
from proxy.upstream.client import read_body as read_upstream_body

if TYPE_CHECKING:
    from proxy.flow.call import Call
    from proxy.flow.memory_step import MemoryStep
    from proxy.state import AppState

# Parallel calls answered in one round; a model that asks for more gets this many.
MAX_SEARCHES_PER_ROUND = 4
NO_MATCH = "Nothing in memory matched this query."
FAILED = "Memory search failed; answer without it."
BAD_CALL = 'memory_search takes a JSON object with a string "query".'
SKIPPED = f"Not searched: at most {MAX_SEARCHES_PER_ROUND} memory searches per turn."
# Every API format's, by route.
DIALECTS: dict[str, Dialect] = {
    "chat": ChatDialect(), "messages": MessagesDialect(), "responses": ResponsesDialect(),
}

# Sends one round upstream: the body's bytes and the body.
Send = Callable[[bytes, dict[str, Any]], Awaitable[UpstreamReply]]
# A format's reading of a body as chat messages (`ApiFormat.conversation`).
Conversation = Callable[[dict[str, Any]], list[dict[str, Any]]]


@dataclasses.dataclass
class MemoryTool:
    """The tool loop of one request."""

    memory: MemoryEngine
    dialect: Dialect
    conversation: Conversation
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
        dialect = DIALECTS[call.fmt.route]
        reason = dialect.unsupported(call.body)
        if reason is not None:
            call.headers["X-Memory-Mode"] = f"inject ({reason})"
            return None
        call.headers["X-Memory-Mode"] = "tool"
        settings = state.settings
        prefetch = dataclasses.replace(flags, budget=min(flags.budget, settings.memory_tool_prefetch))
        return cls(memory, dialect, call.fmt.conversation, flags.budget,
                   settings.memory_tool_rounds, prefetch, call.headers)

    async def open(self, send: Send, body: dict[str, Any], step: MemoryStep) -> UpstreamReply:
        """The reply the client gets: the last round's, with memory_search taken out."""
        first = await self._send(send, body, self.dialect.items(body), offer=True)
        streamed = first.headers.get("content-type", "").startswith("text/event-stream")
        if streamed:
            return _Rounds(self, self.dialect, send, body, step, first)
        return await self._whole(send, body, step, first)

    def _body(self, body: dict[str, Any], messages: list[Any], *, offer: bool) -> dict[str, Any]:
        out = self.dialect.with_items(body, messages)
        return self.dialect.offer(out) if offer else self.dialect.last_round(out)

    async def _send(
        self, send: Send, body: dict[str, Any], messages: list[Any], *, offer: bool
    ) -> UpstreamReply:
        out = self._body(body, messages, offer=offer)
        return await send(orjson.dumps(out), out)

    async def _whole(
        self, send: Send, body: dict[str, Any], step: MemoryStep, reply: UpstreamReply
    ) -> UpstreamReply:
        messages = self.dialect.items(body)
        usage: dict[str, Any] | None = None  # of the rounds before this one
        for round_ in range(self.rounds + 1):
            if round_:
                reply = await self._send(send, body, messages, offer=round_ < self.rounds)
            content = await read_upstream_body(reply)  # and released
            whole = json_object(content)
            if reply.status_code >= 300 or whole is None:
                return _WholeReply(reply, content)  # exchange reports what is wrong with it
            ours = self.dialect.searches(whole)
            if not ours or round_ == self.rounds:
                self.headers["X-Memory-Tool-Searches"] = str(self.searches)
                if not ours and usage is None:
                    return _WholeReply(reply, content)  # untouched: the upstream's bytes
                return _WholeReply(reply, orjson.dumps(self.dialect.final(whole, usage)))
            messages += await self.answer(whole, ours, body, messages, step)
            usage = add_usage(usage, whole.get("usage"))
        raise AssertionError("unreachable")  # the last round returns

    async def answer(
        self, reply: dict[str, Any], ours: Sequence[Search], body: dict[str, Any],
        messages: list[Any], step: MemoryStep,
    ) -> list[dict[str, Any]]:
        """The messages that go on from a round that searched: its turn and the answers."""
        sent = self.conversation(self._body(body, messages, offer=False))
        answers = [
            await self._search(search.query, sent, step) if i < MAX_SEARCHES_PER_ROUND else SKIPPED
            for i, search in enumerate(ours)
        ]
        return self.dialect.followup(reply, list(zip(ours, answers, strict=True)))

    async def _search(
        self, query: str | None, sent: list[dict[str, Any]], step: MemoryStep
    ) -> str:
        """Recall for one call's query, as the tool's answer (never raises)."""
        if query is None:
            return BAD_CALL
        self.searches += 1
        counted = step.state.metrics.memory_tool_searches
        # The conversation as sent so far (pre-fetched block and earlier answers included):
        # recall leaves out what it already holds.
        asked = [*step.context, *sent, {"role": "user", "content": query}]
        try:
            # Its recall's spans go under the round's (docs/tracing.md).
            with trace_span("memproxy.memory_tool.search", {"memproxy.memory_tool.search": self.searches}):
                recalled = await self.memory.recall(RecallRequest(
                    step.identity.user_id, step.identity.session_id, asked, step.model,
                    self.budget, step.flags.scope, org_id=step.identity.org_id,
                    rerank=step.flags.rerank,
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
        self, tool: MemoryTool, dialect: Dialect, send: Send, body: dict[str, Any],
        step: MemoryStep, first: UpstreamReply,
    ) -> None:
        self.status_code = first.status_code
        self.headers = first.headers
        self._tool, self._dialect, self._send, self._body, self._step = tool, dialect, send, body, step
        self._current = first

    async def aiter_raw(self) -> Any:
        tool, dialect = self._tool, self._dialect
        messages = dialect.items(self._body)
        usage: dict[str, Any] | None = None
        events: StreamRound | None = None
        for round_ in range(tool.rounds + 1):
            if round_:
                await self._current.aclose()
                self._current = await tool._send(
                    self._send, self._body, messages, offer=round_ < tool.rounds
                )
            events = dialect.stream_round(events, usage)
            async for chunk in self._current.aiter_raw():
                if relayed := events.feed(chunk):
                    yield relayed
            whole = events.reply()
            ours = dialect.searches(whole)
            if not ours or round_ == tool.rounds:
                if end := events.end():
                    yield end
                return
            messages += await tool.answer(whole, ours, self._body, messages, self._step)
            usage = add_usage(usage, whole.get("usage"))

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


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
        loop = _Loop(self, send, body, step, self.dialect.items(body))
        first = await loop.send_round()
        if first.headers.get("content-type", "").startswith("text/event-stream"):
            return _Rounds(loop, first)
        return await self._whole(loop, first)

    async def _whole(self, loop: _Loop, reply: UpstreamReply) -> UpstreamReply:
        while True:
            content = await read_upstream_body(reply)  # and released
            whole = json_object(content)
            if reply.status_code >= 300 or whole is None:
                return _WholeReply(reply, content)  # exchange reports what is wrong with it
            ours = self.dialect.searches(whole)
            if not ours or loop.last:
                self.headers["X-Memory-Tool-Searches"] = str(loop.searches)
                if not ours and loop.usage is None:
                    return _WholeReply(reply, content)  # untouched: the upstream's bytes
                return _WholeReply(reply, orjson.dumps(self.dialect.final(whole, loop.usage)))
            await loop.answer(whole, ours)
            reply = await loop.send_round()


@dataclasses.dataclass
class _Loop:
    """One request's rounds: the conversation as it goes on, and the usage of the rounds
    before the current one."""

    tool: MemoryTool
    send: Send
    body: dict[str, Any]
    step: MemoryStep
    messages: list[Any]
    usage: dict[str, Any] | None = None
    round: int = 0
    searches: int = 0  # memory_search calls answered with a recall

    @property
    def last(self) -> bool:
        """Whether the current round is the last: memory_search is no longer offered."""
        return self.round == self.tool.rounds

    def _body(self, *, offer: bool) -> dict[str, Any]:
        out = self.tool.dialect.with_items(self.body, self.messages)
        return self.tool.dialect.offer(out) if offer else self.tool.dialect.last_round(out)

    async def send_round(self) -> UpstreamReply:
        """Send the current round upstream."""
        out = self._body(offer=not self.last)
        return await self.send(orjson.dumps(out), out)

    async def answer(self, reply: dict[str, Any], ours: Sequence[Search]) -> None:
        """Go on from a round that searched: its turn and the answers join the conversation
        of the next round."""
        sent = self.tool.conversation(self._body(offer=False))
        answers = [
            await self._search(search.query, sent) if i < MAX_SEARCHES_PER_ROUND else SKIPPED
            for i, search in enumerate(ours)
        ]
        self.messages += self.tool.dialect.followup(reply, list(zip(ours, answers, strict=True)))
        self.usage = add_usage(self.usage, reply.get("usage"))
        self.round += 1

    async def _search(self, query: str | None, sent: list[dict[str, Any]]) -> str:
        """Recall for one call's query, as the tool's answer (never raises)."""
        if query is None:
            return BAD_CALL
        self.searches += 1
        step = self.step
        counted = step.state.metrics.memory_tool_searches
        # The conversation as sent so far (pre-fetched block and earlier answers included):
        # recall leaves out what it already holds.
        asked = [*step.context, *sent, {"role": "user", "content": query}]
        try:
            # Its recall's spans go under the round's (docs/tracing.md).
            with trace_span("memproxy.memory_tool.search", {"memproxy.memory_tool.search": self.searches}):
                recalled = await self.tool.memory.recall(RecallRequest(
                    step.identity.user_id, step.identity.session_id, asked, step.model,
                    self.tool.budget, step.flags.scope, org_id=step.identity.org_id,
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

    def __init__(self, loop: _Loop, first: UpstreamReply) -> None:
        self.status_code = first.status_code
        self.headers = first.headers
        self._loop = loop
        self._current = first

    async def aiter_raw(self) -> Any:
        loop, dialect = self._loop, self._loop.tool.dialect
        events: StreamRound | None = None
        while True:
            events = dialect.stream_round(events, loop.usage)
            async for chunk in self._current.aiter_raw():
                if relayed := events.feed(chunk):
                    yield relayed
            whole = events.reply()
            ours = dialect.searches(whole)
            if not ours or loop.last:
                if end := events.end():
                    yield end
                return
            await loop.answer(whole, ours)
            await self._current.aclose()
            self._current = await loop.send_round()

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


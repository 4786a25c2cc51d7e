"""Context compaction: a conversation that, with its memory block, would pass
`compact_at` of the model's context window has its middle replaced by the session's summary.

Kept: the system prompt, the first exchange, the last `compact_keep_last` messages, and
every tool call together with its result (a boundary never separates them: the APIs reject
a call without its result, and a reasoning item without the item after it). The summary is
the session's current one, or one made now when the session has none; the background
summary job refreshes it every `summary_every` user turns, so with `compact_keep_last` at
least twice that nothing falls between the summary and the kept tail. Never silent: the
response says `X-Memory-Compacted: <tokens before>-><tokens after>`, the metrics count it,
and memory stores the client's original messages. With compaction off a request over the
window goes through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from memory import count_tokens, trace_span, turn_text
from proxy.formats.shape import Shape

if TYPE_CHECKING:
    from proxy.flow.call import Call
    from proxy.flow.memory_step import MemoryStep

HEADING = ("Summary of the earlier part of this conversation (memproxy replaced those "
           "messages with it to fit the context window):")


def middle(shape: Shape, keep_last: int) -> tuple[int, int] | None:
    """The [start, end) span to replace, or None when too little lies between the kept parts."""
    roles, n = shape.roles, len(shape.roles)
    first_user = next((i for i, role in enumerate(roles) if role == "user"), None)
    if first_user is None:
        return None
    reply = next((i for i in range(first_user + 1, n) if roles[i] == "assistant"), None)
    if reply is None:
        return None
    start, end = reply + 1, n - keep_last
    moved = True
    while moved and start < end:
        moved = False
        for call, result in shape.pairs:
            if call < start <= result:
                start, moved = result + 1, True
            if call < end <= result:
                end, moved = call, True
    return (start, end) if end - start >= 2 else None


def conversation_tokens(messages: Sequence[Mapping[str, Any]], model: str) -> int:
    """Tokens of the conversation's text (what compaction compares with the window)."""
    return count_tokens("\n".join(turn_text(m) for m in messages), model)


async def compact(call: Call, step: MemoryStep, block_tokens: int) -> dict[str, Any] | None:
    """The call's body with its middle replaced, or None when it fits or cannot be compacted."""
    state, fmt, body, model = step.state, call.fmt, call.body, step.model
    window = call.target.context_window
    if not window:  # the route's figure, else litellm's (which loads litellm on first use)
        from proxy.upstream.litellm_transport import context_window

        window = context_window(model, call.target.provider)
    if state.memory is None or window is None:
        return None
    before = conversation_tokens(fmt.conversation(body), model) + block_tokens
    shape = fmt.compaction_shape(body)
    if before <= state.settings.compact_at * window or shape is None:
        return None
    span = middle(shape, state.settings.compact_keep_last)
    if span is None:
        return None
    with trace_span("memproxy.compaction") as traced:
        compacted = await _compacted(call, step, span)
        after = conversation_tokens(fmt.conversation(compacted), model) + block_tokens \
            if compacted is not None else before
        if traced is not None:
            traced.set_attributes({"memproxy.compaction.window": window,
                                   "memproxy.compaction.tokens_before": before,
                                   "memproxy.compaction.tokens_after": after})
    if compacted is None:
        return None
    call.headers["X-Memory-Compacted"] = f"{before}->{after}"
    state.metrics.compactions.labels(fmt.route).inc()
    state.metrics.compacted_tokens.inc(max(0, before - after))
    return compacted


async def _compacted(call: Call, step: MemoryStep, span: tuple[int, int]) -> dict[str, Any] | None:
    """The call's body with `span` replaced by the session's summary (None without one)."""
    memory = step.state.memory
    assert memory is not None
    try:
        summary = await memory.session_summary(
            call.identity.user_id, call.identity.session_id, through=await step.answered_turn(),
            model=step.model, route=step.route,
        )
    except Exception as exc:  # memory never breaks the chat: it goes through uncompacted
        step.failed("compact", exc)
        return None
    if not summary:
        return None
    return call.fmt.compacted(call.body, span, f"{HEADING}\n{summary}")


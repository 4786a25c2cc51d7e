"""Context compaction: the middle of a long conversation replaced by the session's summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from config import Route
from proxy.flow.compaction import HEADING, middle
from proxy.formats.shape import Shape
from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import (
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    chat_completion,
)
from tests.support.sql import query

pytestmark = pytest.mark.both_backends

SUMMARY = "You summarise a conversation"  # the start of memproxy's summary prompt
FACTS = "The user, Ada, is allergic to peanuts and flies to Kyoto on 14 May."
FILLER = ("We compared three itineraries for the trip, with trains, temples, tea houses and "
          "the gardens, weighing cost, walking time and how crowded each place gets. ") * 3


def summariser(upstream: ScriptedUpstream) -> list[Received]:
    """Answer memproxy's summary prompts with FACTS; everything else gets the default echo."""
    asked: list[Received] = []

    def answer(request: Received) -> Reply | None:
        body = request.json if isinstance(request.json, dict) else {}
        messages = body.get("messages") or []
        if messages and str(messages[0].get("content")).startswith(SUMMARY):
            asked.append(request)
            return JSONReply(chat_completion(json.dumps({"text": FACTS, "facts": [FACTS]})))
        return None

    upstream.respond_with(answer)
    return asked


def long_chat(turns: int = 14) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel planner."},
        {"role": "user", "content": "Hi, I am Ada. I am allergic to peanuts."},
        {"role": "assistant", "content": "Noted, Ada: no peanuts anywhere in the plan."},
    ]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Idea {i}: {FILLER}"})
        messages.append({"role": "assistant", "content": f"Thoughts on idea {i}: {FILLER}"})
    messages.append({"role": "user", "content": "Which snacks can I buy at the station?"})
    return messages


@pytest.fixture
def small(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> RunningProxy:
    """memproxy with memory, a 2,000-token window for small-* models, the last 4 kept."""
    return start_proxy(
        memory=True, compact_keep_last=4, memory_read=False,
        routes=(Route("small-*", base_url=upstream.base_url, context_window=2000),),
    )


def post(proxy: RunningProxy, messages: list[dict[str, Any]], **headers: str) -> httpx.Response:
    return httpx.post(f"{proxy.base_url}/chat/completions", timeout=30,
                      headers={"X-Memory-User-Id": "ada", **headers},
                      json={"model": "small-model", "messages": messages})


def test_a_conversation_over_the_window_is_compacted_under_it(
    small: RunningProxy, upstream: ScriptedUpstream
) -> None:
    asked = summariser(upstream)
    messages = long_chat()
    reply = post(small, messages, **{"X-Memory-Compact": "on"})
    assert reply.status_code == 200, reply.text
    before, after = map(int, reply.headers["x-memory-compacted"].split("->"))
    assert before > 0.8 * 2000 >= after  # it was over 80 % of the window, and now it is under
    assert len(asked) == 1  # the session had no summary: one was made now
    sent = upstream.history[-1].json["messages"]
    # Kept: the system prompt, the first exchange, the last 4; the middle is the summary.
    assert sent[:3] == messages[:3] and sent[-4:] == messages[-4:] and len(sent) == 8
    assert sent[3]["role"] == "system" and sent[3]["content"] == f"{HEADING}\n{FACTS}"
    wait_for_jobs(small)
    stored = query(small.state.settings, "SELECT content FROM turns ORDER BY id")
    assert [c for (c,) in stored][:-1] == [m["content"] for m in messages[1:]]  # all of them
    metrics = httpx.get(f"{small.url}/metrics").text
    assert 'memproxy_compactions_total{route="chat"} 1.0' in metrics
    # The next request reuses the stored summary: no new summary call.
    post(small, [*messages, {"role": "assistant", "content": "Onigiri."},
                 {"role": "user", "content": "And drinks?"}], **{"X-Memory-Compact": "on"})
    assert len(asked) == 1 and upstream.history[-1].json["messages"][3]["content"].endswith(FACTS)


def test_off_a_request_over_the_window_goes_through_unchanged(
    small: RunningProxy, upstream: ScriptedUpstream
) -> None:
    asked = summariser(upstream)
    messages = long_chat()
    reply = post(small, messages)
    assert "x-memory-compacted" not in reply.headers and asked == []
    assert upstream.history[-1].json["messages"] == messages


def test_a_tool_call_and_its_result_are_never_separated(
    small: RunningProxy, upstream: ScriptedUpstream
) -> None:
    summariser(upstream)
    messages = long_chat(turns=12)
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "trains", "arguments": "{}"}}]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "Nozomi at 9:00"}
    # The call lies in the middle and its result in the last four: both are kept.
    messages[-4:-4] = [call, result]
    del messages[-3]
    post(small, messages, **{"X-Memory-Compact": "on"})
    sent = upstream.history[-1].json["messages"]
    assert call in sent and result in sent and sent.index(result) == sent.index(call) + 1
    assert sent[-4:] == messages[-4:] and sent[3]["content"].startswith(HEADING)


def test_anthropic_messages_are_compacted_with_tool_uses_paired(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    summariser(upstream)
    proxy = start_proxy(
        memory=True, compact=True, compact_keep_last=2, memory_read=False,
        anthropic_base_url=upstream.base_url.removesuffix("/v1"), extract_base_url=upstream.base_url,
        routes=(Route("claude-small*", base_url=upstream.base_url, context_window=1500),),
    )
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "I am Ada, allergic to peanuts."},
        {"role": "assistant", "content": "Noted."},
    ]
    for i in range(8):
        messages += [{"role": "user", "content": f"Idea {i}: {FILLER}"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}",
                                                        "name": "search", "input": {"q": i}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                   "content": FILLER}]},
                     {"role": "assistant", "content": f"Found {i}."}]
    messages[-1] = {"role": "user", "content": "What can I eat?"}
    reply = httpx.post(f"{proxy.url}/v1/messages", timeout=30, headers={"X-Memory-User-Id": "ada"},
                       json={"model": "claude-small-1", "max_tokens": 50, "messages": messages})
    assert reply.status_code == 200, reply.text
    before, after = map(int, reply.headers["x-memory-compacted"].split("->"))
    assert before > 1200 >= after
    sent = upstream.history[-1].json["messages"]
    # The kept tail started inside a tool use/result pair: it now starts at the tool use.
    assert sent[:2] == messages[:2] and sent[-3:] == messages[-3:]
    assert sent[2] == {"role": "user", "content": [{"type": "text", "text": f"{HEADING}\n{FACTS}"}]}


@pytest.mark.parametrize(("roles", "pairs", "keep", "expected"), [
    (["system", "user", "assistant", "user", "assistant", "user", "assistant", "user"], [], 2, (3, 6)),
    (["user", "assistant", "user", "assistant", "user"], [], 3, None),  # nothing worth it
    (["user", "user"], [], 1, None),  # no first exchange
    # A pair over the start joins the head; a pair over the end joins the tail.
    (["user", "assistant", "tool", "user", "assistant", "user", "assistant", "tool", "user"],
     [(1, 2), (6, 7)], 2, (3, 6)),
    (["user", "assistant", "user", "assistant", "tool", "tool", "user"], [(3, 4), (3, 5)], 2, None),
])
def test_the_middle_keeps_head_tail_and_pairs(
    roles: list[str], pairs: list[tuple[int, int]], keep: int, expected: tuple[int, int] | None
) -> None:
    assert middle(Shape(roles, pairs), keep) == expected

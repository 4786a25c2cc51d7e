"""A request in tool mode that the loop cannot serve, in each API format: it gets the normal
injection and `X-Memory-Mode: inject (<reason>)`, and memory_search never reaches the
upstream (docs/headers.md, "Memory as a tool")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from proxy.flow.memory_tool.dialect import TOOL_NAME
from tests.conftest import RunningProxy
from tests.support.scripted_upstream import ScriptedUpstream
from tests.test_memory_tool import NOTE, QUESTION, TOOL_HEADERS, remember_note

SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}}
OURS = {"chat": {"type": "function", "function": {"name": TOOL_NAME, "parameters": SCHEMA}},
        "messages": {"name": TOOL_NAME, "input_schema": SCHEMA},
        "responses": {"type": "function", "name": TOOL_NAME, "parameters": SCHEMA}}
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"n": 2}, "tool mode needs n=1"),
    ("chat", {"tools": {"not": "a list"}}, "tools is not an array"),
    ("chat", {"tools": [OURS["chat"]]}, f"the request has its own {TOOL_NAME} tool"),
    ("chat", {"functions": [{"name": "f", "parameters": SCHEMA}]},
     "the request uses the legacy functions field"),
    ("chat", {"tool_choice": "none"}, "tool_choice is none"),
    ("messages", {"tools": {"not": "a list"}}, "tools is not an array"),
    ("messages", {"tools": [OURS["messages"]]}, f"the request has its own {TOOL_NAME} tool"),
    ("messages", {"tool_choice": {"type": "none"}}, "tool_choice is none"),
    ("responses", {"tools": {"not": "a list"}}, "tools is not an array"),
    ("responses", {"tools": [OURS["responses"]]}, f"the request has its own {TOOL_NAME} tool"),
    ("responses", {"tool_choice": "none"}, "tool_choice is none"),
    ("responses", {"background": True}, "background responses are not awaited"),
]
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def body(route: str, extra: dict[str, Any]) -> dict[str, Any]:
    question = {"role": "user", "content": QUESTION}
    if route == "responses":
        return {"model": "gpt-4o", "input": [question], **extra}
    limits = {"max_tokens": 100} if route == "messages" else {}
    return {"model": "gpt-4o", "messages": [question], **limits, **extra}


def test_a_request_the_loop_cannot_serve_is_injected_and_says_why(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, memory_tool_prefetch=0,
                        anthropic_base_url=upstream.base_url.removesuffix("/v1"))
    remember_note(proxy)
    for route, extra, reason in CASES:
        before = len(upstream.history)
        response = httpx.post(f"{proxy.url}{PATHS[route]}", headers=TOOL_HEADERS, timeout=60,
                              json=body(route, extra))
        assert response.headers["x-memory-mode"] == f"inject ({reason})", (route, response.text)
        (sent,) = [r for r in upstream.history[before:] if r.path == PATHS[route]]
        assert NOTE in sent.body.decode(), route  # injected
        assert sent.json.get("tools") == extra.get("tools"), route  # memory_search not added

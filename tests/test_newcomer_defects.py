"""What a new user tripped on (issue 27): headers on errors, settings, the block's shape."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support.scripted_upstream import Drop, ErrorReply, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hello"}),
])
def test_a_502_carries_the_session_id(
    client: httpx.Client, upstream: ScriptedUpstream, path: str, body: dict[str, object]
) -> None:
    upstream.enqueue(Drop(), Drop())
    headers = {"x-memory-session-id": "s-502", "authorization": "Bearer sk-test-key"}
    response = client.post(path, json=body, headers=headers)
    assert response.status_code == 502, response.text
    assert response.headers["x-memory-session-id"] == "s-502"


def test_a_502_on_the_anthropic_upstream_carries_the_session_id(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(anthropic_base_url=upstream.base_url)
    upstream.enqueue(Drop(), Drop())
    response = httpx.post(f"{proxy.url}/v1/messages", headers={"x-memory-session-id": "s-a"},
                          json={"model": "claude-x", "max_tokens": 10, "messages": MESSAGES})
    assert response.status_code == 502, response.text
    assert response.headers["x-memory-session-id"] == "s-a"


def test_an_upstream_error_status_carries_the_session_id(
    client: httpx.Client, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(ErrorReply(503, "busy"))
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert response.status_code == 503
    assert response.headers["x-memory-session-id"]


def test_a_400_before_identity_has_no_session_header(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", content=b"{nope")
    assert response.status_code == 400
    assert "x-memory-session-id" not in response.headers


def test_short_keys_are_documented() -> None:
    from pathlib import Path

    from config.settings import setting_fields

    help_text = next(f for f in setting_fields() if f.name == "api_keys").metadata["help"]
    assert "8 characters" in help_text
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "at least 8 characters" in readme




def test_the_block_without_facts_keeps_the_documented_turns_heading() -> None:
    from memory import count_tokens
    from memory.recall.block import TURNS_HEADING, pack_block
    from memory.recall.learned_recall import Learned
    from memory.recall.render import CLOSE, OPEN, Entry

    def count(text: str) -> int:
        return count_tokens(text, "gpt-4o")

    day = 1_700_000_000.0
    entries = [Entry("user", day, "I adopted a greyhound.", "s1", 1),
               Entry("assistant", day + 5, "Lovely dog.", "s1", 2)]
    packed = pack_block(Learned(), entries, 1000, count)
    lines = packed.block.splitlines()
    assert lines[0] == OPEN and lines[-1] == CLOSE
    assert lines[2:] == [TURNS_HEADING, "[2023-11-14]", "user: I adopted a greyhound.",
                         "assistant: Lovely dog.", CLOSE]
    assert packed.tokens == count(packed.block)
    for budget in range(0, packed.tokens + 3):
        small = pack_block(Learned(), entries, budget, count)
        assert small.tokens == count(small.block) <= budget
        assert not small.block or TURNS_HEADING in small.block

"""Stable injection and the recall cache, through the real stack: the openai SDK, memproxy on
a socket, the scripted upstream, SQLite, Chroma and the local embedding model."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import asyncpg
import httpx
import openai
import orjson
import pytest

from memory.recall.render import LATER_PREAMBLE, PREAMBLE
from memory.tokens import count_tokens
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import memory_api
from tests.support.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.both_backends

SYSTEM = {"role": "system", "content": "Be brief."}
FIRST = "Which database does the billing service use?"
SECOND = "And which language is the billing service written in?"
SAID = [
    "The billing service runs on Postgres 16 with pgvector.",
    "The billing service is written in Rust, with tokio.",
]


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> RunningProxy:
    """memproxy with memory on and a user who said two things about billing in session s0."""
    return seeded(start_proxy(memory=True, anthropic_base_url=upstream.base_url.removesuffix("/v1")))


def seeded(proxy: RunningProxy) -> RunningProxy:
    """`proxy` once user ada said SAID in session s0."""
    for text in SAID:
        chat(proxy, text, session="s0", user="ada")
    # Retries too: a job retried after its backoff would write s0's memory during a test and
    # move the version the recall cache is stamped with (the cache counts would be off).
    wait_for_jobs(proxy, later=True)
    return proxy


def two_requests(
    proxy: RunningProxy, upstream: ScriptedUpstream, *, first: dict[str, str] | None = None,
    second: dict[str, str] | None = None,
) -> tuple[list[Any], list[Any], bytes]:
    """A session's first request, then its second with the history resent: the messages
    the upstream received for each, and the raw body of the second."""
    reply = chat(proxy, [SYSTEM, {"role": "user", "content": FIRST}], session="s1", user="ada",
                 headers=first)
    sent_first = upstream.history[-1].json["messages"]
    history = [SYSTEM, {"role": "user", "content": FIRST},
               {"role": "assistant", "content": reply.text}, {"role": "user", "content": SECOND}]
    chat(proxy, history, session="s1", user="ada", headers=second)
    return sent_first, upstream.history[-1].json["messages"], upstream.history[-1].body


@pytest.mark.parametrize("placement", ["system", "last_user"])
def test_the_second_request_carries_the_first_block_byte_for_byte_at_its_place(
    memproxy: RunningProxy, upstream: ScriptedUpstream, placement: str
) -> None:
    headers = {"X-Memory-Placement": placement}
    sent_first, sent_second, raw = two_requests(memproxy, upstream, first=headers, second=headers)
    block = sent_first[0 if placement == "system" else 1]["content"]
    assert "Postgres 16" in block and "Rust, with tokio" in block
    if placement == "system":
        assert block.startswith("Be brief.\n\n<memory>")
    else:
        assert block.startswith("<memory>") and sent_first[0] == SYSTEM
    # The prompt of the first request is the start of the second one's, byte for byte.
    assert sent_second[: len(sent_first)] == sent_first
    assert orjson.dumps(sent_first)[:-1] in raw
    # Everything recalled was shown in the first block: the second request adds no block.
    assert len(sent_second) == len(sent_first) + 2


@pytest.mark.parametrize("share", [0.25, 0.0])
def test_a_new_item_goes_in_a_block_before_the_new_user_message(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, share: float
) -> None:
    memproxy = seeded(start_proxy(memory=True, memory_stable_share=share))
    _, sent_second, _ = two_requests(memproxy, upstream)
    # The first block (placement system) keeps its place; the new fact comes before the
    # new question.
    with memory_api(memproxy, **{"X-Memory-User-Id": "ada"}) as api:
        added = api.post("/facts", json={"text": "The billing service deploys on Fridays.",
                                         "category": "project"})
        assert added.status_code in (200, 201), added.text
    wait_for_jobs(memproxy)
    assert len(sent_second) == 4  # the block in the system prompt, then the conversation
    history = [SYSTEM, *sent_second[1:], {"role": "assistant", "content": "ok"},
               {"role": "user", "content": "When does the billing service deploy?"}]
    third = chat(memproxy, history, session="s1", user="ada")
    sent_third = upstream.history[-1].json["messages"]
    assert sent_third[: len(sent_second)] == sent_second
    # Once earlier blocks are in the prompt, new items get `share` of the budget (1000).
    assert int(third.headers["x-memory-injected-tokens"]) <= share * 1000
    if share == 0:
        assert len(sent_third) == len(history)  # nothing new may be added
        return
    new_block = sent_third[-2]
    assert new_block["role"] == "system" and new_block["content"].startswith("<memory>")
    assert "deploys on Fridays" in new_block["content"] and "Postgres 16" not in new_block["content"]


def test_the_fresh_header_restores_one_new_block_per_request(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    fresh = {"X-Memory-Injection": "fresh", "X-Memory-Placement": "last_user"}
    sent_first, sent_second, _ = two_requests(memproxy, upstream, first=fresh, second=fresh)
    # Each request has one block, before its last user message; the first one's is gone.
    assert [m["role"] for m in sent_first] == ["system", "system", "user"]
    assert [m["role"] for m in sent_second] == ["system", "user", "assistant", "system", "user"]
    assert "Postgres 16" in sent_second[3]["content"]  # recalled again


def test_a_retry_reuses_the_recall_and_the_block_until_memory_changes(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    history = [SYSTEM, {"role": "user", "content": FIRST}]
    chat(memproxy, history, session="s1", user="ada")
    first = upstream.history[-1].body
    before = cache_counts(memproxy)
    retry = chat(memproxy, history, session="s1", user="ada")  # after its own turns were stored
    assert upstream.history[-1].body == first
    assert cache_counts(memproxy) == (before[0] + 1, before[1])
    assert int(retry.headers["x-memory-items"]) >= 1
    # Another session's turn is a write to the user's memory: the next retry recalls again.
    chat(memproxy, "The billing team meets on Tuesdays.", session="s2", user="ada")
    wait_for_jobs(memproxy, later=True)
    counted = cache_counts(memproxy)
    chat(memproxy, history, session="s1", user="ada")
    assert cache_counts(memproxy) == (counted[0], counted[1] + 1)
    assert upstream.history[-1].body == first  # the kept block still goes back as it was
    chat(memproxy, history, session="s1", user="ada")
    assert cache_counts(memproxy) == (counted[0] + 1, counted[1] + 1)


@pytest.mark.parametrize("write", ["fact", "forget", "clear"])
def test_every_kind_of_write_invalidates_the_recall_cache(
    memproxy: RunningProxy, upstream: ScriptedUpstream, write: str
) -> None:
    history = [{"role": "user", "content": FIRST}]
    headers = {"X-Memory-Injection": "fresh"}
    chat(memproxy, history, session="s1", user="ada", headers=headers)
    chat(memproxy, history, session="s1", user="ada", headers=headers)
    hits, misses = cache_counts(memproxy)
    with memory_api(memproxy, **{"X-Memory-User-Id": "ada"}) as api:
        if write == "fact":
            reply = api.post("/facts", json={"text": "Billing owns the invoices.",
                                             "category": "project"})
        elif write == "forget":
            reply = api.delete("/sessions/s0")
        else:
            reply = api.post("/clear")
        assert reply.status_code < 300, reply.text
    chat(memproxy, history, session="s1", user="ada", headers=headers)
    assert cache_counts(memproxy) == (hits, misses + 1)
    if write != "fact":  # what was forgotten is not recalled from a stale cache
        assert "Postgres 16" not in str(upstream.history[-1].json["messages"])


def test_a_block_that_showed_forgotten_memory_is_not_put_back(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    reply = chat(memproxy, [{"role": "user", "content": FIRST}], session="s1", user="ada")
    assert "Postgres 16" in str(upstream.history[-1].json["messages"])
    with memory_api(memproxy, **{"X-Memory-User-Id": "ada"}) as api:
        assert api.delete("/sessions/s0").status_code == 200
    chat(memproxy, [{"role": "user", "content": FIRST}, {"role": "assistant", "content": reply.text},
                    {"role": "user", "content": SECOND}], session="s1", user="ada")
    assert "Postgres 16" not in str(upstream.history[-1].json["messages"])


def test_stable_injection_through_the_responses_api(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    headers = {"X-Memory-User-Id": "ada", "X-Memory-Session-Id": "r1"}
    with openai.OpenAI(base_url=memproxy.base_url, api_key="sk-test", max_retries=0,
                       default_headers=headers) as client:
        reply = client.responses.create(model="gpt-4o-mini", instructions="Be brief.", input=FIRST)
        first = upstream.history[-1].json
        items: Any = [{"role": "user", "content": FIRST},
                      {"role": "assistant", "content": reply.output_text},
                      {"role": "user", "content": SECOND}]
        client.responses.create(model="gpt-4o-mini", instructions="Be brief.", input=items)
        second = upstream.history[-1].json
    assert first["instructions"].startswith("Be brief.\n\n<memory>")
    assert second["instructions"] == first["instructions"]
    assert [i["role"] for i in second["input"]] == ["user", "assistant", "user"]


def test_stable_injection_through_anthropic_messages(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    headers = {"X-Memory-User-Id": "ada", "X-Memory-Session-Id": "m1",
               "anthropic-version": "2023-06-01", "x-api-key": "sk-test"}
    marked = {"type": "text", "text": FIRST, "cache_control": {"type": "ephemeral"}}
    with httpx.Client(base_url=memproxy.base_url, headers=headers, timeout=60) as http:
        body: dict[str, Any] = {"model": "claude-test", "max_tokens": 50, "system": "Be brief.",
                                "messages": [{"role": "user", "content": [marked]}]}
        assert http.post("/messages", json=body).status_code == 200
        first = upstream.history[-1].json["messages"]
        moved = {"type": "text", "text": SECOND, "cache_control": {"type": "ephemeral"}}
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": FIRST}]},
                            {"role": "assistant", "content": "Postgres."},
                            {"role": "user", "content": [moved]}]
        assert http.post("/messages", json=body).status_code == 200
        second = upstream.history[-1].json
    # A breakpoint in the messages: the block goes in the user message, before the marked
    # words, and stays there when the client moves its breakpoint on.
    assert second["system"] == "Be brief."
    block = first[0]["content"][0]
    assert block["text"].startswith("<memory>") and "Postgres 16" in block["text"]
    assert second["messages"][0]["content"] == [block, {"type": "text", "text": FIRST}]


def cache_counts(proxy: RunningProxy) -> tuple[float, float]:
    """(hits, misses) of the recall cache, read from /metrics."""
    text = httpx.get(f"{proxy.url}/metrics", timeout=10).text

    def value(name: str) -> float:
        found = re.search(rf"^memproxy_recall_cache_{name}_total (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return value("hits"), value("misses")


# -- the delta rule (memory_delta_relevance) and writing off (issue 26) ----------------------


@pytest.mark.parametrize(("relevance", "similarity"), [(0.0, 0.0), (0.2, 0.0), (0.0, 0.3)])
def test_a_later_block_holds_only_new_items_that_clear_the_relevance_threshold(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, relevance: float,
    similarity: float,
) -> None:
    memproxy = seeded(start_proxy(memory=True, memory_delta_relevance=relevance,
                                  memory_delta_similarity=similarity))
    reply = chat(memproxy, [SYSTEM, {"role": "user", "content": FIRST}], session="s1", user="ada")
    sent_first = upstream.history[-1].json["messages"]
    # Something new, and unrelated to billing, reaches the user's memory after the first block.
    chat(memproxy, "My cat is called Miso and she sleeps all day.", session="s2", user="ada")
    wait_for_jobs(memproxy)
    history = [SYSTEM, {"role": "user", "content": FIRST},
               {"role": "assistant", "content": reply.text}, {"role": "user", "content": SECOND}]
    second = chat(memproxy, history, session="s1", user="ada")
    sent_second = upstream.history[-1].json["messages"]
    assert sent_second[: len(sent_first)] == sent_first
    if relevance == similarity == 0:  # the old rule: any new item that fits goes in
        assert "Miso" in sent_second[-2]["content"]
        return
    # Far below the fused score's ceiling, or far from the question by meaning: no block at
    # all, not an empty one.
    assert len(sent_second) == len(history) and "Miso" not in str(sent_second)
    assert second.headers["x-memory-injected-tokens"] == "0"


def test_a_new_item_close_to_the_question_gets_a_later_block_under_the_short_preamble(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    seeded(memproxy)
    reply = chat(memproxy, [SYSTEM, {"role": "user", "content": FIRST}], session="s1", user="ada")
    first_block = upstream.history[-1].json["messages"][0]["content"]
    chat(memproxy, "The billing service moved from Rust to Go last week.", session="s2",
         user="ada")
    wait_for_jobs(memproxy)
    history = [SYSTEM, {"role": "user", "content": FIRST},
               {"role": "assistant", "content": reply.text}, {"role": "user", "content": SECOND}]
    second = chat(memproxy, history, session="s1", user="ada")
    sent = upstream.history[-1].json["messages"]
    later = sent[-2]
    assert later["role"] == "system" and "moved from Rust to Go" in later["content"], sent
    # The first block says what memory is in full; a later one, in one short line.
    assert first_block.startswith(f"Be brief.\n\n<memory>\n{PREAMBLE}\n")
    assert later["content"].startswith(f"<memory>\n{LATER_PREAMBLE}\n")
    assert later["content"].endswith("</memory>")
    assert int(second.headers["x-memory-injected-tokens"]) == count_tokens(later["content"],
                                                                          "gpt-4o")


OFF = {"X-Memory-Write": "off"}
MARK = "ticket QX-81723"  # in the write-off session's question only
OFF_SESSION = "offwrite-session-5b1e"


def off_requests(proxy: RunningProxy, upstream: ScriptedUpstream) -> tuple[bytes, bytes, Any]:
    """A write-off session's first request, then its second with the history resent: the
    raw bodies the upstream received, and the first one's messages."""
    first = [SYSTEM, {"role": "user", "content": f"{FIRST} ({MARK})"}]
    reply = chat(proxy, first, session=OFF_SESSION, user="ada", headers=OFF)
    sent_first = upstream.history[-1]
    history = [*first, {"role": "assistant", "content": reply.text},
               {"role": "user", "content": SECOND}]
    chat(proxy, history, session=OFF_SESSION, user="ada", headers=OFF)
    return sent_first.body, upstream.history[-1].body, sent_first.json["messages"]


def test_writing_off_repeats_the_first_block_byte_for_byte_and_stores_nothing(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    _, second_body, sent_first = off_requests(memproxy, upstream)
    assert "Postgres 16" in sent_first[0]["content"]
    # The upstream saw the first request's prompt again, byte for byte, at the second's start.
    assert orjson.loads(second_body)["messages"][: len(sent_first)] == sent_first
    assert orjson.dumps(sent_first)[:-1] in second_body
    assert len(memproxy.state.memory.unsaved.blocks_of("ada")) == 1  # the first request's
    wait_for_jobs(memproxy)
    assert not stored_traces(memproxy, [MARK.encode(), OFF_SESSION.encode()])


@pytest.mark.parametrize("delete", ["forget", "clear"])
def test_deleting_memory_drops_the_kept_blocks_of_a_write_off_session(
    memproxy: RunningProxy, upstream: ScriptedUpstream, delete: str
) -> None:
    first = [SYSTEM, {"role": "user", "content": FIRST}]
    reply = chat(memproxy, first, session=OFF_SESSION, user="ada", headers=OFF)
    assert "Postgres 16" in upstream.history[-1].json["messages"][0]["content"]
    with memory_api(memproxy, **{"X-Memory-User-Id": "ada"}) as api:
        answer = api.delete("/sessions/s0") if delete == "forget" else api.post("/clear")
        assert answer.status_code < 300, answer.text
    history = [*first, {"role": "assistant", "content": reply.text},
               {"role": "user", "content": SECOND}]
    chat(memproxy, history, session=OFF_SESSION, user="ada", headers=OFF)
    assert "Postgres 16" not in str(upstream.history[-1].json["messages"])
    assert upstream.history[-1].json["messages"][0] == SYSTEM
    assert not any("Postgres 16" in kept.block
                   for kept in memproxy.state.memory.unsaved.blocks_of("ada"))


def stored_traces(proxy: RunningProxy, needles: list[bytes]) -> list[str]:
    """Where any of `needles` is stored: files under the data directory (the SQLite database
    and its WAL, Chroma's files, the spool), and on PostgreSQL every table's rows."""
    found = [str(path) for path in proxy.state.settings.data_dir.rglob("*") if path.is_file()
             and any(n in path.read_bytes() for n in needles)]
    url = proxy.state.settings.database_url
    if url is not None:
        found += asyncio.run(_pg_traces(url, [n.decode() for n in needles]))
    return found


async def _pg_traces(url: str, needles: list[str]) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        tables = [r[0] for r in await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")]
        found = []
        for table in tables:
            rows = await conn.fetch(f'SELECT t::text FROM "{table}" AS t')
            if any(n in row[0] for row in rows for n in needles):
                found.append(table)
        return found
    finally:
        await conn.close()

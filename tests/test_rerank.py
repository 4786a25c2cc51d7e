"""The rerank stage through the real stack: the openai SDK, memproxy on a socket with memory on,
the scripted upstream, and a second scripted server on 127.0.0.1 as the reranker, which
scores by a rule these tests know (a text that names Postgres is the most relevant)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.upstream.rerank import LLM_PROMPT
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import (
    ErrorReply,
    Hang,
    JSONReply,
    RawReply,
    Received,
    Reply,
    ScriptedUpstream,
    chat_completion,
)

pytestmark = pytest.mark.both_backends

SAID = [
    "My favourite colour is a deep ocean blue.",
    "I painted the kitchen blue last spring.",
    "The billing service stores invoices in Postgres 16.",
    "We walk the dog every morning at seven.",
]
QUESTION = "Which colour do I like best?"
RELEVANT = "Postgres"  # the rule: the reranker puts what names it first


def scores(documents: list[str]) -> list[float]:
    """The test's rule: a text that names Postgres scores 1, any other 0."""
    return [1.0 if RELEVANT in text else 0.0 for text in documents]


def cohere_answer(received: Received) -> Reply | None:
    """A Cohere-style rerank endpoint scoring by the rule, best first."""
    if received.path != "/rerank":
        return None
    ranked = sorted(enumerate(scores(received.json["documents"])), key=lambda p: -p[1])
    return JSONReply({"results": [{"index": i, "relevance_score": s} for i, s in ranked]})


@pytest.fixture
def reranker() -> Iterator[ScriptedUpstream]:
    """The scripted reranker on 127.0.0.1, answering by the rule unless a test queues more."""
    with ScriptedUpstream() as server:
        server.respond_with(cohere_answer)
        yield server


@pytest.fixture
def remembering(
    start_proxy: Callable[..., RunningProxy], reranker: ScriptedUpstream
) -> Callable[..., RunningProxy]:
    """Starts memproxy reranking through `reranker`, once user ada said SAID."""

    def start(**changes: Any) -> RunningProxy:
        settings: dict[str, Any] = {
            "rerank": "endpoint", "rerank_base_url": f"http://127.0.0.1:{reranker.port}",
            "rerank_model": "rerank-test", **changes,
        }
        proxy = start_proxy(memory=True, **settings)
        for text in SAID:
            chat(proxy, text, session="s0", user="ada", headers={"X-Memory-Read": "off"})
        wait_for_jobs(proxy)
        reranker.clear()
        reranker.respond_with(cohere_answer)
        return proxy

    return start


def dry_run(proxy: RunningProxy, question: str = QUESTION, **headers: str) -> httpx.Response:
    """What recall would inject for `question` in a new session of ada's."""
    return httpx.post(
        f"{proxy.base_url}/chat/completions", timeout=30,
        headers={"X-Memory-Dry-Run": "on", "X-Memory-User-Id": "ada",
                 "X-Memory-Session-Id": "s-new", "Authorization": "Bearer sk-test", **headers},
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": question}]},
    )


def said_in(block: str) -> list[str]:
    """Which of SAID the block holds, in the order it shows them."""
    return sorted((s for s in SAID if s in block), key=block.index)


def test_the_reranker_s_order_reaches_the_block(
    remembering: Callable[..., RunningProxy], reranker: ScriptedUpstream
) -> None:
    proxy = remembering()
    fused = dry_run(proxy, **{"X-Memory-Rerank": "off"}).json()
    assert fused["rerank"] is None and not reranker.history
    # By fusion alone the colour turns lead; the reranker's rule puts Postgres first.
    assert said_in(fused["block"])[0] != SAID[2]

    answer = dry_run(proxy)
    assert answer.status_code == 200 and "x-memory-error" not in answer.headers
    shown = answer.json()
    report = shown["rerank"]
    assert report["fallback"] is None and sorted(report["reranked"]) == sorted(report["fused"])
    assert report["reranked"] != report["fused"]
    assert shown["items"][0]["text"].endswith(SAID[2])
    sent = reranker.history[0]
    assert sent.path == "/rerank" and sent.json["query"].startswith(QUESTION)
    assert sent.json["model"] == "rerank-test"
    assert sent.json["top_n"] == len(sent.json["documents"]) == len(report["fused"])

    # A budget that holds one past turn: the reranker's first choice, not fusion's.
    small = dry_run(proxy, **{"X-Memory-Budget": "80"}).json()
    assert said_in(small["block"]) == [SAID[2]]
    unranked = dry_run(proxy, **{"X-Memory-Budget": "80", "X-Memory-Rerank": "off"}).json()
    assert SAID[2] not in unranked["block"]
    assert small["tokens"] <= 80


def fused_block(proxy: RunningProxy) -> str:
    block: str = dry_run(proxy, **{"X-Memory-Rerank": "off"}).json()["block"]
    return block


@pytest.mark.parametrize(("reply", "reason"), [
    (Hang(2.0), "timeout"),
    (ErrorReply(503, "overloaded"), "status"),
    (RawReply(b"{not json", content_type="application/json"), "malformed"),
    (JSONReply({"results": [{"index": 99, "relevance_score": 1.0}]}), "malformed"),
    (JSONReply({"results": [{"index": 0, "relevance_score": "high"}]}), "malformed"),
    (JSONReply({"answer": "Postgres first"}), "malformed"),
])
def test_a_failing_reranker_leaves_the_fused_order_and_says_so(
    remembering: Callable[..., RunningProxy], reranker: ScriptedUpstream, reply: Reply,
    reason: str,
) -> None:
    proxy = remembering(rerank_timeout_ms=300)
    expected = fused_block(proxy)
    reranker.enqueue(reply, path="/rerank")
    answer = dry_run(proxy)
    assert answer.status_code == 200
    assert answer.headers["x-memory-error"] == f"rerank: {reason}"
    assert answer.json()["block"] == expected
    assert answer.json()["rerank"]["fallback"] == reason
    # The chat itself goes through, and the fallback is not kept by the recall cache:
    # the next request asks the reranker again, and gets its order.
    reply_ok = chat(proxy, QUESTION, session="s-chat", user="ada")
    assert reply_ok.status == 200 and "x-memory-error" not in reply_ok.headers
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert f'memproxy_rerank_fallbacks_total{{reason="{reason}"}} 1.0' in metrics


def test_a_reranker_that_cannot_be_reached_leaves_the_fused_order(
    remembering: Callable[..., RunningProxy],
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    proxy = remembering(rerank_base_url=f"http://127.0.0.1:{closed}")
    answer = dry_run(proxy)
    assert answer.headers["x-memory-error"] == "rerank: unreachable"
    assert answer.json()["block"] == fused_block(proxy)


def test_a_reranked_result_is_kept_by_the_recall_cache(
    remembering: Callable[..., RunningProxy], reranker: ScriptedUpstream
) -> None:
    proxy = remembering()
    first, again = dry_run(proxy).json(), dry_run(proxy).json()
    assert len(reranker.history) == 1
    assert again["cached"] and again["block"] == first["block"]
    assert again["rerank"] == first["rerank"]


def test_the_header_turns_rerank_on_and_off_for_one_request(
    remembering: Callable[..., RunningProxy], reranker: ScriptedUpstream
) -> None:
    proxy = remembering(rerank="off")
    assert dry_run(proxy).json()["rerank"] is None
    # Asked for while none is configured: the fused order, and the reason.
    asked = dry_run(proxy, **{"X-Memory-Rerank": "on"})
    assert asked.headers["x-memory-error"] == "rerank: not configured"
    assert not reranker.history
    bad = dry_run(proxy, **{"X-Memory-Rerank": "maybe"})
    assert bad.status_code == 400
    assert "X-Memory-Rerank" in bad.json()["error"]["message"]


def test_tei_s_body_and_answer(
    remembering: Callable[..., RunningProxy], reranker: ScriptedUpstream
) -> None:
    def tei(received: Received) -> Reply | None:
        ranked = sorted(enumerate(scores(received.json["texts"])), key=lambda p: -p[1])
        return JSONReply([{"index": i, "score": s} for i, s in ranked])

    proxy = remembering(rerank_format="tei", rerank_model=None)
    reranker.respond_with(tei)
    shown = dry_run(proxy).json()
    assert set(reranker.history[0].json) == {"query", "texts"}
    assert shown["rerank"]["fallback"] is None
    assert shown["items"][0]["text"].endswith(SAID[2])


def llm_ranker(answers: list[str]) -> Callable[[Received], Reply | None]:
    """The scripted upstream answering a rerank question with `answers`, in turn (the last
    again), and any other request as usual."""
    asked: list[Received] = []

    def answer(received: Received) -> Reply | None:
        messages = (received.json or {}).get("messages") or [{}]
        if messages[0].get("content") != LLM_PROMPT:
            return None
        asked.append(received)
        return JSONReply(chat_completion(answers[min(len(asked), len(answers)) - 1]))

    return answer


def rule_order(received: Received) -> str:
    """The order the rule gives the texts a rerank question lists."""
    listing = received.json["messages"][1]["content"].split("Texts:\n", 1)[1]
    texts = listing.split("\n\n")
    ranked = sorted(range(len(texts)), key=lambda i: -scores([texts[i]])[0])
    return orjson.dumps({"order": ranked}).decode()


def test_the_llm_orders_the_candidates_after_one_repair(
    remembering: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = remembering(rerank="llm", rerank_model="gpt-4o-mini")
    questions: list[Received] = []

    def answer(received: Received) -> Reply | None:
        messages = (received.json or {}).get("messages") or [{}]
        if messages[0].get("content") != LLM_PROMPT:
            return None
        questions.append(received)
        if len(questions) == 1:
            return JSONReply(chat_completion("Sure! The Postgres one first."))
        return JSONReply(chat_completion(rule_order(questions[0])))

    upstream.respond_with(answer)
    shown = dry_run(proxy).json()
    assert len(questions) == 2 and questions[0].json["model"] == "gpt-4o-mini"
    repair = questions[1].json["messages"]
    assert repair[-2]["content"] == "Sure! The Postgres one first."
    assert "cannot be used" in repair[-1]["content"]
    assert shown["rerank"]["fallback"] is None
    assert shown["items"][0]["text"].endswith(SAID[2])


def test_an_llm_answer_still_malformed_after_its_repair_falls_back(
    remembering: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = remembering(rerank="llm", rerank_model="gpt-4o-mini")
    expected = fused_block(proxy)
    upstream.respond_with(llm_ranker(['{"order": [0, 0]}', '{"order": [1, 999]}']))
    answer = dry_run(proxy)
    assert answer.headers["x-memory-error"] == "rerank: malformed"
    assert answer.json()["block"] == expected


def test_a_reranked_session_keeps_its_first_block_byte_for_byte(
    remembering: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    reranker: ScriptedUpstream,
) -> None:
    proxy = remembering(memory_budget=120)  # room for the reranker's first choice and little more
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": QUESTION}]
    reply = chat(proxy, first, session="s1", user="ada")
    sent_first = upstream.history[-1].json["messages"]
    assert SAID[2] in sent_first[0]["content"]  # the reranker's choice
    # The reranker now puts the dog first: a later block may add it, the first stays.
    reranker.respond_with(lambda r: JSONReply({"results": [
        {"index": i, "relevance_score": 1.0 if "dog" in d else 0.0}
        for i, d in enumerate(r.json["documents"])]}))
    second = [*first, {"role": "assistant", "content": reply.text},
              {"role": "user", "content": "And what do I do every morning?"}]
    answered = chat(proxy, second, session="s1", user="ada")
    assert "x-memory-error" not in answered.headers
    sent_second = upstream.history[-1].json["messages"]
    assert sent_second[: len(sent_first)] == sent_first
    added = "".join(m["content"] for m in sent_second[len(sent_first):] if m["role"] == "system")
    assert SAID[2] not in added  # nothing the first block shows is shown again

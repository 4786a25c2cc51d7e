"""Fact lifecycle (expiry, caps, pinning, eviction) and the learned part of the memory block."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import tiktoken

from memory.engine import MemoryEngine
from memory.learning.fact_rules import grounded_in, same_subject_new_value
from memory.learning.llm_output import MalformedOutput, parse_json, validate_facts
from memory.recall.block import FACTS_HEADING, PROFILE_HEADING
from memory.recall.learned_recall import is_personal
from memory.recall.outcome import RecallRequest
from memory.storage.turns import NewTurn

pytestmark = pytest.mark.both_backends

DAY = 86400.0


@pytest.fixture
async def engine(make_settings: Callable[..., Any], embedder: Any) -> AsyncIterator[MemoryEngine]:
    engine = await MemoryEngine.open(make_settings(fact_prune_at=3), embedder=embedder)
    yield engine
    await engine.close()


async def ask(engine: MemoryEngine, question: str, budget: int, user: str = "ada") -> Any:
    return await engine.recall(RecallRequest(
        user, "question", [{"role": "user", "content": question}], "gpt-4o", budget, "user"))


async def test_pruning_evicts_by_value_and_keeps_pinned_and_user_written_facts(
    engine: MemoryEngine,
) -> None:
    add = engine.facts.add
    pinned = await add("ada", "User is at a conference in Oslo", "context", pinned=True)
    stale = await add("ada", "User is debugging a flaky test", "context", confidence=0.7,
                      source="extracted")
    taste = await add("ada", "User prefers tabs over spaces", "preference", confidence=0.9,
                      source="extracted")
    name = await add("ada", "User's name is Ada Byron", "identity", confidence=0.9,
                     source="extracted")
    todo = await add("ada", "User wants to renew the TLS certificates", "todo")  # manual
    await add("bob", "User likes chess", "preference", source="extracted")
    pruned = await engine.prune()
    assert pruned["evicted_facts"] == 2
    left, _ = await engine.facts.list("ada")
    assert {f.id for f in left} == {pinned.id, name.id, todo.id}
    assert await engine.facts.get("ada", stale.id) is None
    assert await engine.facts.get("ada", taste.id) is None
    assert await engine.facts.count("bob") == 1


async def test_expired_facts_are_not_recalled_and_are_deleted_after_retention(
    engine: MemoryEngine,
) -> None:
    now = time.time()
    # Both expired, neither yet past the 90 days' retention: the engine's own hourly round,
    # which may start at any await here, deletes neither. Pruning as of 85 days on does.
    recent = await engine.facts.add("ada", "User is travelling to Kyoto", "context",
                                    source="extracted", expires_at=now - 1 * DAY)
    old = await engine.facts.add("ada", "User is travelling to Quito", "context",
                                 source="extracted", expires_at=now - 10 * DAY)
    live = await engine.facts.add("ada", "User is travelling to Lima", "context",
                                  source="extracted")
    await engine.worker.run_until_idle(timeout=20)
    result = await ask(engine, "Where is the user travelling to?", 1000)
    assert "Lima" in result.block and "Kyoto" not in result.block and "Quito" not in result.block
    assert (await engine.prune(now + 85 * DAY))["expired_facts"] == 1
    assert await engine.facts.get("ada", old.id) is None
    assert await engine.facts.get("ada", recent.id) is not None
    assert (await engine.facts.get("ada", live.id)) is not None


async def test_the_block_holds_facts_profile_summary_and_turns_within_an_exact_budget(
    engine: MemoryEngine,
) -> None:
    facts = [
        ("User's name is Ada Byron and she lives in Lisbon", "identity"),
        ("User is building the invoice export service in Go", "project"),
        ("User's invoice service deploys to Kubernetes on Fridays", "project"),
        ("User prefers Postgres for the invoice service database", "preference"),
        ("User decided to use gRPC between the invoice services", "decision"),
    ]
    for text, category in facts:
        await engine.facts.add("ada", text, category, confidence=0.9)
    await engine.profiles.set_consent("ada", True)
    await engine.profiles.put("ada", {"role": "staff engineer"}, "I own invoicing end to end.")
    await engine.summaries.put(
        "ada", "s1", "The user planned the invoice export service: Go, Postgres, gRPC.",
        {"decisions": ["gRPC"]}, source_turn_ids=[1, 2], last_turn_id=2, user_turns=5, tokens=20,
    )
    for i in range(6):
        await engine.remember_request("ada", f"old-{i}", [{"role": "user", "content": (
            f"Note {i}: the invoice export service batches rows and retries failed uploads "
            "with exponential backoff. " * 3)}], model="gpt-4o", request_id=f"r{i}")
    await engine.worker.run_until_idle(timeout=30)

    encoding = tiktoken.get_encoding("o200k_base")
    question = "How should the invoice export service handle retries and deploys?"
    for budget in (40, 60, 90, 150, 250, 500, 1000, 3000):
        result = await ask(engine, question, budget)
        assert len(encoding.encode(result.block)) == result.tokens <= budget, budget
    block = (await ask(engine, question, 3000)).block
    order = [block.index(h) for h in (FACTS_HEADING, PROFILE_HEADING, "Summary of an earlier",
                                      "Relevant past turns:")]
    assert order == sorted(order)
    items = (await ask(engine, question, 3000)).items
    summary = next(item for item in items if item.source == "summary")
    assert summary.turn_ids == [1, 2]
    assert {item.source for item in items} == {"fact", "profile", "summary", "turn"}

    tight = (await ask(engine, question, 75)).block
    assert "invoice export service in Go" in tight and "Ada Byron" not in tight
    personal = (await ask(engine, "What is my name and where do I live?", 75)).block
    assert "Ada Byron" in personal
    await engine.profiles.set_consent("ada", False)
    assert PROFILE_HEADING not in (await ask(engine, question, 3000)).block
    assert FACTS_HEADING not in (await ask(engine, question, 3000, user="bob")).block


async def test_session_scope_uses_only_that_sessions_learned_items(engine: MemoryEngine) -> None:
    await engine.facts.add("ada", "User runs the payroll batch at night", "project",
                           source="extracted", source_session="s1")
    await engine.facts.add("ada", "User runs the payroll reports monthly", "project",
                           source="extracted", source_session="s2")
    await engine.log.append_turns("ada", "s1", [NewTurn("user", "hello there")])
    await engine.worker.run_until_idle(timeout=20)
    result = await engine.recall(RecallRequest(
        "ada", "s1", [{"role": "user", "content": "When does the payroll run happen?"}],
        "gpt-4o", 1000, "session"))
    assert "at night" in result.block and "monthly" not in result.block


def test_the_rules_for_subjects_grounding_and_personal_queries() -> None:
    assert same_subject_new_value("User lives in Berlin.", "User lives in Paris.")
    assert same_subject_new_value("User's favourite editor is Vim", "User's favourite editor is Helix")
    assert not same_subject_new_value("User likes tea.", "User likes coffee.")
    assert not same_subject_new_value("User is a runner.", "User is a vegetarian.")
    assert not same_subject_new_value("User lives in Berlin", "User lives in Berlin, Germany")
    assert grounded_in("User keeps a cat named Miso", ["my cat Miso"], ["cats are great"])
    assert not grounded_in("User's server runs Debian", ["how do I patch my server?"],
                           ["your server runs Debian"])
    assert is_personal("what is my name?") and not is_personal("how do I deploy the service?")


def test_model_output_is_read_tolerantly_and_checked_strictly() -> None:
    assert parse_json('Here:\n```json\n[{"a": 1},]\n```\nbye') == [{"a": 1}]
    assert parse_json('The facts are [1, 2] as asked.') == [1, 2]
    with pytest.raises(MalformedOutput):
        parse_json("no json here")
    good = {"fact": "User likes Go", "category": "preference", "confidence": 0.8,
            "importance": 7, "expires": "2030-01-02", "updates_previous": 4}
    [item] = validate_facts({"facts": [good]})
    assert item.updates_previous == 4 and item.expires is not None
    for bad in ({**good, "category": "gossip"}, {**good, "confidence": "high"},
                {**good, "importance": 7.5}, {**good, "expires": "soon"}, {"fact": "x"}):
        with pytest.raises(MalformedOutput):
            validate_facts([bad])

"""The facts, summaries and profile stores on a real engine: scoping, versions, vectors."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from memory.engine import MemoryEngine
from memory.learning.facts import FactError, FactNotFound
from memory.learning.profiles import ConsentRequired, profile_vector_id
from tests.support.sql import query as sql_query

pytestmark = pytest.mark.both_backends


@pytest.fixture
async def engine(make_settings: Callable[..., Any], embedder: Any) -> AsyncIterator[MemoryEngine]:
    engine = await MemoryEngine.open(make_settings(fact_max_pinned=2), embedder=embedder)
    yield engine
    await engine.close()


async def vector_ids(engine: MemoryEngine, user_id: str, source: str) -> set[str]:
    """Ids of the user's vectors of one source, once every queued job has run."""
    await engine.worker.run_until_idle(timeout=20)
    probe = (await engine.embedder.embed(["anything"]))[0]
    hits = engine.vectors.query(probe, k=100, where={"user_id": user_id, "source": source})
    return {key for key, _ in hits}


def rows(engine: MemoryEngine, sql: str) -> list[Any]:
    return sql_query(engine.settings, sql)


async def test_facts_are_scoped_listed_newest_first_and_paginated(engine: MemoryEngine) -> None:
    facts = engine.facts
    added = [await facts.add("ada", f"Ada uses tool number {i}", "preference") for i in range(5)]
    await facts.add("ada", "Ada works on the billing service", "project", pinned=True)
    bob = await facts.add("bob", "Bob likes tea", "preference")
    assert await facts.get("ada", bob.id) is None
    assert (await facts.get("bob", bob.id)) == bob
    assert bob.source == "manual" and bob.mentions == 1 and bob.version == 1 and bob.active

    seen, cursor, pages = [], None, 0
    while True:
        page, cursor = await facts.list("ada", limit=2, cursor=cursor)
        seen += page
        pages += 1
        if cursor is None:
            break
    assert pages == 3 and [f.id for f in seen] == sorted((f.id for f in seen), reverse=True)
    assert {f.user_id for f in seen} == {"ada"} and len(seen) == 6

    projects, _ = await facts.list("ada", category="project")
    assert [f.text for f in projects] == ["Ada works on the billing service"]
    pinned, _ = await facts.list("ada", pinned=True)
    assert pinned == projects
    found, _ = await facts.list("ada", query="billing")
    assert found == projects
    assert (await facts.list("bob", query="billing"))[0] == []
    assert await facts.count("ada") == 6 and await facts.count("bob") == 1
    assert added[0].id in {f.id for f in seen}


async def test_bad_arguments_name_their_parameter(engine: MemoryEngine) -> None:
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("category", lambda: engine.facts.add("ada", "x", "gossip")),
        ("confidence", lambda: engine.facts.add("ada", "x", "context", confidence=1.5)),
        ("importance", lambda: engine.facts.add("ada", "x", "context", importance=11)),
        ("text", lambda: engine.facts.add("ada", "   ", "context")),
        ("source", lambda: engine.facts.add("ada", "x", "context", source="rumour")),
        ("limit", lambda: engine.facts.list("ada", limit=0)),
        ("cursor", lambda: engine.facts.list("ada", cursor="next")),
        ("fact_id", lambda: engine.facts.edit("ada", 999, text="y")),
    ]
    for param, call in cases:
        with pytest.raises(FactError) as raised:
            await call()
        assert raised.value.param == param
    with pytest.raises(FactNotFound):
        await engine.facts.set_pinned("ada", 999, True)


async def test_an_edit_is_a_new_version_and_the_old_one_stays_as_history(
    engine: MemoryEngine,
) -> None:
    first = await engine.facts.add("ada", "Ada lives in Berlin", "identity", confidence=0.9)
    second = await engine.facts.edit("ada", first.id, text="Ada lives in Paris")
    assert second.id != first.id and second.version == 2 and second.previous_id == first.id
    old = await engine.facts.get("ada", first.id)
    assert old is not None and not old.active
    assert old.superseded_by == second.id and old.valid_to is not None
    assert second.confidence == 0.9 and second.first_seen == first.first_seen
    current, _ = await engine.facts.list("ada")
    assert [f.id for f in current] == [second.id]
    everything, _ = await engine.facts.list("ada", include_inactive=True)
    assert {f.id for f in everything} == {first.id, second.id}
    history = await engine.facts.history("ada", first.id)
    assert [f.text for f in history] == ["Ada lives in Berlin", "Ada lives in Paris"]
    assert await engine.facts.history("ada", second.id) == history
    assert await engine.facts.history("bob", first.id) == []
    with pytest.raises(FactError) as raised:
        await engine.facts.edit("ada", first.id, text="Ada lives in Rome")
    assert raised.value.param == "fact_id"
    assert await vector_ids(engine, "ada", "fact") == {f"f{second.id}"}


async def test_delete_removes_the_whole_chain_and_its_vectors(engine: MemoryEngine) -> None:
    first = await engine.facts.add("ada", "Ada drinks green tea", "preference")
    second = await engine.facts.edit("ada", first.id, text="Ada drinks black tea")
    keep = await engine.facts.add("ada", "Ada runs on Sundays", "preference")
    assert await vector_ids(engine, "ada", "fact") == {f"f{second.id}", f"f{keep.id}"}
    assert not await engine.facts.delete("bob", second.id)
    assert await engine.facts.delete("ada", first.id)
    assert await engine.facts.get("ada", second.id) is None
    assert await engine.facts.history("ada", first.id) == []
    assert await vector_ids(engine, "ada", "fact") == {f"f{keep.id}"}
    if engine.db.dialect == "sqlite":  # on PostgreSQL a row's words go with the row
        assert rows(engine, "SELECT rowid FROM facts_fts WHERE facts_fts MATCH 'tea'") == []


async def test_pinning_is_capped_and_pinned_facts_never_expire(engine: MemoryEngine) -> None:
    past = time.time() - 60
    a = await engine.facts.add("ada", "Ada is on call this week", "context", expires_at=past)
    b = await engine.facts.add("ada", "Ada prefers dark mode", "preference")
    c = await engine.facts.add("ada", "Ada writes Rust", "preference")
    assert not a.active and await engine.facts.count("ada") == 2
    assert await engine.facts.count("ada", active_only=False) == 3
    assert (await engine.facts.set_pinned("ada", a.id, True)).active  # pinned: kept
    await engine.facts.set_pinned("ada", b.id, True)
    with pytest.raises(FactError) as raised:
        await engine.facts.set_pinned("ada", c.id, True)
    assert raised.value.param == "pinned"
    await engine.facts.set_pinned("ada", b.id, False)
    assert (await engine.facts.set_pinned("ada", c.id, True)).pinned
    assert await engine.facts.count("ada") == 3


async def test_extracted_facts_expire_by_category(engine: MemoryEngine) -> None:
    lifetimes = engine.settings.fact_lifetimes_days()
    assert lifetimes["project"] == 60 and lifetimes["context"] == 7
    assert lifetimes["preference"] == 180 and lifetimes["identity"] == 365
    for category, days in lifetimes.items():
        fact = await engine.facts.add("ada", f"a {category} fact", category, source="extracted")
        assert fact.expires_at is not None
        assert abs(fact.expires_at - fact.first_seen - days * 86400) < 1
    manual = await engine.facts.add("ada", "Ada's name is Ada Lovelace", "identity")
    assert manual.expires_at is None  # facts the user wrote expire only when told


async def test_summaries_roll_up_and_only_the_current_one_has_a_vector(
    engine: MemoryEngine,
) -> None:
    data = {"facts": ["Ada uses Postgres"], "todos": [], "entities": ["Postgres"]}
    first = await engine.summaries.put(
        "ada", "s1", "Ada set up Postgres.", data, source_turn_ids=[1, 2], last_turn_id=2,
        user_turns=5, tokens=6,
    )
    second = await engine.summaries.put(
        "ada", "s1", "Ada set up Postgres and pgvector.", data, source_turn_ids=[1, 2, 3],
        last_turn_id=3, user_turns=10, tokens=8,
    )
    other = await engine.summaries.put(
        "ada", "s2", "Ada planned a trip.", {}, source_turn_ids=[9], last_turn_id=9,
        user_turns=5, tokens=5,
    )
    assert [s.id for s in await engine.summaries.list("ada", "s1")] == [second.id]
    assert [s.id for s in await engine.summaries.list("ada")] == [other.id, second.id]
    history = await engine.summaries.list("ada", "s1", include_history=True)
    assert [s.id for s in history] == [second.id, first.id]
    assert history[1].superseded_by == second.id and second.data["decisions"] == []
    assert await engine.summaries.latest("bob", "s1") is None
    assert await engine.summaries.get("bob", second.id) is None
    assert await vector_ids(engine, "ada", "summary") == {f"s{second.id}", f"s{other.id}"}


async def test_a_profile_needs_consent_and_revoking_deletes_it_and_its_vector(
    engine: MemoryEngine,
) -> None:
    profiles = engine.profiles
    assert not await profiles.consent("ada")
    with pytest.raises(ConsentRequired) as raised:
        await profiles.put("ada", {"name": "Ada"}, "I build compilers.")
    assert raised.value.param == "consent"
    await profiles.set_consent("ada", True)
    profile = await profiles.put("ada", {"name": "Ada", "languages": ["OCaml", "Rust"]},
                                 "I build compilers.")
    assert profile.render() == "name: Ada\nlanguages: OCaml, Rust\nI build compilers."
    assert await profiles.get("ada") == profile and await profiles.get("bob") is None
    assert await vector_ids(engine, "ada", "profile") == {profile_vector_id("ada")}
    await profiles.set_consent("ada", False)
    assert await profiles.get("ada") is None and not await profiles.consent("ada")
    assert rows(engine, "SELECT * FROM profiles") == []
    assert await vector_ids(engine, "ada", "profile") == set()

"""Engines of several replicas on one PostgreSQL and one Chroma server: a replica's vector
copies follow the other replicas' writes (vector generations)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from config import Settings
from memory.engine import MemoryEngine, RecallRequest
from tests.support.servers import ChromaServer, PostgresServer


@pytest.fixture
def shared_settings(
    make_settings: Callable[..., Settings], chroma_server: ChromaServer,
    postgres_server: PostgresServer,
) -> Settings:
    """One new database and collection; dense recall only (as test_scale_out does), so only
    the vectors can find a turn."""
    return make_settings(
        database_url=postgres_server.create_database(), chroma_url=chroma_server.url,
        weight_bm25=0.0, recall_cache_entries=0,
    )


@pytest.fixture
async def replicas(
    shared_settings: Settings, embedder: Any
) -> AsyncIterator[tuple[MemoryEngine, MemoryEngine]]:
    first = await MemoryEngine.open(shared_settings, embedder=embedder)
    second = await MemoryEngine.open(shared_settings, embedder=embedder)
    yield first, second
    await first.close()
    await second.close()


def question(text: str, session: str = "q") -> RecallRequest:
    return RecallRequest("ada", session, [{"role": "user", "content": text}], "gpt-4o", 500, "user")


async def say(engine: MemoryEngine, session: str, text: str) -> None:
    await engine.remember_request(
        "ada", session, [{"role": "user", "content": text}], model="gpt-4o", request_id=session
    )
    await engine.worker.run_until_idle(timeout=30)


async def test_a_replica_recalls_by_meaning_what_another_replica_indexed_since_its_copy_loaded(
    replicas: tuple[MemoryEngine, MemoryEngine],
) -> None:
    reader, writer = replicas
    await reader.stop_jobs(timeout=1)  # every job runs on the writer
    await say(writer, "s1", "I keep my bicycle in the garage next to the workbench.")
    before = await reader.recall(question("Where is our sailing boat moored?"))
    assert "bicycle" in before.block  # the reader's copy of ada's vectors is loaded
    assert "Pier 39" not in before.block

    await say(writer, "s2", "Our sailing boat is moored at Pier 39 in the old marina.")
    after = await reader.recall(question("Where is our sailing boat moored?"))

    assert "Pier 39" in after.block
    assert after.items[0].text.endswith("Pier 39 in the old marina.")


async def test_a_replica_keeps_its_copy_current_through_its_own_writes(
    replicas: tuple[MemoryEngine, MemoryEngine],
) -> None:
    engine, _ = replicas
    await say(engine, "s1", "I keep my bicycle in the garage next to the workbench.")
    await engine.recall(question("Where is the bicycle?"))
    copy = engine.vectors._cache._users["ada"]
    await say(engine, "s2", "Our sailing boat is moored at Pier 39 in the old marina.")

    found = await engine.recall(question("Where is our sailing boat moored?"))

    assert "Pier 39" in found.block
    # Kept in step and advanced to the new generation, not dropped and loaded again.
    assert engine.vectors._cache._users["ada"] is copy

"""Engines of several replicas on one PostgreSQL and one Chroma server: a replica's vector
copies follow the other replicas' writes (vector generations), and learning for one user on
two replicas at once gives the facts one replica would (the facts lock), and two summary jobs
of one session at once give the summary one replica would (the summary lock)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from config import Settings
from memory.engine import MemoryEngine
from memory.recall.outcome import RecallRequest
from tests.support.servers import ChromaServer, PostgresServer

pytestmark = pytest.mark.replicas


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


class Extractor:
    """The learning model: every extraction answers the same fact; with `together`, no
    answer is given until that many calls are waiting (so their jobs apply it at once)."""

    def __init__(self, together: int = 1) -> None:
        self.barrier = asyncio.Barrier(together)

    async def __call__(
        self, model: str, messages: list[dict[str, Any]], *, user_id: str, route: str = "openai"
    ) -> str:
        await self.barrier.wait()
        return json.dumps([{
            "fact": "User uses Helix as their code editor", "category": "preference",
            "confidence": 0.9, "importance": 8, "updates_previous": None, "expires": None,
        }])


async def learn(engine: MemoryEngine, user: str, session: str) -> None:
    """The extract_facts job of one exchange in which `user` names their editor."""
    turn_id = await engine.remember_request(
        user, session, [{"role": "user", "content": "I use Helix as my code editor these days."}],
        model="gpt-4o", request_id=session,
    )
    await engine.learner.extract(
        {"user_id": user, "session_id": session, "turn_id": turn_id, "model": "gpt-4o"}
    )


async def test_two_replicas_learning_for_one_user_at_once_merge_as_one_replica_would(
    replicas: tuple[MemoryEngine, MemoryEngine],
) -> None:
    first, second = replicas
    first.learner.llm = Extractor()
    await learn(first, "grace", "s1")
    await learn(first, "grace", "s2")
    alone = [(f.text, f.mentions) for f in await first.facts.active("grace")]
    assert alone == [("User uses Helix as their code editor", 2)]  # merged, as one replica does

    both = Extractor(together=2)
    first.learner.llm = second.learner.llm = both
    await asyncio.gather(learn(first, "ada", "s1"), learn(second, "ada", "s2"))

    assert [(f.text, f.mentions) for f in await second.facts.active("ada")] == alone


class Summarizer:
    """The learning model for summaries. A prompt without `later` (the earlier job's) is
    answered only once the later job's has been, or after a second: without a lock the
    earlier job would store its summary last."""

    def __init__(self, later: str) -> None:
        self.later, self.later_answered, self.calls = later, asyncio.Event(), 0

    async def __call__(
        self, model: str, messages: list[dict[str, Any]], *, user_id: str, route: str = "openai"
    ) -> str:
        self.calls += 1
        if self.later in json.dumps(messages):
            self.later_answered.set()
            return json.dumps({"text": "Ada moved to Lisbon and adopted a cat called Miso."})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.later_answered.wait(), 1.0)
        return json.dumps({"text": "Ada moved to Lisbon."})


async def test_two_replicas_summarizing_one_session_at_once_keep_the_later_summary(
    replicas: tuple[MemoryEngine, MemoryEngine],
) -> None:
    first, second = replicas
    said = [{"role": "user", "content": "I moved to Lisbon last month."}]
    earlier = await first.remember_request("ada", "s1", said, model="gpt-4o", request_id="r1")
    said.append({"role": "user", "content": "We adopted a cat, Miso."})
    later = await first.remember_request("ada", "s1", said, model="gpt-4o", request_id="r2")
    assert earlier is not None and later is not None
    first.learner.llm = second.learner.llm = model = Summarizer(later="adopted a cat")

    await asyncio.gather(*(
        engine.learner.summarize(
            {"user_id": "ada", "session_id": "s1", "turn_id": turn, "model": "gpt-4o"})
        for engine, turn in ((first, earlier), (second, later))
    ))

    current = await second.summaries.latest("ada", "s1")
    assert current is not None
    assert (current.last_turn_id, current.source_turn_ids) == (later, [earlier, later])
    assert current.text.endswith("a cat called Miso.")
    assert model.calls in (1, 2)  # the later job first makes the earlier one a no-op

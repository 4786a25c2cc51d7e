"""The recall query's vector with the speakers' names set apart (memory/recall/speakers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from memory import LocalEmbedder
from memory.recall.speakers import SpeakerQuery, combine, named, without
from memory.storage.turns import NewTurn
from tests.support.storage import Storage

pytestmark = pytest.mark.both_backends

TURNS = [
    "Caroline: Lovely sunny weather at the beach today, Melanie!",
    "Caroline: Thanks, Melanie, you're the best friend ever!",
    "Melanie: We went to the pottery workshop with the kids last Friday.",
    "Caroline: I went to a LGBTQ support group yesterday.",
]


@pytest.fixture
async def store(tmp_path: Path, database_url: str | None) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "memory.db", url=database_url)
    await store.log.append_turns("u", "s", [
        NewTurn("user", "Hi Mel!", name="Caroline"),
        NewTurn("assistant", "Hey Caroline!", name="Melanie"),
        NewTurn("user", "Plain turn without a name."),
        NewTurn("assistant", "A reply said as a role.", name="assistant"),
    ])
    await store.log.append_turns("other", "s", [NewTurn("user", "Hello", name="Zed")])
    yield store
    await store.close()


class Counted:
    """The real model, with the texts it was asked to embed."""

    def __init__(self, model: LocalEmbedder) -> None:
        self.model = model
        self.asked: list[list[str]] = []

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.asked.append(list(texts))
        return await self.model.embed(texts)


def test_names_are_found_and_taken_out_as_whole_words_in_any_case() -> None:
    names = ["Jo", "Joanna", "Ana Lopez", "Ana"]
    assert named("What did JOANNA's dog eat?", names) == ["Joanna"]
    assert named("Did ana lopez meet Jo?", names) == ["Jo", "Ana Lopez", "Ana"]
    assert named("What did Anastasia say?", names) == []
    assert without("What did JOANNA's dog eat?", ["Joanna"]) == "What did dog eat?"
    # The longer name goes first, so nothing of it is left behind.
    assert without("Did Ana Lopez meet Jo?", ["Ana", "Jo", "Ana Lopez"]) == "Did meet ?"


def test_each_name_adds_its_weight_and_the_sum_is_a_unit_vector() -> None:
    query, name = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    assert np.allclose(combine(query, [name], 0.3), np.array([1.0, 0.3]) / np.hypot(1.0, 0.3))
    assert np.allclose(combine(query, [], 0.3), query)


async def test_the_names_are_the_users_speakers_not_roles(store: Storage, embedder: LocalEmbedder) -> None:
    speakers = SpeakerQuery(store.db, embedder.embed, weight=0.3)
    assert await speakers.names("u") == ["Caroline", "Melanie"]
    assert await speakers.names("nobody") == []


async def test_a_named_speaker_no_longer_outweighs_the_topic(
    store: Storage, embedder: LocalEmbedder
) -> None:
    question = "Which workshop did Caroline take the kids to?"
    turns = embedder.embed_sync(TURNS)
    model = Counted(embedder)
    plain = (await SpeakerQuery(store.db, model.embed, weight=0.3, enabled=False).embed("u", question))[0]
    # As written, the name pulls the question towards what Caroline said about other things.
    assert int(np.argmax(turns @ plain)) == 3
    speakers = SpeakerQuery(store.db, model.embed, weight=0.3)
    split = (await speakers.embed("u", question))[0]
    assert int(np.argmax(turns @ split)) == 2  # the pottery workshop
    rest, name = embedder.embed_sync(["Which workshop did take the kids to?", "Caroline"])
    expected = combine(rest, [name], 0.3)
    assert np.allclose(split, expected, atol=1e-5)
    # The name's vector is kept: the next question embeds only its own text.
    await speakers.embed("u", "Did Caroline paint?")
    assert model.asked[-1] == ["Did paint?"]


async def test_a_query_naming_nobody_embeds_as_written(store: Storage, embedder: LocalEmbedder) -> None:
    model = Counted(embedder)
    speakers = SpeakerQuery(store.db, model.embed, weight=0.3)
    for question in ("Which workshop did the kids go to?", "Caroline?", "What did Zed say?"):
        vector = await speakers.embed("u", question)
        assert np.allclose(vector, embedder.embed_sync([question]))
    # Only a name: nothing would be left to embed. Zed speaks in another user's memory.
    assert model.asked == [[q] for q in ("Which workshop did the kids go to?", "Caroline?",
                                         "What did Zed say?")]

"""Lexical search keeps a query's rarest words when its common ones would match too much."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from memory.recall.lexical import TermSelector
from memory.storage import turns
from memory.storage.turns import NewTurn
from tests.support.storage import Storage

pytestmark = pytest.mark.both_backends


@pytest.fixture
async def store(tmp_path: Path, database_url: str | None) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "memory.db", url=database_url)
    yield store
    await store.close()


def count_in(store: Storage) -> Callable[[Sequence[str]], Awaitable[list[int]]]:
    return lambda words: turns.chunk_term_counts(store.db, words)


async def add(store: Storage, user: str, text: str) -> None:
    result = await store.log.append_turns(user, "s", [NewTurn("user", text)])
    await store.log.add_chunks(result.new_ids[0], [(0, "prose", text, 5)])


async def test_the_commonest_words_go_once_their_rows_pass_the_budget(store: Storage) -> None:
    for i in range(30):
        await add(store, "ada", f"weekly project sync number {i}")
    for i in range(6):
        await add(store, "ada", f"the kayak trip plan {i}")
    await add(store, "bob", "kayak kayak")
    selector = TermSelector(count_in(store), budget=10)

    # Counts span every user: kayak is in 6 of ada's chunks and 1 of bob's.
    assert await selector.counts(["project", "kayak", "glacier"]) == {
        "project": 30, "kayak": 7, "glacier": 0,
    }
    # glacier matches nothing and goes; trip (6) fits in 10 rows, kayak (7) would pass them.
    assert await selector.select(["project", "kayak", "trip", "glacier"]) == ["trip"]
    # The rarest word stays even alone over the budget.
    tight = TermSelector(count_in(store), budget=3)
    assert await tight.select(["project", "kayak", "trip"]) == ["trip"]
    roomy = TermSelector(count_in(store), budget=100)
    assert await roomy.select(["project", "kayak", "trip", "glacier"]) == [
        "project", "kayak", "trip",
    ]


async def test_counts_are_reused_until_they_expire(store: Storage) -> None:
    await add(store, "ada", "kayak")
    selector = TermSelector(count_in(store))
    assert await selector.counts(["kayak"]) == {"kayak": 1}
    await add(store, "ada", "kayak again")
    assert await selector.counts(["kayak"]) == {"kayak": 1}  # cached
    selector._counts.clear()  # what expiry does after COUNT_TTL_SECONDS
    assert await selector.counts(["kayak"]) == {"kayak": 2}
    # A word nobody has said is counted again each time, so it is found as soon as said.
    assert await selector.counts(["glacier"]) == {"glacier": 0}
    await add(store, "ada", "glacier")
    assert await selector.counts(["glacier"]) == {"glacier": 1}


async def test_search_finds_a_rare_word_among_common_ones(store: Storage) -> None:
    for i in range(40):
        await add(store, "ada", f"meeting notes about the meeting agenda {i}")
    await add(store, "ada", "meeting about the glacier survey")
    hits = await store.lexical.search("ada", "meeting agenda notes glacier", k=3)
    chunk = await store.log.get_chunks([hits[0][0]])
    assert "glacier" in chunk[0].text

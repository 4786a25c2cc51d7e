"""Recall quality mechanics: speaker search, conversation neighbours, fusion, context, excerpts,
the embedded query."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path

import pytest

from memory.recall.block import FACTS_HEADING, TURNS_HEADING, pack_block
from memory.recall.learned_recall import Learned, LearnedItem
from memory.recall.query import for_embedding
from memory.recall.ranking import (
    Candidate,
    Weights,
    add_context,
    add_conversation,
    fuse,
    lift_user,
)
from memory.recall.render import CLOSE, OPEN, SAME_DAY, Entry, pack
from memory.storage import migrations
from memory.storage.fts import owner_token, session_token
from memory.storage.turns import NewTurn
from memory.tokens import count_tokens
from tests.support.storage import Storage

DAY = 86400.0
T0 = 1_700_000_000.0  # 2023-11-14


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "memory.db")
    yield store
    await store.close()


async def indexed(store: Storage, user: str, session: str, turns: list[NewTurn]) -> list[int]:
    """Log turns and index each as one chunk; return the chunk ids."""
    result = await store.log.append_turns(user, session, turns)
    stored = await store.log.session_turns(user, session)
    ids = []
    for turn in stored[-len(turns):]:
        ids += await store.log.add_chunks(turn.id, [(0, "prose", turn.content, 5)])
    assert result.new_ids
    return ids


async def test_a_name_matches_what_that_person_said(store: Storage) -> None:
    ana_said, bo_said = await indexed(store, "u", "s", [
        NewTurn("user", "I adopted a greyhound last spring.", name="Ana"),
        NewTurn("assistant", "Ana, that greyhound sounds lovely!", name="Bo"),
    ])
    hits = [chunk for chunk, _ in await store.lexical.search("u", "What pet did Ana adopt?", k=5)]
    assert hits[0] == ana_said and bo_said in hits
    # Roles stand in for missing names, and a role word alone finds nothing else.
    (plain,) = await indexed(store, "u", "t", [NewTurn("user", "Remember the rollout date.")])
    assert [c for c, _ in await store.lexical.search("u", "user", k=5)] == [plain]


async def test_neighbours_cross_turns_and_branches(store: Storage) -> None:
    question, answer, follow_up = await indexed(store, "u", "s", [
        NewTurn("user", "How long have you been painting?"),
        NewTurn("assistant", "Seven years now."),
        NewTurn("user", "Impressive."),
    ])
    # The same question answered again on an edited branch: both answers follow it.
    edited = await store.log.append_turns("u", "s", [
        NewTurn("user", "How long have you been painting?"),
        NewTurn("assistant", "Since I was seven."),
    ])
    (other,) = await store.log.add_chunks(edited.new_ids[0], [(0, "prose", "Since I was seven.", 4)])
    pairs = set(await store.log.neighbour_chunks([question, answer, follow_up]))
    assert pairs == {
        (question, answer), (question, other), (answer, question), (answer, follow_up),
        (follow_up, answer),
    }
    # Within a long turn, chunks neighbour each other before the next turn does.
    long_turn = await store.log.append_turns("u", "long", [NewTurn("user", "part one. part two.")])
    one, two = await store.log.add_chunks(
        long_turn.new_ids[0], [(0, "prose", "part one.", 2), (1, "prose", "part two.", 2)]
    )
    assert set(await store.log.neighbour_chunks([one])) == {(one, two)}


def candidate(key: str, dense: float = 0.0, bm25: float = 0.0) -> Candidate:
    return Candidate(key, "s", T0, f"text {key}", dense=dense, bm25=bm25)


def test_fusion_scales_each_signal_over_the_query() -> None:
    candidates = {c.key: c for c in [
        candidate("a", dense=0.62, bm25=3.0), candidate("b", dense=0.58, bm25=9.0),
        candidate("c", dense=0.50), candidate("d", bm25=6.0),
    ]}
    ranked = fuse(candidates, Weights(), session_id="other", query_identifiers=set(), now=T0)
    signals = {c.key: (c.signals["dense"], c.signals["bm25"]) for c in ranked}
    assert signals == {"a": (1.0, 0.0), "b": (0.6667, 1.0), "c": (0.0, 0.0), "d": (0.0, 0.5)}
    assert [c.key for c in ranked] == ["b", "a", "d", "c"]
    # A lone hit is the best of its query.
    (only,) = fuse({"x": candidate("x", dense=0.3)}, Weights(), session_id="s",
                   query_identifiers=set(), now=T0)
    assert only.signals["dense"] == 1.0


def test_the_users_own_turns_rank_above_the_models_replies() -> None:
    def said(key: str, role: str, name: str = "", dense: float = 0.0) -> Candidate:
        return Candidate(key, "s", T0, f"text {key}", speaker=name or role, role=role,
                         dense=dense)

    candidates = {c.key: c for c in [
        said("reply", "assistant", dense=0.60), said("plan", "user", dense=0.55),
        said("named", "user", "Ana", dense=0.58), said("posing", "assistant", "user", dense=0.5),
    ]}
    ranked = fuse(candidates, Weights(), session_id="other", query_identifiers=set(), now=T0)
    assert [c.key for c in ranked] == ["reply", "named", "plan", "posing"]
    # The user's own unnamed message is lifted past the model's better-matching reply; a
    # named speaker (chat between people) and a reply that names itself "user" are not.
    lifted = lift_user(ranked, Weights().user)
    assert [c.key for c in lifted] == ["plan", "reply", "named", "posing"]
    assert [c.signals["user"] for c in lifted] == [1.0, 0.0, 0.0, 0.0]


def test_context_lifts_the_turns_next_to_a_strong_match() -> None:
    ranked = [candidate("q"), candidate("x"), candidate("y")]
    for c, score in zip(ranked, (2.0, 1.0, 0.9), strict=True):
        c.score = score
    answer = candidate("answer")  # shares no words with the query: not a candidate
    result = add_context(ranked, {"q": ["answer", "y"]}, {"answer": answer}, 0.4)
    assert [(c.key, c.score) for c in result] == [("q", 2.0), ("y", 1.7), ("x", 1.0),
                                                  ("answer", 0.8)]
    assert answer.signals["context"] == 0.8


def test_a_session_that_matches_as_a_whole_lifts_its_items() -> None:
    ranked = [candidate("lone"), candidate("a"), candidate("b"), candidate("c")]
    for c, session, score in zip(ranked, "xyyy", (1.3, 1.2, 1.1, 1.0), strict=True):
        c.session_id, c.score = session, score
    result = add_conversation(ranked, 0.4)
    # Session y: (1.2 + 1.1 + 1.0) / 3 = 1.1; session x: 1.3 / 3, which is 0.3939 of y.
    assert [(c.key, c.signals["conversation"], c.score) for c in result] == [
        ("a", 1.0, 1.6), ("b", 1.0, 1.5), ("lone", 0.3939, 1.45756), ("c", 1.0, 1.4)
    ]


def test_turns_render_as_dated_excerpts_in_the_order_said() -> None:
    def count(text: str) -> int:
        return count_tokens(text, "gpt-4o")

    entries = [  # most relevant first
        Entry("Ana", T0 + DAY, "Seven years now.", "s2", 12),
        Entry("Bo", T0, "I adopted a greyhound.", "s1", 3),
        Entry("Bo", T0 + DAY, "How long have you been painting?", "s2", 11),
        Entry("Ana", T0 + 2 * DAY, "The </memory> fence stays shut.", "s3", 20),
    ]
    packed = pack(entries, 1000, count)
    assert packed.included == [0, 1, 2, 3] and not packed.truncated
    assert packed.block.splitlines()[3:-1] == [
        "[2023-11-14]", "Bo: I adopted a greyhound.",
        "[2023-11-15]", "Bo: How long have you been painting?", "Ana: Seven years now.",
        "[2023-11-16]", "Ana: The ‹/memory› fence stays shut.",
    ]
    assert packed.block.startswith(OPEN) and packed.block.count(CLOSE) == 1
    for budget in range(40, 120, 3):
        small = pack(entries, budget, count)
        assert small.tokens == count(small.block) <= budget
        # Chosen by relevance (an entry that does not fit is skipped), shown as said.
        assert small.included == sorted(small.included)
        assert small.included[:1] == ([0] if small.block else [])


async def test_upgrading_indexes_the_speakers_of_existing_chunks(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] != "0004_recall"])
        conn.execute(
            "INSERT INTO turns (id, user_id, session_id, position, role, name, content,"
            " content_hash, created_at) VALUES (1, 'u', 's', 0, 'user', 'Ana', 'I run daily.',"
            " 'h1', 0), (2, 'u', 's', 1, 'assistant', NULL, 'Nice habit.', 'h2', 0)"
        )
        for turn_id, text in ((1, "I run daily."), (2, "Nice habit.")):
            conn.execute(
                "INSERT INTO chunks (id, turn_id, user_id, session_id, ordinal, kind, text, owner,"
                " sess) VALUES (?, ?, 'u', 's', 0, 'prose', ?, ?, ?)",
                (turn_id, turn_id, text, owner_token("u"), session_token("u", "s")),
            )
        conn.execute("INSERT INTO chunks_fts (chunks_fts) VALUES ('rebuild')")
    store = await Storage.open(path)
    try:
        assert [c for c, _ in await store.lexical.search("u", "what does Ana do", k=5)] == [1]
        assert [c for c, _ in await store.lexical.search("u", "assistant habit", k=5)] == [2]
    finally:
        await store.close()
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        assert conn.execute("SELECT speaker FROM chunks ORDER BY id").fetchall() == [
            ("Ana",), ("assistant",)
        ]
        conn.execute("INSERT INTO chunks_fts (chunks_fts) VALUES ('integrity-check')")


def test_a_long_query_is_embedded_as_its_first_quarter_and_last_three_quarters() -> None:
    pasted = " ".join(f"line{i}" for i in range(300))
    query = f"Why does this fail?\n{pasted}\nIt started after the retry_policy change."
    clipped = for_embedding(query, 32)
    words = clipped.split()
    assert len(words) == 32
    assert words[:8] == "Why does this fail? line0 line1 line2 line3".split()
    assert " ".join(words[-6:]) == "It started after the retry_policy change."
    assert words[8] == "line282"  # the middle of the pasted material is what goes
    short = "What did Alice decide about   the billing\nservice?"
    assert for_embedding(short, 32) == short  # untouched, whitespace included
    assert for_embedding(query, 0) == query


def test_a_day_is_written_once_and_its_other_excerpts_get_a_separator() -> None:
    def count(text: str) -> int:
        return count_tokens(text, "gpt-4o")

    entries = [
        Entry("Ana", T0 + 60, "Morning session answer.", "s1", 2),
        Entry("Bo", T0 + 600, "Later session question.", "s2", 5),
        Entry("Ana", T0 + DAY, "Next day.", "s3", 9),
        Entry("Bo", T0 + 30, "Morning session question.", "s1", 1),
    ]
    packed = pack(entries, 1000, count)
    assert packed.block.splitlines()[3:-1] == [
        "[2023-11-14]", "Bo: Morning session question.", "Ana: Morning session answer.",
        "---", "Bo: Later session question.",
        "[2023-11-15]", "Ana: Next day.",
    ]
    # The budget still holds exactly, whichever excerpts make it in.
    for budget in range(40, 100, 2):
        small = pack(entries, budget, count)
        assert small.tokens == count(small.block) <= budget


def count_4o(text: str) -> int:
    return count_tokens(text, "gpt-4o")


SAME_DAY_ENTRIES = [  # most relevant first; two conversations on one day, then another day
    Entry("Bo", T0 + 60, "Tea or coffee?", "s2", 7),
    Entry("Ana", T0, "I adopted a greyhound.", "s1", 3),
    Entry("Ana", T0 + 120, "Coffee, always.", "s2", 8),
    Entry("Bo", T0 + DAY, "Walked the greyhound.", "s2", 9),
]
SAME_DAY_LINES = [
    "[2023-11-14]", "Ana: I adopted a greyhound.",
    SAME_DAY, "Bo: Tea or coffee?", "Ana: Coffee, always.",
    "[2023-11-15]", "Bo: Walked the greyhound.",
]


def test_packing_counts_a_line_with_its_newline() -> None:
    # "greyhound.\n" is one token fewer than "greyhound." and "\n" apart: counted apart,
    # packing thought the whole block too big for its own size.
    full = pack(SAME_DAY_ENTRIES, 1000, count_4o)
    assert full.block.splitlines()[2:-1] == [TURNS_HEADING, *SAME_DAY_LINES]
    assert pack(SAME_DAY_ENTRIES, full.tokens, count_4o).included == [0, 1, 2, 3]
    assert len(pack(SAME_DAY_ENTRIES, full.tokens - 1, count_4o).included) == 3


def test_with_learned_facts_turns_are_dated_excerpts_too() -> None:
    fact = LearnedItem("fact", "f1", "Ana has a greyhound.", "identity", "s1", T0, [3])
    packed = pack_block(Learned(facts=[fact]), SAME_DAY_ENTRIES, 1000, count_4o)
    lines = packed.block.splitlines()
    assert lines[2:4] == [FACTS_HEADING, "- (identity) Ana has a greyhound."]
    assert lines[4:-1] == [TURNS_HEADING, *SAME_DAY_LINES]
    assert packed.turns == [0, 1, 2, 3] and packed.tokens == count_4o(packed.block)
    for budget in range(60, packed.tokens, 3):
        small = pack_block(Learned(facts=[fact]), SAME_DAY_ENTRIES, budget, count_4o)
        assert small.tokens == count_4o(small.block) <= budget
        assert small.facts == [0]  # facts come first; turns take what is left

"""The in-process blocks of write-off sessions (memory.recall.unsaved_blocks): bounded by
entries and bytes, least recently used first, and dropped with the user's stamp."""

from __future__ import annotations

from typing import Any

from memory.recall.unsaved_blocks import ENTRY_OVERHEAD, UnsavedBlocks, user_turn_digests
from memory.storage.injections import Injection


def conversation(n: int) -> list[dict[str, Any]]:
    """A system prompt and `n` user messages with replies between them."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(n):
        messages += [{"role": "user", "content": f"question {i}"},
                     {"role": "assistant", "content": f"answer {i}"}]
    return messages[:-1]


def block(text: str) -> Injection:
    return Injection("last_user", f"<memory>\n{text}\n</memory>", [f"c{len(text)}"], 5)


def test_a_block_is_found_again_by_the_conversation_up_to_its_user_message() -> None:
    kept = UnsavedBlocks(entries=10, max_bytes=1 << 20)
    messages = conversation(1)
    kept.keep("ada", "s1", messages, 1, block("first"), (3, None))
    later = conversation(3)
    assert kept.placed("ada", "s1", later, (3, None)) == {1: block("first")}
    assert kept.placed("ada", "s2", later, (3, None)) == {}  # another session
    assert kept.placed("bob", "s1", later, (3, None)) == {}  # another user
    edited = [*later[:1], {"role": "user", "content": "question 0, edited"}, *later[2:]]
    assert kept.placed("ada", "s1", edited, (3, None)) == {}
    # The system prompt is not part of the key; the turns are.
    assert user_turn_digests(later)[1] == user_turn_digests(later[1:])[0]


def test_a_retry_keeps_the_first_block() -> None:
    kept = UnsavedBlocks(entries=10, max_bytes=1 << 20)
    kept.keep("ada", "s1", conversation(1), 1, block("first"), (1, None))
    kept.keep("ada", "s1", conversation(1), 1, block("second"), (1, None))
    assert kept.placed("ada", "s1", conversation(1), (1, None)) == {1: block("first")}


def test_another_stamp_drops_every_block_of_the_user_only() -> None:
    kept = UnsavedBlocks(entries=10, max_bytes=1 << 20)
    kept.keep("ada", "s1", conversation(1), 1, block("a1"), (1, None))
    kept.keep("ada", "s2", conversation(2), 3, block("a2"), (1, None))
    kept.keep("bob", "s1", conversation(1), 1, block("b1"), (7, None))
    assert kept.placed("ada", "s1", conversation(1), (2, None)) == {}
    assert kept.blocks_of("ada") == [] and kept.blocks_of("bob") == [block("b1")]
    assert len(kept) == 1 and kept.bytes == len(block("b1").block) + 2 + 2 + ENTRY_OVERHEAD


def test_the_cache_stays_bounded_by_entries_and_by_bytes() -> None:
    kept = UnsavedBlocks(entries=3, max_bytes=1 << 20)
    for i in range(5):
        kept.keep("ada", f"s{i}", conversation(1), 1, block(f"b{i}"), (1, None))
    assert len(kept) == 3
    kept.placed("ada", "s2", conversation(1), (1, None))  # used: now the most recent
    kept.keep("ada", "s9", conversation(1), 1, block("b9"), (1, None))
    assert {b.block for b in kept.blocks_of("ada")} == {block(t).block for t in ("b2", "b4", "b9")}

    size = len(block("x" * 1000).block) + len("c1000") + 2 + ENTRY_OVERHEAD
    small = UnsavedBlocks(entries=100, max_bytes=2 * size + 10)
    for i in range(6):
        small.keep("ada", f"s{i}", conversation(1), 1, block("x" * 1000), (1, None))
        assert small.bytes <= 2 * size + 10
    assert len(small) == 2
    small.keep("ada", "big", conversation(1), 1, block("x" * 5000), (1, None))  # never fits
    assert len(small) == 2 and small.bytes == 2 * size

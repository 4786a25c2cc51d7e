"""The prompt-cache benchmark's pricing rules, on token sequences worked out by hand."""

from __future__ import annotations

from scripts.bench_prompt_cache import (
    Prompt,
    anthropic_cost,
    messages_segments,
    openai_cost,
    shared,
    without_later_blocks,
)


def test_openai_reads_the_shared_prefix_in_128_token_steps_from_1024() -> None:
    first = Prompt(list(range(2000)), [])
    second = Prompt([*range(2000), *range(-300, 0)], [])
    # 2000 shared -> 1920 cached at 10 %: 2300 - 1920 + 192.
    assert openai_cost([first, second]) == 2000 + 572
    short = Prompt(list(range(1000)), [])
    assert openai_cost([short, Prompt([*range(1000), -1], [])]) == 1000 + 1001  # under 1024
    changed = Prompt([-1, *range(1, 2000)], [])
    assert openai_cost([first, changed]) == 4000  # the first token differs: nothing read


def test_anthropic_reads_earlier_breakpoints_and_writes_up_to_its_last() -> None:
    first = Prompt(list(range(2000)), [1500, 2000])
    second = Prompt([*range(2000), *range(-500, 0)], [1500, 2500])
    assert anthropic_cost([first]) == 1.25 * 2000
    # Reads the 2000 written by the first request, writes the 500 after it.
    assert anthropic_cost([first, second]) == 1.25 * 2000 + 0.1 * 2000 + 1.25 * 500
    edited = Prompt([*range(1600), *range(-900, 0)], [1500, 2500])
    # Only the breakpoint at 1500 still matches; the rest up to 2500 is written again.
    assert anthropic_cost([first, edited]) == 1.25 * 2000 + 0.1 * 1500 + 1.25 * 1000


def test_shared_prefix_and_message_segments() -> None:
    assert shared([1, 2, 3, 4], [1, 2, 9]) == 2 and shared([1, 2], [1, 2, 3]) == 2
    body = {"system": [{"type": "text", "text": "Rules", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<memory>"},
                {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]}
    assert messages_segments(body) == [("Rules", True), ("<|user|>", False),
                                       ("<memory>", False), ("Hi", True)]


def test_the_floor_keeps_the_first_block_and_drops_the_later_ones() -> None:
    chat = {"messages": [
        {"role": "system", "content": "Rules\n\n<memory>first</memory>"},
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "<memory>later</memory>"}, {"role": "user", "content": "q2"}]}
    assert [m["content"] for m in without_later_blocks("chat", chat)["messages"]] == [
        "Rules\n\n<memory>first</memory>", "q1", "a1", "q2"]
    messages = {"system": "Rules", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<memory>first</memory>"},
                                     {"type": "text", "text": "q1"}]},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": [{"type": "text", "text": "<memory>later</memory>"},
                                     {"type": "text", "text": "q2"}]}]}
    kept = without_later_blocks("messages", messages)["messages"]
    assert kept[0] == messages["messages"][0]
    assert kept[2]["content"] == [{"type": "text", "text": "q2"}]

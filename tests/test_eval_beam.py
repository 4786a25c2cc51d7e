"""The BEAM evaluation's bookkeeping: what counts as a source message recalled."""

from __future__ import annotations

from scripts.eval_beam import (
    Message,
    clean,
    exchanges,
    recalled,
    source_ids,
    speaker_chars,
    unique_sentences,
)

SHARED = "Use the same virtual environment for every service in the repository."


def test_a_message_is_found_by_a_long_sentence_no_other_message_holds() -> None:
    messages = [
        Message(1, "user", clean(f"My first sprint ends on March 29 with login done. {SHARED}"
                                 " Short one. ->-> 1,14")),
        Message(2, "assistant", f"Sure.\n{SHARED}\nThe dashboard API answers in 250 ms now."),
    ]
    keys = unique_sentences(messages)
    # The shared sentence is in both, "Short one." and "Sure." are under 40 characters.
    assert keys == {1: ["My first sprint ends on March 29 with login done."],
                    2: ["The dashboard API answers in 250 ms now."]}
    assert messages[0].text.endswith("Short one.")  # the generator's marker is gone
    block = ("<memory>\n[2024-03-15]\nuser: … My first sprint ends on March 29\n  with login"
             f" done. …\nassistant: {SHARED}\n</memory>")
    # Whitespace aside, message 1's sentence is shown; message 2's shared one does not count.
    assert recalled(block, keys, [1, 2]) == {1}


def test_sources_come_as_lists_nested_lists_or_a_knowledge_update() -> None:
    assert source_ids([4, 5, 4]) == (4, 5)
    assert source_ids([[4, 5], [9]]) == (4, 5, 9)
    assert source_ids({"original_info": [86], "updated_info": [114]}) == (114,)
    assert source_ids({"first": [1], "second": [2, 3]}) == (1, 2, 3)
    assert source_ids(None) == ()


def test_replay_sends_each_user_message_with_the_history_before_it() -> None:
    said = [Message(0, "user", "a"), Message(1, "assistant", "b"), Message(2, "user", "c")]
    assert list(exchanges(said)) == [
        ([{"role": "user", "content": "a"}], "b"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "user", "content": "c"}], ""),
    ]


def test_the_assistants_share_counts_its_continuation_lines() -> None:
    block = "<memory>\nRelevant past turns:\n[2024-03-15]\nuser: abcd\nassistant: xy\n  zz\n---\n</memory>"
    assert speaker_chars(block) == {"user": 10, "assistant": 15}

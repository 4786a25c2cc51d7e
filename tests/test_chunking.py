"""Chunking: code and prose pieces under a token cap, losing no text."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.index.chunking import Chunk, chunk_text
from memory.tokens import count_tokens


def tiktoken_count(text: str) -> int:
    return count_tokens(text, "gpt-4o")


def word_count(text: str) -> int:
    return len(text.split())


def squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def check_invariants(
    text: str, chunks: list[Chunk], max_tokens: int, count: Callable[[str], int]
) -> None:
    assert [chunk.ordinal for chunk in chunks] == list(range(len(chunks)))
    for chunk in chunks:
        assert chunk.text.strip(), "no blank chunks"
        assert chunk.tokens == count(chunk.text)
        assert chunk.tokens <= max_tokens, chunk
    assert "".join(squeeze(chunk.text) for chunk in chunks) == squeeze(text)


PARAGRAPH = (
    "Memory lets the assistant recall earlier conversations. It stores every turn, extracts "
    "facts and summarises sessions. Recall searches vectors and keywords, then packs results "
    "into a budget."
)
CODE = '```python\ndef greet(name: str) -> str:\n    return f"hello {name}"\n```'


def test_blank_text_has_no_chunks() -> None:
    assert chunk_text("", max_tokens=10, count=tiktoken_count) == []
    assert chunk_text(" \n\t \n", max_tokens=10, count=tiktoken_count) == []


def test_short_text_is_one_chunk() -> None:
    text = f"  {PARAGRAPH}\n\n{CODE}\nThat is all.\n"
    chunks = chunk_text(text, max_tokens=500, count=tiktoken_count)
    assert chunks == [Chunk(0, "prose", text.strip(), tiktoken_count(text.strip()))]


def test_short_code_only_text_is_one_code_chunk() -> None:
    chunks = chunk_text(CODE + "\n", max_tokens=500, count=tiktoken_count)
    assert [(c.kind, c.text) for c in chunks] == [("code", CODE)]


def test_code_blocks_are_kept_whole_with_fences() -> None:
    tilde = "~~~sh\nls -la\n~~~"
    text = f"{PARAGRAPH}\n\n{CODE}\n\n{PARAGRAPH}\n{tilde}\nDone."
    chunks = chunk_text(text, max_tokens=45, count=tiktoken_count)

    code = [c.text for c in chunks if c.kind == "code"]
    assert code == [CODE, tilde]
    assert chunks[-1] == Chunk(len(chunks) - 1, "prose", "Done.", 2)
    check_invariants(text, chunks, 45, tiktoken_count)


def test_long_code_block_splits_on_line_boundaries() -> None:
    body = "".join(f"    total += compute(item_{i}, factor={i})\n" for i in range(60))
    block = f"```python\ndef run():\n    total = 0\n{body}    return total\n```"
    chunks = chunk_text(block, max_tokens=50, count=tiktoken_count)

    assert len(chunks) > 5
    assert {c.kind for c in chunks} == {"code"}
    original_lines = {line.rstrip() for line in block.splitlines()}
    for chunk in chunks:
        assert all(line.rstrip() in original_lines for line in chunk.text.splitlines())
    assert chunks[0].text.startswith("```python\n")
    assert chunks[-1].text.endswith("```")
    check_invariants(block, chunks, 50, tiktoken_count)


def test_a_single_line_over_the_cap_is_cut() -> None:
    line = "x = [" + ", ".join(str(i) for i in range(300)) + "]"
    block = f"```\n{line}\n```"
    chunks = chunk_text(block, max_tokens=40, count=tiktoken_count)
    assert len(chunks) > 10
    check_invariants(block, chunks, 40, tiktoken_count)


def test_prose_splits_at_paragraphs_first() -> None:
    paragraphs = [f"Paragraph {i}. " + PARAGRAPH for i in range(4)]
    text = "\n\n".join(paragraphs)
    cap = tiktoken_count(paragraphs[0]) + 5  # one paragraph fits, two do not
    chunks = chunk_text(text, max_tokens=cap, count=tiktoken_count)
    assert [c.text for c in chunks] == paragraphs


def test_prose_splits_at_sentences_then_words() -> None:
    text = PARAGRAPH + " " + "averyveryverylongwordwithoutanybreaks" * 20
    chunks = chunk_text(text, max_tokens=12, count=tiktoken_count)
    assert chunks[0].text == "Memory lets the assistant recall earlier conversations."
    check_invariants(text, chunks, 12, tiktoken_count)


def test_fence_edge_cases() -> None:
    unclosed = "intro " * 30 + "\n```js\nconst a = 1;\nconst b = 2;\n"
    chunks = chunk_text(unclosed, max_tokens=20, count=tiktoken_count)
    assert chunks[-1].kind == "code"
    assert chunks[-1].text == "```js\nconst a = 1;\nconst b = 2;"

    # A backtick in the info string means it is not a fence (CommonMark); nor is ~~ or a
    # closing fence shorter than its opening one.
    not_fenced = "word " * 30 + "\n``` a`b\ntext\n~~\nmore"
    assert {c.kind for c in chunk_text(not_fenced, max_tokens=20, count=tiktoken_count)} == {
        "prose"
    }
    long_fence = "word " * 30 + "\n````\n```\nstill code\n````\nafter"
    chunks = chunk_text(long_fence, max_tokens=20, count=tiktoken_count)
    assert [c.text for c in chunks if c.kind == "code"] == ["````\n```\nstill code\n````"]


def test_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_text("hello", max_tokens=0, count=tiktoken_count)


# -- property tests

_words = [
    "memory",
    "the",
    "a",
    "recall",
    "tokens",
    "budget",
    "über",
    "日本語",
    "🚀",
    "x",
    "I'm",
    "done.",
]
_pieces = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["\n", "\n\n", " ", ". ", "! ", "? ", "。", "\t", "\r\n", "  \n \n"]),
    st.sampled_from(["```", "```py\n", "\n```\n", "~~~\n", "\n~~~", "````text\n", "``` a`b\n"]),
    st.lists(st.sampled_from(_words), min_size=1, max_size=30).map(" ".join),
    st.text(alphabet="abcXYZ0189+/=", min_size=50, max_size=300),  # base64-like, no spaces
)
documents = st.lists(_pieces, max_size=40).map("".join)


@pytest.mark.fuzz
@settings(max_examples=300, deadline=None)
@given(text=documents, max_tokens=st.integers(min_value=4, max_value=64))
def test_invariants_with_tiktoken(text: str, max_tokens: int) -> None:
    chunks = chunk_text(text, max_tokens=max_tokens, count=tiktoken_count)
    check_invariants(text, chunks, max_tokens, tiktoken_count)
    if not text.strip():
        assert chunks == []
    elif tiktoken_count(text.strip()) <= max_tokens:
        assert len(chunks) == 1


@settings(max_examples=300, deadline=None)
@given(text=documents, max_tokens=st.integers(min_value=1, max_value=20))
def test_invariants_with_word_count(text: str, max_tokens: int) -> None:
    chunks = chunk_text(text, max_tokens=max_tokens, count=word_count)
    check_invariants(text, chunks, max_tokens, word_count)


def test_max_chunks_keeps_the_first_chunks_and_counts_only_the_text_they_come_from() -> None:
    sentence = "The billing service writes its ledger to Postgres every night. "
    text = sentence * 20_000  # about 1.2 MB
    seen: list[int] = []

    def counting(piece: str) -> int:
        seen.append(len(piece))
        return tiktoken_count(piece)

    capped = chunk_text(text, max_tokens=50, count=counting, max_chunks=8)
    assert [c.ordinal for c in capped] == list(range(8))
    assert capped == chunk_text(text[:20_000], max_tokens=50, count=tiktoken_count)[:8]
    assert max(seen) <= 8 * 50 * 8  # never the whole text
    assert chunk_text("short", max_tokens=50, count=tiktoken_count, max_chunks=1)[0].text == "short"

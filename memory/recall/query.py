"""Building the recall query from a request's messages, and the trivial-message heuristic."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from memory.log.messages import last_user_index, message_text

# Acknowledgements that need no memory. Heuristic: after lower-casing and stripping
# punctuation and emoji, the message is empty, one of these, or a run of them.
TRIVIAL = frozenset(
    "ok okay k kk sure yes yeah yep yup no nope nah thanks thank thx ty cool great nice "
    "good fine got it alright right lol haha hi hello hey bye cheers perfect awesome "
    "you welcome np done".split()
)
# Openers of follow-ups that only make sense with the previous turn ("and why?").
ELLIPTICAL = frozenset(
    "and but so why how what which who where when then also or it that this they those "
    "these more else".split()
)
SHORT_WORDS = 6
CONTEXT_CHARS = 400
_WORD = re.compile(r"[\w'-]+", re.UNICODE)
# Identifiers worth an exact match: snake_case, camelCase, dotted.paths, `backticked`.
_IDENTIFIER = re.compile(
    r"`([^`\s]{2,64})`|\b([A-Za-z_][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+|[a-z]+[A-Z][A-Za-z0-9]+|"
    r"[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)+|[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]+)\b"
)


def is_trivial(text: str) -> bool:
    """Whether a message is an acknowledgement that recall cannot help."""
    words = _WORD.findall(text.lower())
    return not words or (len(words) <= 3 and all(w in TRIVIAL for w in words))


def build_query(messages: Sequence[Mapping[str, Any]]) -> str:
    """The last user message, with preceding context when it is short or elliptical."""
    index = last_user_index(messages)
    if index is None:
        return ""
    text = message_text(messages[index].get("content")).strip()
    words = _WORD.findall(text.lower())
    if len(words) >= SHORT_WORDS and words[0] not in ELLIPTICAL:
        return text
    context = [
        message_text(m.get("content")).strip()[-CONTEXT_CHARS:]
        for m in messages[max(0, index - 2) : index]
        if m.get("role") in ("user", "assistant")
    ]
    return "\n".join([*filter(None, context), text])


def for_embedding(query: str, max_words: int) -> str:
    """The query as recall embeds it: at most `max_words` words (0: all of them).

    Embedding time grows with length (about 0.3 ms of CPU a token), and a long message is
    usually pasted material around a question, so a longer query keeps its first quarter
    (a question asked before the material) and its last three quarters (a question asked
    after it, and the message itself when build_query put context first).
    """
    words = query.split()
    if not max_words or len(words) <= max_words:
        return query
    head = max_words // 4
    return " ".join(words[:head] + words[len(words) - (max_words - head) :])


def identifiers(text: str) -> set[str]:
    """Code identifiers mentioned in a text."""
    return {a or b for a, b in _IDENTIFIER.findall(text)}

"""The prompts of the learning jobs: fact extraction, session summaries, and the one repair."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from memory.storage.turns import Turn

EXTRACT_SYSTEM = """\
You extract durable facts about the USER from a conversation excerpt, for a long-term memory.
Rules:
- Keep only what the user stated about themselves: identity, preferences, projects, people, \
circumstances, plans and decisions. Never extract anything the assistant said, suggested or \
assumed, even if the user did not object. Skip greetings, questions and small talk.
- Write each fact as one short third-person sentence starting with "User", e.g. \
"User prefers TypeScript over JavaScript."
- Resolve relative dates against the date of the message they appear in, e.g. "tomorrow" in a \
message dated 2024-05-08 becomes 2024-05-09.
- category: one of identity, preference, project, relationship, context, todo, decision.
- confidence: 0 to 1, how clearly the user stated it. importance: integer 1 to 10, how useful \
it is to remember in future conversations.
- updates_previous: the id of a known fact that this one replaces or contradicts, else null.
- expires: the date (YYYY-MM-DD) after which the fact stops being true when the user said so \
(a trip, a deadline), else null.
- turns: the numbers of the user messages the fact comes from.
Only messages marked NEW may yield facts; the others are context. Answer with a JSON array \
only, no prose:
[{"fact": "User ...", "category": "preference", "confidence": 0.9, "importance": 8, \
"updates_previous": null, "expires": null, "turns": [1]}]
Answer [] when there is nothing worth keeping."""

SUMMARY_SYSTEM = """\
You summarise a conversation between a user and an assistant for a long-term memory.
Fold the previous summary (if any) and the new messages into ONE summary of the whole \
conversation so far; do not repeat the previous summary separately. Third person ("The user \
..."); resolve relative dates against the message dates; only what was actually said.
Answer with a JSON object only, no prose:
{"facts": ["..."], "preferences": ["..."], "decisions": ["..."], "todos": ["..."], \
"entities": ["..."], "text": "a readable summary of at most {max_words} words"}"""

REPAIR = """\
Your answer could not be used: {error}.
Answer again with the corrected JSON only, no prose and no Markdown fence. Your answer was:
{raw}"""


def day(timestamp: float) -> str:
    """A unix time as YYYY-MM-DD (UTC)."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d")


def transcript(turns: Sequence[Turn], new_from: int) -> list[str]:
    """Numbered message lines; turns at index >= new_from are marked NEW."""
    lines = []
    for i, turn in enumerate(turns, start=1):
        who = turn.role if turn.name is None else f"{turn.role} ({turn.name})"
        mark = " NEW" if i > new_from else ""
        body = turn.content.strip().replace("\n", "\n    ")
        lines.append(f"[{i}]{mark} {day(turn.created_at)} {who}: {body}")
    return lines


def extraction_messages(
    turns: Sequence[Turn], new_from: int, known: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The chat messages that ask for facts from `turns[new_from:]`."""
    facts = json.dumps(list(known), ensure_ascii=False) if known else "none"
    user = "\n".join([
        f"Known facts about the user: {facts}", "", "Conversation:",
        *transcript(turns, new_from),
    ])
    return [{"role": "system", "content": EXTRACT_SYSTEM}, {"role": "user", "content": user}]


def summary_messages(
    turns: Sequence[Turn], previous: str | None, max_words: int
) -> list[dict[str, Any]]:
    """The chat messages that ask for a rolled-up summary."""
    user = "\n".join([
        f"Previous summary: {previous or 'none'}", "", "New messages:",
        *transcript(turns, 0),
    ])
    system = SUMMARY_SYSTEM.replace("{max_words}", str(max_words))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def repair_messages(
    asked: Sequence[dict[str, Any]], raw: str, error: str
) -> list[dict[str, Any]]:
    """The conversation that asks once more, quoting the unusable answer and why."""
    return [
        *asked,
        {"role": "assistant", "content": raw},
        {"role": "user", "content": REPAIR.format(error=error, raw=raw[:4000])},
    ]

"""Reading JSON that a language model wrote: tolerant extraction, then strict validation.

`parse_json` accepts plain JSON, JSON in a Markdown fence, and JSON wrapped in prose
("Here are the facts: [...] Hope this helps"), and drops trailing commas; anything else is
`MalformedOutput`. The validators then check the shape strictly and say exactly what is
wrong, so that the one repair request can quote the error to the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from memory.learning.facts import CATEGORIES
from memory.learning.summaries import SUMMARY_KEYS

MAX_FACT_CHARS = 500
_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([\]}])")


class MalformedOutput(ValueError):
    """The model's output is not JSON of the expected shape; the message says why."""


@dataclass(frozen=True)
class ExtractedFact:
    """One validated item of an extraction answer."""

    fact: str
    category: str
    confidence: float
    importance: int
    updates_previous: int | bool | None
    expires: float | None  # unix seconds at the end of the given day (UTC)
    turns: tuple[int, ...]


@dataclass(frozen=True)
class SummaryDraft:
    """A validated summary answer."""

    text: str
    data: dict[str, list[str]]


def parse_json(text: str) -> Any:
    """The JSON value in a model's answer, tolerating fences, prose around it, trailing commas."""
    stripped = text.strip()
    candidates = [stripped, *(m.group(1).strip() for m in _FENCE.finditer(text))]
    for opener in "[{":
        start = stripped.find(opener)
        if start >= 0:
            candidates.append(stripped[start:])
    decoder = json.JSONDecoder()
    for candidate in candidates:
        for attempt in (candidate, _TRAILING_COMMA.sub(r"\1", candidate)):
            try:
                value, _ = decoder.raw_decode(attempt)  # ignores whatever follows the value
            except json.JSONDecodeError:
                continue
            return value
    raise MalformedOutput("the answer holds no JSON value")


def validate_facts(value: Any) -> list[ExtractedFact]:
    """Check an extraction answer: a JSON array of fact objects."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list):
        value = next(iter(value.values()))  # {"facts": [...]}: the array, wrapped
    if not isinstance(value, list):
        raise MalformedOutput(f"expected a JSON array, got {type(value).__name__}")
    return [_fact(i, item) for i, item in enumerate(value)]


def validate_summary(value: Any) -> SummaryDraft:
    """Check a summary answer: an object with `text` and the five lists."""
    if not isinstance(value, dict):
        raise MalformedOutput(f"expected a JSON object, got {type(value).__name__}")
    text = value.get("text")
    if not isinstance(text, str) or not text.strip():
        raise MalformedOutput("`text` must be a non-empty string")
    data: dict[str, list[str]] = {}
    for key in SUMMARY_KEYS:
        items = value.get(key, [])
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise MalformedOutput(f"`{key}` must be an array of strings")
        data[key] = [x.strip() for x in items if x.strip()]
    return SummaryDraft(text.strip(), data)


def _fact(index: int, item: Any) -> ExtractedFact:
    where = f"item {index}"
    if not isinstance(item, dict):
        raise MalformedOutput(f"{where} must be an object")
    fact = item.get("fact")
    if not isinstance(fact, str) or not fact.strip() or len(fact) > MAX_FACT_CHARS:
        raise MalformedOutput(f"{where}: `fact` must be a string of 1-{MAX_FACT_CHARS} characters")
    category = item.get("category")
    if category not in CATEGORIES:
        raise MalformedOutput(f"{where}: `category` must be one of {', '.join(CATEGORIES)}")
    confidence: Any = item.get("confidence")
    if not _number(confidence) or not 0 <= confidence <= 1:
        raise MalformedOutput(f"{where}: `confidence` must be a number from 0 to 1")
    importance: Any = item.get("importance")
    if not _number(importance) or importance != int(importance) or not 1 <= importance <= 10:
        raise MalformedOutput(f"{where}: `importance` must be an integer from 1 to 10")
    previous = item.get("updates_previous")
    if previous is not None and not isinstance(previous, bool | int):
        raise MalformedOutput(f"{where}: `updates_previous` must be a fact id, true/false or null")
    turns = item.get("turns", [])
    if not isinstance(turns, list) or not all(_integer(t) for t in turns):
        raise MalformedOutput(f"{where}: `turns` must be an array of message numbers")
    return ExtractedFact(
        fact.strip(), category, float(confidence), int(importance), previous,
        _expiry(where, item.get("expires")), tuple(int(t) for t in turns),
    )


def _expiry(where: str, value: Any) -> float | None:
    if value in (None, "", False):
        return None
    if isinstance(value, str):
        try:
            day = datetime.fromisoformat(value.strip()[:10]).replace(tzinfo=UTC)
        except ValueError:
            pass
        else:
            return day.timestamp() + 86400.0  # true through the whole given day
    raise MalformedOutput(f"{where}: `expires` must be a date (YYYY-MM-DD) or null")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return _number(value) and value == int(value)

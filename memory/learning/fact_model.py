"""Facts: categories, errors and field checks, shared by the fact store, learning and the API.

    FactError (ValueError, .param)
     └── FactNotFound (no such fact for this user)
"""

from __future__ import annotations

from collections.abc import Iterable

from memory.storage import jobs
from memory.storage.database import Transaction

CATEGORIES = ("identity", "preference", "project", "relationship", "context", "todo", "decision")
SOURCES = ("extracted", "manual", "import", "mcp")
MAX_CLIENT_CHARS = 100  # a client's name as provenance (proxy/mcp/caller.py cuts it to this)
SYNC_JOB = "sync_vectors"
MAX_TEXT_CHARS = 1000
MAX_PAGE = 500
DAY = 86400.0


class FactError(ValueError):
    """A fact request that cannot be done; `param` names the offending argument."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class FactNotFound(FactError):
    """No fact with this id belongs to this user."""


async def queue_sync(
    tx: Transaction,
    *,
    facts: Iterable[int] = (),
    summaries: Iterable[int] = (),
    profiles: Iterable[str] = (),
) -> None:
    """Queue a vector sync for these rows, committed with the transaction."""
    payload = {"facts": sorted(set(facts)), "summaries": sorted(set(summaries)),
               "profiles": sorted(set(profiles))}
    if any(payload.values()):
        await jobs.enqueue(tx, SYNC_JOB, payload)


def check_text(text: str) -> str:
    """The text stripped; FactError unless 1 to MAX_TEXT_CHARS characters."""
    text = text.strip() if isinstance(text, str) else ""
    if not text:
        raise FactError("a fact needs non-empty text", "text")
    if len(text) > MAX_TEXT_CHARS:
        raise FactError(f"a fact is at most {MAX_TEXT_CHARS} characters", "text")
    return text


def check_category(category: str) -> None:
    """FactError unless `category` is one of CATEGORIES."""
    if category not in CATEGORIES:
        raise FactError(f"category must be one of {', '.join(CATEGORIES)}", "category")


def check_fields(category: str, confidence: float, importance: int) -> None:
    """FactError naming the first of category, confidence (0-1), importance (1-10) that is bad."""
    check_category(category)
    if isinstance(confidence, bool) or not 0.0 <= float(confidence) <= 1.0:
        raise FactError("confidence must be between 0 and 1", "confidence")
    if isinstance(importance, bool) or int(importance) != importance or not 1 <= importance <= 10:
        raise FactError("importance must be an integer from 1 to 10", "importance")


def parse_cursor(cursor: str) -> int:
    """The fact id a page cursor stands for."""
    try:
        return int(cursor)
    except ValueError:
        raise FactError("invalid cursor", "cursor") from None


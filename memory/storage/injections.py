"""Table `injections`: the memory block each request injected, kept with the user turn it
was placed at, so later requests of the session put it back byte for byte (the prompt
prefix stays the same and provider prompt caches keep hitting). A turn's rows go with it
(ON DELETE CASCADE): forgetting or clearing a conversation forgets its blocks too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from memory.storage.database import Connection, Transaction, fetch_in


@dataclass(frozen=True, slots=True)
class Injection:
    """A block as it was injected: where, its text, and the keys of the items it shows."""

    placement: str  # system (appended to the system prompt) | last_user (before the turn)
    block: str
    items: list[str]
    tokens: int


async def put(
    tx: Transaction, user_id: str, session_id: str, turn_id: int, injection: Injection,
    now: float,
) -> None:
    """Keep the block injected at `turn_id`; the first one kept stays (a retry reuses it)."""
    await tx.change(
        "INSERT INTO injections (turn_id, user_id, session_id, placement, block, items, tokens,"
        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (turn_id) DO NOTHING",
        (turn_id, user_id, session_id, injection.placement, injection.block,
         json.dumps(injection.items), injection.tokens, now),
    )


async def of_turns(
    conn: Connection, user_id: str, turn_ids: Sequence[int]
) -> dict[int, Injection]:
    """{turn id: the block kept with it} for those of `turn_ids` that have one."""
    rows = await fetch_in(
        conn,
        "SELECT turn_id, placement, block, items, tokens FROM injections"
        " WHERE user_id = ? AND turn_id IN ({marks})",
        turn_ids, prefix=(user_id,),
    )
    return {
        int(row[0]): Injection(str(row[1]), str(row[2]), json.loads(row[3]), int(row[4]))
        for row in rows
    }

"""Memory wider than one user: an organisation's shared knowledge (docs/memory.md, Scopes).

An organisation's memory is stored like a user's, under a reserved id that no request can
name as a user: it starts with a control character (ORG_MARK, the unit separator), which
the identity headers refuse as not printable and which trimming removes from the start of
a body id (Python counts it as whitespace). Only the memory API writes it (a key allowed
to, or the admin key); chat requests of the organisation's users recall it after their own
memory, in a share of the budget of its own.
"""

from __future__ import annotations

ORG_MARK = "\x1f"


def organization_memory(org_id: str) -> str:
    """The id an organisation's shared memory is stored under."""
    return f"{ORG_MARK}org:{org_id}"

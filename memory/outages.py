"""What counts as an outage of a backing service, in one table.

An outage is a failure of the service, not of the work: the database, the Chroma server or
the upstream did not answer. The job worker waits an outage out without spending the job's
attempts (memory.jobs.worker), and a turn the database cannot take goes to the local spool
(memory.log.spooling) instead of being lost. Everything else is an error of the work itself.

    Unavailable            raised where a library's own connection errors are mapped:
                           PostgreSQL (storage/postgres.py), a Chroma server
                           (index/vectors.py), the learning model's upstream (the proxy's
                           LLM client), the embeddings upstream (the proxy's embedder);
                           for the upstreams, a 502/503/504 from their gateway too
    ConnectionError,       a socket refused, reset or aborted, or a call that timed out
    TimeoutError
    SQLite busy/locked,    the embedded database's file is held by another writer past the
    full, I/O error,       busy timeout, or its disk is full or failing; sqlite3 errors carry
    cannot open            their code's name (`sqlite_errorname`), so no import is needed here

A wrapped failure counts when its explicit cause (`raise ... from outage`) is an outage.
"""

from __future__ import annotations

# sqlite3 error codes (by name) that say the file, not the statement, is the trouble.
_SQLITE_OUTAGES = frozenset({"SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_FULL", "SQLITE_CANTOPEN"})
_SQLITE_IO = "SQLITE_IOERR"  # and its extended codes (SQLITE_IOERR_WRITE, ...)
# Not every OSError: a missing or unreadable file is the job's trouble, not an outage.
_OUTAGE_TYPES: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)


class Unavailable(Exception):
    """A backing service did not answer (its connection failed or was refused): wait and
    retry; the work itself was not at fault."""

    def __init__(self, service: str, detail: str) -> None:
        super().__init__(f"{service} unreachable: {detail}")
        self.service = service


class CannotOpen(Exception):
    """A store memory needs did not take the first connection: the message is one line that
    names the part, why, and what to change (a start-up or `migrate` check, not an outage
    to wait out)."""

    def __init__(self, part: str, reason: str, fix: str) -> None:
        super().__init__(f"{part}: {reason}; {fix}")


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` (or the failure it was explicitly raised from) is an outage."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (Unavailable, *_OUTAGE_TYPES)) or _sqlite_outage(current):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def _sqlite_outage(exc: BaseException) -> bool:
    name = getattr(exc, "sqlite_errorname", None)
    return isinstance(name, str) and (name in _SQLITE_OUTAGES or name.startswith(_SQLITE_IO))

"""Waiting for memproxy's background work: the one "wait for jobs" helper tests share.

Work after a response happens in two places: the app's tasks (storing a reply, the metrics
row; `AppState.tasks`) and the durable job queue in the database. A test that reads memory
waits for both, through the database (the file, or PostgreSQL), so it works for a server in a
thread as well as for a separate process.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

from config import Settings
from tests.support.sql import Target, query

POLL_SECONDS = 0.05


class InThread(Protocol):
    """A server whose app state the test can see (`tests.conftest.RunningProxy`)."""

    @property
    def state(self) -> Any: ...


def wait_for_jobs(
    server: InThread | Target, *, later: bool = False, timeout: float = 60.0
) -> dict[str, int]:
    """Wait until no job is running or queued, and the app has no work left after a response;
    return the number of jobs in each status.

    `server` is a running proxy, or the database of memproxy processes (the SQLite file, or
    settings naming the PostgreSQL database replicas share). Jobs queued to
    run later (a retry after its backoff, a clear's settle job at the end of its undo window)
    count only with `later=True`. Raises TimeoutError listing the jobs still pending.
    """
    target: Target
    if isinstance(server, Path | Settings):
        target, tasks = server, _NO_TASKS
    else:
        target, tasks = server.state.settings, server.state.tasks
    deadline = time.monotonic() + timeout
    while True:
        # A reply is stored just after its response went out: let that start first.
        time.sleep(POLL_SECONDS)
        pending = _pending(target, later)
        if not pending and not tasks:
            rows = query(target, "SELECT status, count(*) FROM jobs GROUP BY status")
            return {str(status): int(count) for status, count in rows}
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout}s, {len(tasks)} task(s) and these jobs are"
                               f" pending (id, kind, status, attempts, last error): {pending}")


_NO_TASKS: Collection[object] = ()


def _pending(target: Target, later: bool) -> list[tuple[Any, ...]]:
    due = "" if later else " AND (status = 'running' OR run_after <= ?)"
    params = () if later else (time.time(),)
    return query(
        target, "SELECT id, kind, status, attempts, last_error FROM jobs"
        f" WHERE status IN ('queued', 'running'){due} ORDER BY id LIMIT 20", params,
    )

"""An operator's bad day, measured: two memproxy replicas on one PostgreSQL and one Chroma
server (all started here on 127.0.0.1, in temporary directories, as the tests start them),
clients chatting without pause through them, while three things happen in turn:

1. the Chroma server is killed (-9) and started again after ``--down`` seconds;
2. PostgreSQL is restarted (fast shutdown: every connection cut), down ``--down`` seconds;
3. replica A is killed (-9) and started again.

Requests go round robin; one that fails is resent to the other replica, as a balancer
would. Printed per phase: requests answered, failed at a live replica, failed at the killed
replica (resent), answered with ``X-Memory-Error``; turns lost and stored twice (every turn a
client saw answered, against the database); seconds from the end of the fault until both
spools are replayed and the job queue is drained; jobs that went to the dead letters, and
stored turns without a vector in Chroma (not findable by meaning).

    .venv/bin/python -m scripts.chaos                  # about 2 minutes
    .venv/bin/python -m scripts.chaos --phase-seconds 20 --clients 6
    .venv/bin/python -m scripts.chaos --chroma-down-seconds 90   # only phase 1, Chroma down 90 s

``--chroma-down-seconds`` runs the Chroma phase alone with the outage that long, the jobs
on their default settings: longer than a job's whole retry budget for errors of its own
(5 attempts, 1 + 2 + 4 + 8 s apart), so every turn indexed afterwards shows that the
outage was waited out.

Exit status 1 when a turn is lost or stored twice, a live replica failed a request, a job
went to the dead letters, or a stored turn has no vector.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from config import Settings
from memory import VectorIndex, collection_name
from tests.support.jobs import wait_for_jobs
from tests.support.processes import Process, launch, memproxy_env, wait_ready
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.servers import ChromaServer, PostgresServer
from tests.support.sql import query

TURNS_PER_SESSION = 12  # then a client starts a new session: bodies stay small


@dataclass
class Tally:
    """What the clients saw during one phase."""

    answered: int = 0
    failed_live: int = 0
    failed_killed: int = 0
    degraded: int = 0
    accepted: list[tuple[str, str, str]] = field(default_factory=list)  # session, role, text


@dataclass
class Clients:
    """Clients chatting round robin over the replicas until told to stop."""

    replicas: list[Process]
    user: str
    killed: set[str] = field(default_factory=set)  # URLs of replicas down on purpose now
    tally: Tally = field(default_factory=Tally)
    stop: threading.Event = field(default_factory=threading.Event)
    _turn: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, client: int) -> None:
        with httpx.Client(timeout=60, trust_env=False) as http:
            for number in itertools.count():
                session, history = f"c{client}-s{number}", list[dict[str, str]]()
                for turn in range(TURNS_PER_SESSION):
                    if self.stop.is_set():
                        return
                    said = f"Client {client} session {number} note {turn}: job j{client}x{number}x{turn} runs nightly."
                    history.append({"role": "user", "content": said})
                    reply = self._send(http, session, history)
                    history.append({"role": "assistant", "content": reply})
                    with self._lock:
                        self.tally.accepted += [(session, "user", said), (session, "assistant", reply)]

    def _send(self, http: httpx.Client, session: str, messages: list[dict[str, str]]) -> str:
        with self._lock:
            first = next(self._turn)
        while True:
            for attempt in range(len(self.replicas)):
                replica = self.replicas[(first + attempt) % len(self.replicas)]
                try:
                    response: httpx.Response | None = http.post(
                        f"{replica.url}/v1/chat/completions",
                        json={"model": "gpt-4o", "messages": messages},
                        headers={"X-Memory-User-Id": self.user, "X-Memory-Session-Id": session},
                    )
                except httpx.TransportError:
                    response = None
                with self._lock:
                    if response is not None and response.status_code == 200:
                        self.tally.answered += 1
                        self.tally.degraded += "x-memory-error" in response.headers
                        return str(response.json()["choices"][0]["message"]["content"])
                    if replica.url in self.killed:
                        self.tally.failed_killed += 1
                    else:
                        self.tally.failed_live += 1
            time.sleep(0.2)


@dataclass
class Row:
    phase: str
    tally: Tally
    lost: int
    twice: int
    drain_seconds: float
    dead: int  # jobs that went to the dead letters during the phase
    unindexed: int  # chunks of the phase's turns without a vector (not found by meaning)


def settle(database: Settings, replicas: list[Process], timeout: float = 300) -> float:
    """Seconds until every replica is ready (its spool replayed) and the queue is drained."""
    started = time.monotonic()
    for replica in replicas:
        while True:
            try:
                if httpx.get(f"{replica.url}/readyz", timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - started > timeout:
                raise SystemExit(f"{replica.url} not ready after {timeout:.0f} s")
            time.sleep(0.1)
    wait_for_jobs(database, later=True, timeout=max(1.0, timeout - (time.monotonic() - started)))
    return time.monotonic() - started


def dead_jobs(database: Settings) -> int:
    return int(query(database, "SELECT COUNT(*) FROM jobs WHERE status = 'dead'")[0][0])


def unindexed(database: Settings, chroma_url: str, user: str) -> int:
    """How many of the user's stored chunks have no vector in the Chroma server."""
    ids = [f"c{chunk_id}" for (chunk_id,) in query(
        database, "SELECT id FROM chunks WHERE user_id = ?", (user,))]
    vectors = VectorIndex.connect(chroma_url, collection_name(Settings()))
    try:
        return sum(len(vectors.missing(ids[i : i + 500])) for i in range(0, len(ids), 500))
    finally:
        vectors.close()


def phase(
    name: str, fault: Callable[[Clients], None], *, replicas: list[Process], database: Settings,
    clients: int, seconds: float, chroma_url: str,
) -> Row:
    """Chat for `seconds` with `fault` done a fifth of the way in; measure what was kept."""
    load = Clients(replicas, user=f"chaos-{name.split()[0].lower()}")
    dead_before = dead_jobs(database)
    threads = [threading.Thread(target=load.run, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(seconds / 5)
    fault(load)
    time.sleep(max(0.0, seconds - (seconds / 5)))
    load.stop.set()
    for thread in threads:
        thread.join(120)
    drain = settle(database, replicas)
    stored = Counter(query(database, "SELECT session_id, role, content FROM turns"
                                     " WHERE user_id = ?", (load.user,)))
    accepted = set(load.tally.accepted)
    lost = sum(1 for turn in accepted if stored[turn] == 0)
    twice = sum(1 for count in stored.values() if count > 1)
    return Row(name, load.tally, lost, twice, drain, dead_jobs(database) - dead_before,
               unindexed(database, chroma_url, load.user))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--phase-seconds", type=float, default=15.0)
    parser.add_argument("--down", type=float, default=5.0, help="seconds a service stays down")
    parser.add_argument("--chroma-down-seconds", type=float, default=None,
                        help="run only the Chroma phase, with Chroma down this many seconds")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memproxy-chaos-") as tmp, ScriptedUpstream() as upstream, \
            ChromaServer() as chroma, PostgresServer() as postgres:
        database = Settings(database_url=postgres.create_database())
        env = memproxy_env(upstream.base_url, database_url=str(database.database_url),
                           chroma_url=chroma.url, log_level="warning", job_lease_seconds="6")
        replicas = [launch(env, Path(tmp) / f"data-{n}", Path(tmp) / f"log-{n}") for n in range(2)]
        try:
            for replica in replicas:
                wait_ready(replica)

            chroma_down = args.down if args.chroma_down_seconds is None else args.chroma_down_seconds

            def kill_chroma(load: Clients) -> None:
                chroma.kill()
                time.sleep(chroma_down)
                chroma.start()

            def restart_postgres(load: Clients) -> None:
                postgres.restart(down_seconds=args.down)

            def kill_replica(load: Clients) -> None:
                victim = replicas[0]
                load.killed.add(victim.url)
                victim.popen.kill()
                victim.popen.wait(10)
                time.sleep(args.down)
                again = launch(env, victim.data_dir, victim.log)  # on a new port
                wait_ready(again)
                replicas[0] = load.replicas[0] = again  # the balancer sends to it once ready
                load.killed.discard(victim.url)

            faults = [("Chroma kill -9", kill_chroma), ("PostgreSQL restart", restart_postgres),
                      ("replica kill -9", kill_replica)]
            if args.chroma_down_seconds is not None:
                faults = faults[:1]
            rows = [phase(name, fault, replicas=replicas, database=database, clients=args.clients,
                          seconds=args.phase_seconds, chroma_url=chroma.url)
                    for name, fault in faults]
        finally:
            for replica in replicas:
                if replica.popen.poll() is None:
                    replica.popen.kill()
                    replica.popen.wait(10)
    down = (f"Chroma down {args.chroma_down_seconds:.0f} s" if args.chroma_down_seconds is not None
            else f"services down {args.down:.0f} s")
    print(f"\n{args.clients} clients, {args.phase_seconds:.0f} s per phase plus the outage, {down};"
          " 2 replicas on PostgreSQL and a Chroma server\n")
    print("| phase | answered | failed (live replica) | failed (killed replica, resent) |"
          " with X-Memory-Error | turns lost | turns stored twice | queue drained after |"
          " jobs dead | turns without a vector |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        t = row.tally
        print(f"| {row.phase} | {t.answered} | {t.failed_live} | {t.failed_killed} |"
              f" {t.degraded} | {row.lost} | {row.twice} | {row.drain_seconds:.1f} s |"
              f" {row.dead} | {row.unindexed} |")
    bad = any(row.lost or row.twice or row.tally.failed_live or row.dead or row.unindexed
              for row in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

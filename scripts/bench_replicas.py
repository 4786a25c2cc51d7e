"""Replicas sharing PostgreSQL and a Chroma server recall what one embedded process recalls.

The LoCoMo dev replay of ``scripts.eval_locomo`` runs twice in one go, against the same
scripted upstream: once through one memproxy on SQLite and embedded Chroma, then through
``--replicas`` memproxy processes on loopback that share one PostgreSQL and one Chroma server
(both started here on 127.0.0.1, in temporary directories, like the tests start them), and
between the two through one process on PostgreSQL and a Chroma server, which tells what the
backends change from what replication changes. With replicas, every request of the replay
and every question goes to the next replica in turn (round robin), so one session's history
is resent to each of them. Reported:

* evidence recall at every budget (and recall@k), both ways, and their difference: the
  replicas must agree with the embedded process within 0.005 at every budget;
* duplicated and lost turns: a (user, session, role, text) the replicas stored more, or
  fewer, times than the embedded process did; both must be zero.

    .venv/bin/python -m scripts.bench_replicas                    # 5 conversations
    .venv/bin/python -m scripts.bench_replicas --conversations 2  # a few minutes

Exit status 1 when a limit is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from config import Settings
from scripts.bench_overhead import BenchError, free_port
from scripts.eval_locomo import (
    BUDGETS,
    DATASET,
    KS,
    Conversation,
    Replies,
    _ingest_all,
    ask_all,
    collect,
    load,
    memproxy,
    wait_indexed,
)
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.servers import ChromaServer, PostgresServer
from tests.support.sql import Target, query

TOLERANCE = 0.005  # evidence recall, replicas vs one process, at every budget
GROUPS = ("cat 1-4", "all")


def run(
    ports: Sequence[int], db: Target, replies: Replies, conversations: Sequence[Conversation],
    args: argparse.Namespace, name: str,
) -> dict[str, Any]:
    """Replay, wait for indexing, ask every question (all spread over `ports`); the arm's
    figures and the turns it stored."""
    started = time.perf_counter()
    requests = asyncio.run(_ingest_all(ports, replies, conversations))
    stats = wait_indexed(db)
    indexed_s = time.perf_counter() - started
    answers = asyncio.run(ask_all(ports, conversations, args.budgets, args.concurrency))
    print(f"{name}: {requests} requests replayed and indexed in {indexed_s:.0f} s, stored"
          f" {stats}; {len(answers)} questions in {time.perf_counter() - started - indexed_s:.0f} s",
          file=sys.stderr)
    turns = Counter(query(db, "SELECT user_id, session_id, role, content FROM turns"))
    dead = query(db, "SELECT COUNT(*) FROM jobs WHERE status <> 'done'")[0][0]
    return collect(conversations, answers, args.budgets) | {
        "turns": turns, "requests": requests, "not_done_jobs": int(dead), "indexed_s": indexed_s,
    }


def evaluate(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, Any]]:
    conversations = load(args.dataset, args.conversations, args.questions)
    results = {}
    with ScriptedUpstream(keep_history=False) as upstream:
        replies = Replies(upstream)
        port, data_dir = free_port(), tmp / "embedded"
        with memproxy(port, upstream.base_url, data_dir, tmp, "embedded", {}):
            results["embedded"] = run([port], data_dir / "memproxy.db", replies, conversations,
                                      args, "embedded")
        with PostgresServer() as postgres:
            for count in dict.fromkeys((1, args.replicas)):
                results[f"{count} on pg"] = replicas(
                    count, postgres.create_database(), upstream.base_url, replies,
                    conversations, args, tmp / f"pg-{count}",
                )
    return results


def replicas(
    count: int, database_url: str, upstream: str, replies: Replies,
    conversations: Sequence[Conversation], args: argparse.Namespace, tmp: Path,
) -> dict[str, Any]:
    """`run` through `count` memproxy processes sharing the database and a new Chroma server
    (a collection's name is the model's, so each arm needs a server of its own)."""
    with ChromaServer() as chroma, contextlib.ExitStack() as running:
        shared = {"MEMPROXY_DATABASE_URL": database_url, "MEMPROXY_CHROMA_URL": chroma.url}
        ports = [free_port() for _ in range(count)]
        for n, port in enumerate(ports):  # one by one: the first creates the schema
            running.enter_context(memproxy(port, upstream, tmp / f"replica-{n}", tmp.parent,
                                           f"pg-{count}-replica-{n}", shared))
        return run(ports, Settings(database_url=database_url), replies, conversations, args,
                   f"{count} on PostgreSQL and a Chroma server")


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Print the figures of every arm and the replicas' differences; return the limits
    missed."""
    one, many = results["embedded"], results[f"{args.replicas} on pg"]
    missed = []
    keys = [f"B{b}" for b in args.budgets] + [f"@{k}" for k in KS]
    print(f"{'':24}" + "".join(f"{k:>8}" for k in keys))
    for group in GROUPS:
        for name, arm in results.items():
            print(f"{group} {name:16}" + "".join(f"{arm['summary'][group][k]:8.3f}" for k in keys))
        for name in results:
            if name != f"{args.replicas} on pg":
                base = results[name]["summary"][group]
                print(f"{group} {args.replicas} - {name:12}" + "".join(
                    f"{many['summary'][group][k] - base[k]:+8.3f}" for k in keys))
        a, b = one["summary"][group], many["summary"][group]
        missed += [f"{group} {k}: {b[k] - a[k]:+.3f}" for k in keys
                   if k.startswith("B") and abs(b[k] - a[k]) > TOLERANCE]
    print(f"questions: {one['summary']['all']['n']:.0f}")
    # The embedded process is the reference: a turn it stored n times must be stored n times.
    stored, shared = one["turns"], many["turns"]
    duplicated = sum((shared - stored).values())
    lost = sum((stored - shared).values())
    print(f"turns: embedded {stored.total()}, {args.replicas} replicas {shared.total()}:"
          f" {duplicated} duplicated, {lost} lost")
    for name, arm in results.items():
        print(f"{name}: {arm['requests']} requests replayed and indexed in"
              f" {arm['indexed_s']:.0f} s; jobs not done {arm['not_done_jobs']}")
    missed += [f"{what}: {n}" for what, n in
               (("duplicated turns", duplicated), ("lost turns", lost),
                ("jobs not done", sum(arm["not_done_jobs"] for arm in results.values()))) if n]
    return missed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_replicas", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=5, help="how many (default all 5)")
    parser.add_argument("--questions", type=int, help="at most this many questions per conversation")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--replicas", type=int, default=3, help="memproxy processes (default 3)")
    parser.add_argument("--concurrency", type=int, default=4, help="questions asked at once")
    parser.add_argument("--dataset", type=Path, default=DATASET, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memproxy-replicas-") as tmp:
        try:
            results = evaluate(args, Path(tmp))
        except BenchError as exc:
            print(f"bench_replicas: {exc}", file=sys.stderr)
            return 1
    missed = report(results, args)
    print(f"wall time {time.perf_counter() - started:.0f} s; "
          + (f"MISSED: {'; '.join(missed)}" if missed else f"all within limits (±{TOLERANCE})"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

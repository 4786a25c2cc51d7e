"""Lexical recall on PostgreSQL next to SQLite FTS5: same turns, same questions, same search.

    python -m scripts.bench_pg_lexical [--conversations 5] [--database-url postgresql://...]

Every turn of the LoCoMo dev conversations (`../shared/eval/locomo-dev.json`) is logged and
chunked as memproxy does (one chunk per turn, its speaker's name indexed with it) into a
SQLite file and into PostgreSQL (a throwaway cluster from tests.support.servers unless a URL
is given). Each question is searched on both through `ChunkSearch` (the recall path: rare
words kept, BM25) for its user, and the script prints:

- evidence recall@k: the share of a question's gold evidence turns among the top k chunks;
- agreement: top-1 equal, and the overlap of the two top-10 lists;
- score: the largest relative difference of the BM25 score of a chunk both return;
- latency of one search (p50/p95).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from memory import ChunkSearch, Database, NewTurn, TurnLog, open_database
from scripts.eval_locomo import DATASET, Conversation, load
from tests.support.servers import PostgresServer

KS = (1, 5, 10, 20)


async def fill(db: Database, conversations: Sequence[Conversation]) -> dict[int, str]:
    """Log every turn with one chunk each; return {chunk id: dia_id}."""
    log = TurnLog(db)
    dia: dict[int, str] = {}
    for conv in conversations:
        for number, turns in conv.sessions:
            after = None
            for turn in turns:
                result = await log.append_turns(
                    conv.sample_id, f"session-{number}", [NewTurn("user", turn.text, name=turn.speaker)],
                    after=after, job_kind=None,
                )
                after = result.last_id
                assert after is not None
                (chunk,) = await log.add_chunks(after, [(0, "prose", turn.text, 0)])
                dia[chunk] = turn.dia_id
    return dia


async def search_all(
    db: Database, conversations: Sequence[Conversation], k: int
) -> tuple[list[list[tuple[int, float]]], list[float]]:
    """Every question's ranking, and each search's milliseconds."""
    search = ChunkSearch(db)
    rankings, times = [], []
    for conv in conversations:
        for question in conv.questions:
            started = time.perf_counter()
            rankings.append(await search.search(conv.sample_id, question.text, k=k))
            times.append((time.perf_counter() - started) * 1000)
    return rankings, times


async def run(url: str, conversations: Sequence[Conversation]) -> None:
    """Build both stores, search both, print the comparison."""
    k = max(KS)
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name, database_url in (("SQLite FTS5", None), ("PostgreSQL", url)):
            db = await open_database(database_url, Path(tmp) / "bench.db")
            try:
                dia = await fill(db, conversations)
                await search_all(db, conversations[:1], k)  # warm caches and plans
                rankings, times = await search_all(db, conversations, k)
            finally:
                await db.close()
            results[name] = (dia, rankings, times)
    questions = [q for conv in conversations for q in conv.questions]
    print(f"{len(questions)} questions over {len(results['PostgreSQL'][0])} turns")
    header = " | ".join(f"recall@{n:<2}" for n in KS)
    print(f"{'':12} | {header} | p50 ms | p95 ms")
    for name, (dia, rankings, times) in results.items():
        recalls = []
        for n in KS:
            shares = [
                len(set(q.evidence) & {dia[c] for c, _ in ranking[:n]}) / len(q.evidence)
                for q, ranking in zip(questions, rankings, strict=True)
            ]
            recalls.append(statistics.fmean(shares))
        cells = " | ".join(f"{r:9.3f}" for r in recalls)
        print(f"{name:12} | {cells} | {statistics.median(times):6.2f} | {_p95(times):6.2f}")
    _agreement(results["SQLite FTS5"], results["PostgreSQL"])


def _agreement(
    sqlite: tuple[dict[int, str], list[list[tuple[int, float]]], list[float]],
    postgres: tuple[dict[int, str], list[list[tuple[int, float]]], list[float]],
) -> None:
    top1, overlap, worst = 0, [], 0.0
    pairs = list(zip(sqlite[1], postgres[1], strict=True))
    for left, right in pairs:
        # Compare turns, not ids: each backend numbers its own rows.
        a = [sqlite[0][c] for c, _ in left]
        b = [postgres[0][c] for c, _ in right]
        top1 += bool(a and b and a[0] == b[0]) or (not a and not b)
        if a[:10] or b[:10]:
            overlap.append(len(set(a[:10]) & set(b[:10])) / max(len(a[:10]), len(b[:10])))
        scores = {sqlite[0][c]: s for c, s in left}
        for c, s in right:
            if (theirs := scores.get(postgres[0][c])) is not None:
                worst = max(worst, abs(s - theirs) / max(abs(theirs), 1e-9))
    print(f"top-1 equal: {top1 / len(pairs):.3f}; top-10 overlap: {statistics.fmean(overlap):.3f};"
          f" largest relative score difference of a shared chunk: {worst:.4f}")


def _p95(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.95) - 1)]


def main() -> None:
    """Print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--database-url", help="an empty PostgreSQL database (default: a throwaway cluster)")
    parser.add_argument("--dataset", type=Path, default=DATASET, help=argparse.SUPPRESS)
    args = parser.parse_args()
    conversations = load(args.dataset, args.conversations, None)
    if args.database_url:
        asyncio.run(run(args.database_url, conversations))
        return
    with PostgresServer() as server:
        asyncio.run(run(server.create_database(), conversations))


if __name__ == "__main__":
    main()

"""Which BM25 scales: SQLite FTS5 (porter) vs rank-bm25, on one user's memory of N chunks.

    python -m scripts.bench_lexical --sizes 1000,10000,100000
    python -m scripts.bench_lexical --sizes 1000,10000 --database-url postgresql://...

With --database-url the index is PostgreSQL's (memory.storage.pg_search) instead of FTS5:
give it an empty database for each size, which it fills.

rank-bm25 keeps the corpus in Python and scores every document per query; FTS5 reads only
the posting lists of the query's terms. Both are timed on the same synthetic corpus and
the same queries; rank-bm25's index build (needed again after every write) is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

from rank_bm25 import BM25Okapi

from memory import ChunkSearch, Database, NewTurn, TurnLog, open_database

WORDS = (
    "deploy pipeline cluster database migration cache retry timeout alert dashboard billing "
    "invoice customer refund schema index query latency throughput kafka redis postgres "
    "python typescript react service endpoint token budget memory session user profile "
    "weekend hiking painting guitar recipe garden travel flight hotel museum concert family "
    "birthday doctor appointment gym running marathon coffee book novel movie camera"
).split()
FILLER = "the a we it was is to of and in for on with that this after before".split()
_TOKEN = re.compile(r"\w+")


# A Zipf-shaped vocabulary like real chat: a few words everywhere, most words rare.
VOCABULARY = WORDS + [f"{a}{b}" for a in WORDS for b in ("er", "ing", "s", "ed", "ly", "ion")]
ZIPF = [1.0 / (rank + 1) for rank in range(len(VOCABULARY))]


def sentence(rng: random.Random, length: int) -> str:
    """A synthetic chat turn: content words drawn Zipf-style, with function words."""
    return " ".join(
        rng.choices(VOCABULARY, ZIPF)[0] if rng.random() < 0.5 else rng.choice(FILLER)
        for _ in range(length)
    )


async def build(path: Path, texts: list[str], url: str | None = None) -> Database:
    """A database (PostgreSQL at `url`, else SQLite) holding `texts` as indexed chunks of
    one user."""
    db = await open_database(url, path)
    log = TurnLog(db)
    after = None
    for i, text in enumerate(texts):
        result = await log.append_turns(
            "bench-user", f"s{i // 20}", [NewTurn("user", text)],
            after=after if i % 20 else None, job_kind=None,
        )
        after = result.last_id
        assert result.last_id is not None
        await log.add_chunks(result.last_id, [(0, "prose", text, len(text.split()))])
    return db


async def measure(
    size: int, queries: list[str], rng: random.Random, url: str | None = None
) -> dict[str, float]:
    """Median and p95 query time of both engines at one corpus size."""
    texts = [sentence(rng, rng.randint(8, 60)) for _ in range(size)]
    with tempfile.TemporaryDirectory() as tmp:
        db = await build(Path(tmp) / "bench.db", texts, url)
        try:
            search = ChunkSearch(db)
            fts = []
            for query in queries:
                started = time.perf_counter()
                await search.search("bench-user", query, k=60)
                fts.append((time.perf_counter() - started) * 1000)
        finally:
            await db.close()
    started = time.perf_counter()
    bm25 = BM25Okapi([_TOKEN.findall(t.lower()) for t in texts])
    build_ms = (time.perf_counter() - started) * 1000
    ranked = []
    for query in queries:
        started = time.perf_counter()
        scores = bm25.get_scores(_TOKEN.findall(query.lower()))
        sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:60]
        ranked.append((time.perf_counter() - started) * 1000)
    return {
        "fts5_p50": statistics.median(fts), "fts5_p95": _p95(fts),
        "rank_bm25_p50": statistics.median(ranked), "rank_bm25_p95": _p95(ranked),
        "rank_bm25_build": build_ms,
    }


def _p95(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.95) - 1]


def main() -> None:
    """Print the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--database-url", action="append", default=[],
                        help="an empty PostgreSQL database per size, in order (instead of FTS5)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    urls: list[str | None] = list(args.database_url) or [None] * len(sizes)
    if len(urls) != len(sizes):
        parser.error("give one --database-url per size")
    engine = "FTS5" if urls[0] is None else "PG"
    rng = random.Random(7)
    queries = [sentence(rng, rng.randint(4, 10)) for _ in range(args.queries)]
    print(f"{'chunks':>8} | {engine + ' p50':>9} {'p95':>8} | {'rank-bm25 p50':>13} {'p95':>8} {'build':>9}")
    for size, url in zip(sizes, urls, strict=True):
        r = asyncio.run(measure(size, queries, rng, url))
        print(f"{size:>8} | {r['fts5_p50']:>7.2f}ms {r['fts5_p95']:>6.2f}ms | "
              f"{r['rank_bm25_p50']:>11.2f}ms {r['rank_bm25_p95']:>6.2f}ms {r['rank_bm25_build']:>7.0f}ms")


if __name__ == "__main__":
    main()

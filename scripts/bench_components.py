"""Timings of the engine's parts on their own: the embedding model, the store, the vector index.

The figures the test suite used to print (tests only assert; figures belong here)::

    .venv/bin/python -m scripts.bench_components                 # all parts, full size
    .venv/bin/python -m scripts.bench_components --quick --json out.json

- embedding: one query embedded (the recall path), and documents in batches of 64 (indexing).
- store: resending a 20-message history (the exactly-once log's common case), and FTS5
  search over ~100k chunks of 200 users, for one heavy user (half the chunks) and light ones.
- vectors: Chroma add throughput and user-filtered queries at 10k vectors over 50 users.

Figures taken while other work loads the machine are noisy; compare runs made side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from memory import (
    ChunkSearch,
    LocalEmbedder,
    NewTurn,
    SQLiteDatabase,
    TurnLog,
    VectorIndex,
    find_model_dir,
)
from scripts.bench_overhead import MODEL_DIR

DIM = 384  # all-MiniLM-L6-v2


def timed(action: Callable[[], Any], runs: int) -> list[float]:
    """Milliseconds of each of `runs` calls, sorted."""
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return sorted(samples)


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median and p95 of sorted millisecond samples."""
    return {"p50_ms": round(statistics.median(samples), 3),
            "p95_ms": round(samples[min(len(samples) - 1, int(len(samples) * 0.95))], 3)}


def bench_embedding(model_dir: Path, *, runs: int, docs: int) -> dict[str, Any]:
    """One query at a time, then documents in batches of 64 on two threads."""
    embedder = LocalEmbedder(model_dir)
    query = "What programming language does the user prefer for new projects?"
    embedder.embed_sync([query])  # load and warm up
    texts = [f"Turn {i}: we discussed the deployment plan and its risks. " * (1 + i % 6)
             for i in range(docs)]
    batch = LocalEmbedder(model_dir, batch_size=64, threads=2)
    batch.embed_sync(texts[:1])
    started = time.perf_counter()
    batch.embed_sync(texts)
    per_doc = (time.perf_counter() - started) * 1000 / docs
    return {"query": summary(timed(lambda: embedder.embed_sync([query]), runs)),
            "document_ms": round(per_doc, 3), "documents": docs}


async def bench_store(path: Path, *, resends: int, heavy_turns: int, light_users: int,
                      queries: int) -> dict[str, Any]:
    """Resending a 20-message history; FTS5 over one heavy user and many light ones."""
    db = await SQLiteDatabase.open(path)
    store, search = TurnLog(db), ChunkSearch(db)
    try:
        history = [NewTurn("user" if i % 2 == 0 else "assistant",
                           f"message {i} " + "lorem ipsum " * 40) for i in range(20)]
        started = time.perf_counter()
        await store.append_turns("alice", "s1", history)
        first = (time.perf_counter() - started) * 1000
        samples = []
        for _ in range(resends):
            started = time.perf_counter()
            await store.append_turns("alice", "s1", history)
            samples.append((time.perf_counter() - started) * 1000)
        resend = {"first_ms": round(first, 3), **summary(sorted(samples))}
        return {"resend_20_messages": resend,
                **await _fts(store, search, heavy_turns, light_users, queries)}
    finally:
        await db.close()


async def _fts(store: TurnLog, search: ChunkSearch, heavy_turns: int, light_users: int, queries: int) -> dict[str, Any]:
    rng = random.Random(7)
    vocabulary = [f"w{n}" for n in range(20_000)]
    weights = [1 / (rank + 1) for rank in range(len(vocabulary))]  # Zipf-like, as in prose
    pool = rng.choices(vocabulary, weights, k=400_000)

    async def load(user: str, turns: int, chunks_per_turn: int) -> None:
        history = [NewTurn("user", f"{user} turn {t}") for t in range(turns)]
        for turn_id in (await store.append_turns(user, "s", history)).new_ids:
            starts = (rng.randrange(len(pool) - 40) for _ in range(chunks_per_turn))
            chunks = [(i, "prose", " ".join(pool[s : s + 40]), 40) for i, s in enumerate(starts)]
            await store.add_chunks(turn_id, chunks)

    started = time.perf_counter()
    await load("heavy", heavy_turns, 500)
    for n in range(light_users):
        await load(f"light{n}", 1, 250)
    loaded = time.perf_counter() - started
    asked = [" ".join(rng.choices(vocabulary[:5000], k=4)) for _ in range(queries)]
    found: dict[str, Any] = {"chunks": heavy_turns * 500 + light_users * 250,
                             "users": light_users + 1, "load_s": round(loaded, 1)}
    for label, heavy in (("heavy_user", True), ("light_user", False)):
        samples = []
        for query in asked:
            user = "heavy" if heavy else f"light{rng.randrange(light_users)}"
            started = time.perf_counter()
            await search.search(user, query, k=20)
            samples.append((time.perf_counter() - started) * 1000)
        found[f"fts_k20_{label}"] = summary(sorted(samples))
    return found


def bench_vectors(path: Path, *, total: int, users: int, queries: int) -> dict[str, Any]:
    """Chroma: add in batches of 64, then k=50 queries filtered to a user (and a session)."""
    rng = np.random.default_rng(7)

    def unit(n: int) -> npt.NDArray[np.float32]:
        vectors = rng.standard_normal((n, DIM)).astype(np.float32)
        unit_rows: npt.NDArray[np.float32] = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        return unit_rows

    index = VectorIndex.open(path)
    try:
        vectors, batch = unit(total), 64
        started = time.perf_counter()
        for start in range(0, total, batch):
            stop = min(start + batch, total)
            index.add([f"v{i}" for i in range(start, stop)], vectors[start:stop],
                      [{"user_id": f"u{i % users}", "session_id": f"s{i % 7}"}
                       for i in range(start, stop)])
        added = time.perf_counter() - started
        probes = iter(unit(2 * queries + 1))
        index.query(next(probes), k=50, where={"user_id": "u3"})
        user = timed(lambda: index.query(next(probes), k=50, where={"user_id": "u3"}), queries)
        session = timed(lambda: index.query(next(probes), k=50,
                                            where={"user_id": "u3", "session_id": "s1"}), queries)
    finally:
        index.close()
    return {"vectors": total, "users": users, "add_per_s": round(total / added),
            "query_k50_user": summary(user), "query_k50_user_session": summary(session)}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every part asked for; the figures as one JSON-ready dict."""
    quick = args.quick
    figures: dict[str, Any] = {"quick": quick}
    if "embedding" in args.parts:
        figures["embedding"] = bench_embedding(
            find_model_dir(args.model_dir), runs=5 if quick else 30, docs=16 if quick else 128)
    if "store" in args.parts:
        figures["store"] = asyncio.run(bench_store(
            work / "store.db", resends=20 if quick else 200, heavy_turns=2 if quick else 100,
            light_users=9 if quick else 199, queries=20 if quick else 100))
    if "vectors" in args.parts:
        figures["vectors"] = bench_vectors(
            work / "vectors", total=640 if quick else 10_000, users=50, queries=10 if quick else 50)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_components", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="embedding,store,vectors", type=lambda s: s.split(","),
                        help="comma-separated: embedding, store, vectors")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-components-") as work:
        figures = run(args, Path(work))
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

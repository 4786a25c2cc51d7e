"""How fast `memproxy migrate` copies: an embedded install of N synthetic turns (one chunk
each, a vector per chunk) moved into an empty PostgreSQL database and a Chroma server.

    python -m scripts.bench_migrate --turns 10000 --database-url postgresql://... \\
        [--chroma-url http://127.0.0.1:8000]

The rows go through PostgreSQL's full-text triggers (tsvector, term counts), which is most of
the cost; vectors are copied as stored, never embedded again.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from config import load_settings
from memory import CopiedBatch, VectorIndex, collection_name, migrate
from scripts.bench_lexical import build, sentence

DIM = 384  # all-MiniLM-L6-v2's


def fill(data_dir: Path, turns: int) -> int:
    """An embedded install of `turns` one-chunk turns and their vectors; returns the rows."""
    rng = random.Random(7)
    texts = [sentence(rng, rng.randint(8, 40)) for _ in range(turns)]

    async def write() -> None:
        db = await build(data_dir / "memproxy.db", texts)
        await db.close()

    asyncio.run(write())
    settings = load_settings(env={"MEMPROXY_DATA_DIR": str(data_dir)})
    vectors = VectorIndex.open(settings.vectors_path, collection_name(settings))
    try:
        matrix = np.random.default_rng(7).standard_normal((turns, DIM)).astype(np.float32)
        matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
        for start in range(0, turns, 1000):
            ids = [f"c{i + 1}" for i in range(start, min(start + 1000, turns))]
            vectors.add(ids, matrix[start : start + len(ids)],
                        [{"user_id": "bench-user", "source": "chunk"}] * len(ids))
    finally:
        vectors.close()
    return turns


def main() -> None:
    """Fill, migrate, print the rates."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10000)
    parser.add_argument("--database-url", required=True, help="an empty PostgreSQL database")
    parser.add_argument("--chroma-url", help="a Chroma server without this collection")
    parser.add_argument("--batch-size", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-migrate-") as tmp:
        started = time.perf_counter()
        fill(Path(tmp), args.turns)
        print(f"filled {args.turns} turns in {time.perf_counter() - started:.1f} s")
        settings = load_settings(env={"MEMPROXY_DATA_DIR": tmp})
        tables: dict[str, float] = {}
        last = time.perf_counter()

        def timed(batch: CopiedBatch) -> None:
            nonlocal last
            now = time.perf_counter()
            tables[batch.table] = tables.get(batch.table, 0.0) + now - last
            last = now

        done = migrate(settings, args.database_url, chroma_url=args.chroma_url,
                       batch_size=args.batch_size, on_batch=timed)
    rows = sum(done.copied_rows.values())
    row_seconds = sum(s for name, s in tables.items() if not name.startswith("vectors"))
    print(f"{rows} rows in {row_seconds:.1f} s: {rows / row_seconds:.0f} rows/s")
    for name, seconds in tables.items():
        count = (done.copied_vectors.get(name.removeprefix("vectors "), 0)
                 if name.startswith("vectors") else done.copied_rows[name])
        print(f"  {name:<28} {count:>7} in {seconds:6.1f} s  {count / seconds:8.0f}/s")
    print(f"total {done.seconds:.1f} s")


if __name__ == "__main__":
    main()

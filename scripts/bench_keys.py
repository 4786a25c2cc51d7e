"""What a stored key costs to check (docs/keys.md): `authenticate` with a key from the
database, cached and not, beside a key from MEMPROXY_API_KEYS, in one run::

    .venv/bin/python -m scripts.bench_keys                  # SQLite in a temporary directory
    .venv/bin/python -m scripts.bench_keys --database-url postgresql://...   # PostgreSQL

A cached lookup is one SHA-256 of the secret, a dict read and a constant-time compare; a
miss reads the row by its digest. The target is a cached lookup within 0.1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from config import Settings, load_settings
from memory import KeyStore, open_database
from proxy.access.identity import authenticate
from proxy.access.stored_keys import StoredKeys


async def per_call_us(call: Callable[[], Awaitable[object]], n: int, rounds: int = 5) -> float:
    """Median over rounds of microseconds per call."""
    figures = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(n):
            await call()
        figures.append((time.perf_counter() - started) * 1e6 / n)
    return statistics.median(figures)


async def bench(database_url: str | None, data: Path, n: int) -> list[str]:
    db = await open_database(database_url, data / "memproxy.db")
    try:
        store = KeyStore(db)
        _, secret = await store.create(user_id="bench")
        settings = load_settings(env={"MEMPROXY_AUTH": "keys"})
        headers = {"authorization": f"Bearer {secret}"}
        # A TTL longer than the run: every lookup after the first is a hit.
        cached = StoredKeys(store, ttl=3600.0, touch_every=3600.0)
        await cached.find(secret)
        hit = await per_call_us(lambda: cached.find(secret), n)
        via_authenticate = await per_call_us(lambda: authenticate(headers, settings, cached), n)
        # TTL 0: every lookup reads the row.
        uncached = StoredKeys(store, ttl=0.0, touch_every=3600.0)
        miss = await per_call_us(lambda: uncached.find(secret), max(1, n // 100))
        lines = [
            f"stored key, cached (StoredKeys.find): {hit:.2f} us per lookup (target <= 100)",
            f"stored key, cached, through authenticate(): {via_authenticate:.2f} us",
            f"stored key, not cached (a database read, {db.dialect}): {miss:.1f} us",
        ]
        for count in (1, 100):
            env = load_settings(env={"MEMPROXY_API_KEYS": ",".join(
                f"env-key-{i:08d}" for i in range(count))})
            last = {"authorization": f"Bearer env-key-{count - 1:08d}"}  # compared with all

            async def env_key(env: Settings = env, last: dict[str, str] = last) -> object:
                return await authenticate(last, env, None)

            us = await per_call_us(env_key, n)
            lines.append(f"MEMPROXY_API_KEYS with {count} key(s), through authenticate(): {us:.2f} us")
        await cached.aclose()
        await uncached.aclose()
        return lines
    finally:
        await db.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help="PostgreSQL instead of a temporary SQLite file")
    parser.add_argument("-n", type=int, default=20_000, help="lookups per round (5 rounds)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memproxy-bench-keys-") as tmp:
        lines = asyncio.run(bench(args.database_url, Path(tmp), args.n))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

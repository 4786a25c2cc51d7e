"""MCP search and add against the memory API, at 10k turns, in the same run.

A store of one user with 10k turns (bench_recall's seeded corpus; stand-in vectors built by
`HashedEmbedder` so it builds in minutes; queries use the real model) is served by
`python -m proxy serve` on 127.0.0.1 (keys off: a loopback client). The same queries go, one
at a time and alternating, to `POST /v1/memory/search` and to the `search_memory` tool on
/mcp (JSON-RPC over Streamable HTTP, JSON answers, protocol 2025-11-25, stateless: one POST
a call); then facts are added through `POST /v1/memory/facts` and `add_memory`. Reported per
arm: wall p50/p95 in ms and the server process's CPU per call (/proc/<pid>/schedstat). The
goal: MCP search adds at most 2 ms p50 over the memory API's search::

    .venv/bin/python -m scripts.bench_mcp --data-dir /tmp/mcp-bench-store
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from config import load_settings
from memory import MemoryEngine
from scripts.bench_overhead import MODEL_DIR, BenchError, child_env, free_port, percentile, serving
from scripts.bench_recall import PROGRESS, USER, Corpus, HashedEmbedder, grow, server_cpu_seconds

SEED = 7
HEADERS = {"X-Memory-User-Id": USER, "Content-Type": "application/json"}
MCP_HEADERS = {**HEADERS, "Accept": "application/json", "MCP-Protocol-Version": "2025-11-25"}


async def build(data_dir: Path, turns: int) -> None:
    """Grow the store to `turns` turns of the measured user (kept between runs)."""
    progress = {"user_turns": 0, "other_turns": 0}
    if (data_dir / PROGRESS).exists():
        progress = json.loads((data_dir / PROGRESS).read_text())
        if progress["user_turns"] >= turns:
            return
    settings = load_settings(env={"MEMPROXY_DATA_DIR": str(data_dir),
                                  "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR)})
    engine = await MemoryEngine.open(settings, embedder=HashedEmbedder(SEED))
    try:
        await grow(engine, Corpus(SEED, MODEL_DIR), progress, turns, 0.2, 5)
    finally:
        await engine.close()
    (data_dir / PROGRESS).write_text(json.dumps(progress))


def rpc(name: str, arguments: dict[str, Any], number: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": number, "method": "tools/call",
            "params": {"name": name, "arguments": arguments}}


def measure(pid: int, calls: Sequence[Callable[[], None]]) -> tuple[list[float], float]:
    """The wall ms of each of `calls`, run in order, and the server's CPU ms over them."""
    walls = []
    cpu_before = server_cpu_seconds([pid])
    for send in calls:
        started = time.perf_counter()
        send()
        walls.append((time.perf_counter() - started) * 1000)
    return walls, (server_cpu_seconds([pid]) - cpu_before) * 1000


def run(data_dir: Path, count: int) -> dict[str, dict[str, float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env(MEMPROXY_DATA_DIR=str(data_dir), MEMPROXY_UPSTREAM_BASE_URL="http://127.0.0.1:9/v1",
                    MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR), LITELLM_LOCAL_MODEL_COST_MAP="True",
                    MEMPROXY_LOG_LEVEL="warning", MEMPROXY_EXTRACT_EVERY="0",
                    MEMPROXY_SUMMARY_EVERY="0", MEMPROXY_SHUTDOWN_GRACE_SECONDS="5")
    queries = [q[-1]["content"][:2000] for q in Corpus(SEED, MODEL_DIR).queries(count)]
    argv = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
    with (tempfile.TemporaryDirectory(prefix="bench-mcp-logs-") as logs,
          serving("proxy", argv, env, f"{url}/readyz", Path(logs)) as pid,
          httpx.Client(base_url=url, timeout=60, trust_env=False) as http):

        def api_search(query: str) -> Callable[[], None]:
            def send() -> None:
                reply = http.post("/v1/memory/search", headers=HEADERS,
                                  json={"query": query, "scope": "user", "budget": 1000})
                if reply.status_code != 200:
                    raise BenchError(f"memory API search: {reply.status_code} {reply.text[:200]}")
            return send

        def mcp_call(name: str, arguments: dict[str, Any]) -> Callable[[], None]:
            def send() -> None:
                reply = http.post("/mcp", headers=MCP_HEADERS, json=rpc(name, arguments, 1))
                if reply.status_code != 200 or reply.json()["result"]["isError"]:
                    raise BenchError(f"mcp {name}: {reply.status_code} {reply.text[:200]}")
            return send

        def api_add(text: str) -> Callable[[], None]:
            def send() -> None:
                reply = http.post("/v1/memory/facts", headers=HEADERS,
                                  json={"text": text, "category": "context"})
                if reply.status_code != 201:
                    raise BenchError(f"memory API add: {reply.status_code} {reply.text[:200]}")
            return send

        for query in queries[:20]:  # warm-up: model, caches, connections
            api_search(query)()
            mcp_call("search_memory", {"query": query, "scope": "user", "budget": 1000})()
        results: dict[str, dict[str, float]] = {}
        # Alternating blocks of ten, so drift in the machine's load hits both arms alike.
        api_calls: list[tuple[list[float], float]] = []
        mcp_calls: list[tuple[list[float], float]] = []
        for start in range(0, count, 10):
            block = queries[start:start + 10]
            api_calls.append(measure(pid, [api_search(q) for q in block]))
            mcp_calls.append(measure(pid, [mcp_call(
                "search_memory", {"query": q, "scope": "user", "budget": 1000}) for q in block]))
        results["api_search"] = merged(api_calls)
        results["mcp_search"] = merged(mcp_calls)
        stamp = time.time_ns()
        api_adds: list[tuple[list[float], float]] = []
        mcp_adds: list[tuple[list[float], float]] = []
        for start in range(0, count // 2, 10):
            api_adds.append(measure(pid, [
                api_add(f"User noted item {stamp}-{start + i} for the API arm.") for i in range(10)]))
            mcp_adds.append(measure(pid, [mcp_call("add_memory", {
                "text": f"User noted item {stamp}-{start + i} for the MCP arm."}) for i in range(10)]))
        results["api_add"] = merged(api_adds)
        results["mcp_add"] = merged(mcp_adds)
    return results


def merged(blocks: list[tuple[list[float], float]]) -> dict[str, float]:
    """p50 and p95 of every call's wall time, and the server's CPU per call."""
    walls = [wall for block in blocks for wall in block[0]]
    return {"p50_ms": percentile(walls, 0.5), "p95_ms": percentile(walls, 0.95),
            "cpu_ms": sum(block[1] for block in blocks) / len(walls)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, help="keep the store here between runs")
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=200, help="searches per arm (adds: half)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as scratch:
        data_dir = args.data_dir or Path(scratch)
        data_dir.mkdir(parents=True, exist_ok=True)
        print(f"building {args.turns} turns in {data_dir} ...", file=sys.stderr)
        asyncio.run(build(data_dir, args.turns))
        results = run(data_dir, args.calls)
    print(f"{'arm':<12} {'p50 ms':>8} {'p95 ms':>8} {'CPU ms/call':>12}")
    for arm, figures in results.items():
        print(f"{arm:<12} {figures['p50_ms']:>8.2f} {figures['p95_ms']:>8.2f} {figures['cpu_ms']:>12.2f}")
    added = results["mcp_search"]["p50_ms"] - results["api_search"]["p50_ms"]
    print(f"MCP search adds {added:+.2f} ms p50 over the memory API's search (goal: at most 2 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

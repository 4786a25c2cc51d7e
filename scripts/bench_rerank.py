"""What the rerank stage adds to a memory request's latency, against rerank off in the same run.

Starts a scripted upstream and a scripted reranker in this process, and memproxy (memory on,
the local model, MEMPROXY_RERANK=endpoint, recall cache off so every request recalls) as a
subprocess on 127.0.0.1. A user's memory of --turns turns is stored first. Then, in rounds,
three arms take --requests chat completions each, one after the other, each asking another
question:

* ``off``: ``X-Memory-Rerank: off``, recall's fused order (the baseline);
* ``50ms``: the reranker answers after --delay-ms (50) milliseconds;
* ``hang``: the reranker answers after 10 s, so recall waits MEMPROXY_RERANK_TIMEOUT_MS
  (--timeout-ms, 300) and falls back to the fused order.

Printed per arm: the median over rounds of each round's p50 latency, and the difference with
the ``off`` arm. The issue's bar: ``50ms`` at most +60 ms, ``hang`` at most the timeout +5 ms::

    .venv/bin/python -m scripts.bench_rerank                # ~2 minutes
    .venv/bin/python -m scripts.bench_rerank --rounds 5 --requests 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from scripts.bench_overhead import MODEL_DIR, BenchError, child_env, free_port, serving
from scripts.eval_locomo import wait_indexed
from tests.support.scripted_upstream import JSONReply, Received, Reply, ScriptedUpstream

TOPICS = ["the billing service", "the garden", "our trip to Lisbon", "the new laptop",
          "the book club", "the kitchen paint", "the dog's walks", "the tax forms"]


def reranker_answer(delay: float) -> Callable[[Received], Reply | None]:
    """A Cohere-style rerank endpoint answering after `delay` seconds, in the given order."""

    def answer(received: Received) -> Reply | None:
        documents = received.json.get("documents") or []
        return JSONReply({"results": [{"index": i, "relevance_score": 1 - i / 100}
                                      for i in range(len(documents))]}, delay=delay)

    return answer


def seed(client: httpx.Client, turns: int) -> None:
    """`turns` user messages (and their echoed replies) of one user across a few sessions."""
    for i in range(turns):
        topic = TOPICS[i % len(TOPICS)]
        client.post("/v1/chat/completions", headers={
            "X-Memory-Read": "off", "X-Memory-Session-Id": f"seed-{i // 10}",
        }, json={"model": "gpt-4o", "messages": [
            {"role": "user", "content": f"Note {i}: about {topic}, remember detail number {i}."}
        ]}).raise_for_status()


def phase(client: httpx.Client, requests: int, start: int, headers: dict[str, str]) -> list[float]:
    """Latencies (ms) of `requests` chat completions, each a new question."""
    latencies = []
    for i in range(start, start + requests):
        topic = TOPICS[i % len(TOPICS)]
        began = time.perf_counter()
        response = client.post("/v1/chat/completions", headers={
            **headers, "X-Memory-Session-Id": f"ask-{i}", "X-Memory-Write": "off",
        }, json={"model": "gpt-4o", "messages": [
            {"role": "user", "content": f"What did I say about {topic} (question {i})?"}
        ]})
        latencies.append((time.perf_counter() - began) * 1000)
        if response.status_code != 200:
            raise BenchError(f"HTTP {response.status_code}: {response.text[:300]}")
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--delay-ms", type=float, default=50)
    parser.add_argument("--timeout-ms", type=int, default=300)
    args = parser.parse_args()
    arms = {"off": (None, {"X-Memory-Rerank": "off"}),
            f"{args.delay_ms:g}ms": (args.delay_ms / 1000, {}), "hang": (10.0, {})}
    with tempfile.TemporaryDirectory() as tmp, ScriptedUpstream() as upstream, \
            ScriptedUpstream() as reranker:
        port = free_port()
        env = child_env(
            MEMPROXY_UPSTREAM_BASE_URL=upstream.base_url, MEMPROXY_DATA_DIR=f"{tmp}/data",
            MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR), MEMPROXY_LOG_LEVEL="warning",
            MEMPROXY_EXTRACT_EVERY="0", MEMPROXY_SUMMARY_EVERY="0",
            MEMPROXY_RECALL_CACHE_ENTRIES="0", MEMPROXY_RERANK="endpoint",
            MEMPROXY_RERANK_BASE_URL=f"http://127.0.0.1:{reranker.port}",
            MEMPROXY_RERANK_TIMEOUT_MS=str(args.timeout_ms),
        )
        argv = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
        with serving("memproxy", argv, env, f"http://127.0.0.1:{port}/readyz", Path(tmp)), \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False,
                             headers={"Authorization": "Bearer sk-bench",
                                      "X-Memory-User-Id": "bench"}) as client:
            seed(client, args.turns)
            wait_indexed(Path(tmp) / "data" / "memproxy.db")
            reranker.respond_with(reranker_answer(0.0))
            phase(client, 10, 10_000, {})  # warm-up
            p50s: dict[str, list[float]] = {arm: [] for arm in arms}
            asked = 0
            for _ in range(args.rounds):
                for arm, (delay, headers) in arms.items():
                    if delay is not None:
                        reranker.respond_with(reranker_answer(delay))
                    latencies = phase(client, args.requests, asked, headers)
                    asked += args.requests
                    p50s[arm].append(statistics.median(latencies))
    base = statistics.median(p50s["off"])
    print(f"rerank latency, memory on, {args.rounds} rounds x {args.requests} requests "
          f"({args.turns} turns stored, timeout {args.timeout_ms} ms)")
    print(f"{'arm':>8} {'p50 ms':>8} {'vs off':>8}   rounds' p50s")
    for arm, values in p50s.items():
        p50 = statistics.median(values)
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{arm:>8} {p50:8.1f} {p50 - base:+8.1f}   {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

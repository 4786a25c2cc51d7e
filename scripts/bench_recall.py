"""Recall latency and indexing throughput for one user among many, at 1k, 10k and 100k turns.

A seeded synthetic corpus (prose, code blocks, names, numbers, identifiers; 10-300 tokens a
turn) goes through the real engine: `Store.append_turns` in sessions of 20 turns, indexed by
the engine's job worker. The measured user grows 1k -> 10k -> 100k turns while other users
hold a comparable amount in the same database and collection. Reported: indexing throughput
on a fresh store (busy time of embedding, Chroma and SQLite); `MemoryEngine.recall` p50/p95
(budget 1000, scope user) and its stages timed alone, wall and process CPU; and at 10k, chat
completions sent straight to a scripted upstream vs through memproxy (concurrency 1), reading
only and reading and writing. The scripted upstream answers in about a millisecond, so the
writing phases store turns faster than two cores index them; each waits for the index queue
to drain before the next phase starts, and the wait is reported::

    .venv/bin/python -m scripts.bench_recall --quick        # 1k and 10k, light load
    .venv/bin/python -m scripts.bench_recall --data-dir /tmp/recall-store --json out.json

`--postgres` measures recall once more, in the same run, with memproxy's tables in a
PostgreSQL started here on 127.0.0.1 (`tests/support/servers.py`; vectors in embedded Chroma
as on SQLite; no indexing slice or end-to-end part there), and prints both tables and the
ratios::

    .venv/bin/python -m scripts.bench_recall --postgres --sizes 10000,100000 --index-turns 0 \
        --e2e-size 0 --build-embedder hashed --data-dir /tmp/recall-store

On PostgreSQL the CPU figures add the server's work to memproxy's: the CPU time of the
postmaster and all its children (the backends serving the pool, writers, autovacuum), read
from /proc/<pid>/schedstat (nanoseconds; /proc/<pid>/stat counts 10 ms ticks, too coarse
for one query) at each mark, like `time.process_time()` for this process. The cluster runs
on this machine, so that is all the CPU one request costs; SQLite's work is in-process.

`--data-dir` keeps the store between runs (it only grows; on PostgreSQL the cluster is kept
in its `postgresql/cluster`). `--build-embedder hashed` fills it
with stand-in vectors (a random vector per word, averaged) so 100k turns build in minutes;
queries and the indexing slice always use the real model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from config import Settings, load_settings
from memory import (
    INDEX_JOB,
    LocalEmbedder,
    MemoryEngine,
    NewTurn,
    RecallRequest,
    build_query,
    count_tokens,
    for_embedding,
    turn_text,
)
from scripts.bench_overhead import MODEL_DIR, BenchError, child_env, free_port, percentile, serving
from tests.support.servers import PostgresServer

USER, MODEL, SESSION_TURNS, T0 = "bench-user", "gpt-4o-mini", 20, 1_700_000_000.0
PROGRESS = "bench_recall.json"
STAGES = ("recall", "embed", "chroma", "fts", "chunks", "learned")
WORD = re.compile(r"\w+")
NAMES = "Alice Bob Priya Chen Mateo Fatima Olu Sven Yuki Carlos Amara Dmitri Lena Ravi Noor".split()
PROJECTS = ["payments-api", "ingest pipeline", "mobile app", "search service", "auth gateway",
            "billing dashboard", "data warehouse", "recommendation model", "infra migration"]
TECH = "Postgres SQLite Redis Kafka Rust Go TypeScript React Django FastAPI Terraform gRPC".split()
NOUNS = "user order invoice cache retry token session queue batch config schema index event " \
        "payload webhook quota metric shard".split()
ACTIONS = "fetch parse load save build flush merge validate resolve sync render compute".split()
RELATIONS = "sister brother mother father cousin manager friend partner".split()
FACTS = [  # what users tell, and what they later ask about (ASKS)
    "{n} said the {p} deploy moves to next {day}.", "My {r} {n} is visiting on the {num}th.",
    "The `{i}` function fails when the {x} is empty; fixed in v{num}.{num2}.", "Set {i} to {num} in the {p} config, not {num2}.",
    "We agreed to move {p} to {t} by {day}.", "Latency of {p} went from {num} ms to {num2} ms after the {i} change.",
    "I prefer {t} over {t2} for anything touching the {x} path.", "The budget for {p} is ${num}k this quarter.",
    "{n} owns {i} and reviews every change to it.", "The bug in {i} was a race between {i2} and the {x} worker.",
    "Ticket OPS-{num} tracks the {x} cleanup for {p}."]
ASKS = [
    "What did {n} say about the {p} deploy?", "Why does `{i}` fail when the {x} is empty?", "When is my {r} visiting?",
    "What value did we set {i} to in the {p} config?", "How much did {p} latency change after the {i} change?",
    "Do I prefer {t} or {t2}?", "What is the budget for {p} this quarter?", "Who owns {i}?", "Which ticket tracks {x} cleanup?",
    "Remind me what caused the bug in {i}.", "What did we decide about moving {p} to {t}?"]
FOLLOW_UPS = ["and why was that?", "what about the other one?", "so when does it happen?"]
COMMON = ("the of and to in is you that it was for on are with as his they be at one have this "
          "from had not but what all were when can said there use each which she how their will "
          "other about out many then them these some her would make like him into time has look "
          "two more write see number way could people than first water been call who its now find "
          "long down day did get come made may part").split()


def identifier(rng: random.Random) -> str:
    a, x = rng.choice(ACTIONS), rng.choice(NOUNS)
    return rng.choice((f"{a}_{x}", f"{a}{x.title()}", f"{x}.{a}_{rng.choice(NOUNS)}", f"{x.upper()}_{a.upper()}"))


class Corpus:
    """Deterministic chat turns: template facts among Zipf-distributed filler words."""

    def __init__(self, seed: int, model_dir: Path) -> None:
        vocab = (model_dir / "onnx" / "vocab.txt").read_text().split()
        words = [w for w in vocab if w.isascii() and w.isalpha() and len(w) > 2 and w not in COMMON]
        random.Random(seed).shuffle(words)
        self.words = np.array(COMMON + words)  # function words first, as in real text
        self.cum = np.cumsum(1 / np.arange(1, len(self.words) + 1) ** 1.05)
        self.seed = seed

    def slots(self, rng: random.Random) -> dict[str, str]:
        t, t2 = rng.sample(TECH, 2)
        return {"n": rng.choice(NAMES), "p": rng.choice(PROJECTS), "t": t, "t2": t2,
                "i": identifier(rng), "i2": identifier(rng), "x": rng.choice(NOUNS),
                "r": rng.choice(RELATIONS), "num": str(rng.randint(2, 999)),
                "num2": str(rng.randint(2, 99)), "day": rng.choice(("Monday", "Friday", "week"))}

    def code(self, rng: random.Random) -> str:
        s = self.slots(rng)
        if rng.random() < 0.5:
            return f"```sql\nSELECT id, {s['x']}_id FROM {s['x']}s WHERE shard = {s['num']} LIMIT {s['num2']};\n```"
        return (f"```python\ndef {s['i'].replace('.', '_')}({s['x']}, retries={s['num2']}):\n"
                f"    result = {s['i2']}({s['x']})\n    if not result:\n"
                f"        raise ValueError('{s['x']} {s['num']} missing')\n    return result\n```")

    def turn(self, rng: random.Random, role: str) -> str:
        target = min(300, max(10, int(rng.lognormvariate(3.2 if role == "user" else 4.4, 0.6)))) / 1.4
        parts = [self.code(rng)] if role == "assistant" and rng.random() < 0.2 else []
        draws = np.random.default_rng(rng.getrandbits(64)).random(int(target) + 18) * self.cum[-1]
        words, size = list(self.words[np.searchsorted(self.cum, draws)]), sum(len(p.split()) for p in parts)
        while size < target:
            if rng.random() < 0.35:
                parts.append(rng.choice(FACTS).format(**self.slots(rng)))
            else:
                k = rng.randint(6, 18)
                parts.append(" ".join(words[:k]).capitalize() + ".")
                words = words[k:] or words
            size += len(parts[-1].split())
        rng.shuffle(parts)
        return " ".join(parts) if rng.random() < 0.7 else "\n\n".join(parts)

    def session(self, user: str, number: int) -> list[NewTurn]:
        rng = random.Random(f"{self.seed}:{user}:{number}")
        start = T0 + number * 3600 + rng.random() * 600
        texts = [(role, self.turn(rng, role)) for role in ("user", "assistant") * (SESSION_TURNS // 2)]
        return [NewTurn(role, text, created_at=start + 60 * i, model=MODEL, tokens=count_tokens(text, MODEL))
                for i, (role, text) in enumerate(texts)]

    def queries(self, count: int) -> list[list[dict[str, str]]]:
        rng, out = random.Random(f"{self.seed}:queries"), []
        for i in range(count):
            ask = rng.choice(ASKS).format(**self.slots(rng))
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            if i % 5 == 4:  # an elliptical follow-up: the query takes the previous turns along
                messages += [{"role": "user", "content": ask},
                             {"role": "assistant", "content": self.turn(rng, "assistant")},
                             {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
            elif i % 7 == 6:  # pasted context, then the question
                messages.append({"role": "user", "content": self.turn(rng, "assistant") + "\n\n" + ask})
            else:
                messages.append({"role": "user", "content": ask})
            out.append(messages)
        return out


# -- building the store ----------------------------------------------------------------------


class HashedEmbedder:
    """Stand-in for building big stores fast: a seeded random vector per word, averaged."""

    def __init__(self, seed: int, buckets: int = 1 << 15) -> None:
        self.table = np.random.default_rng(seed).standard_normal((buckets, 384), dtype=np.float32)

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray:
        rows = [[zlib.crc32(w.encode()) % len(self.table) for w in WORD.findall(t.lower())] or [0]
                for t in texts]
        out = np.stack([self.table[ids].mean(axis=0) for ids in rows])
        unit: np.ndarray = out / np.linalg.norm(out, axis=1, keepdims=True).clip(1e-12)
        return unit

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        return await asyncio.to_thread(self.embed_sync, texts)


class Timed:
    """An embedder (`embed`) or a vector index (`add`) with its busy seconds added up."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        started = time.perf_counter()
        vectors = await self.inner.embed(texts)
        self.seconds += time.perf_counter() - started
        return vectors  # type: ignore[no-any-return]

    def add(self, *args: Any) -> None:
        started = time.perf_counter()
        self.inner.add(*args)
        self.seconds += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def grow(engine: MemoryEngine, corpus: Corpus, progress: dict[str, Any], user_turns: int,
               share: float, others: int, job_turns: int = SESSION_TURNS) -> dict[str, float]:
    """Add sessions until the measured user holds `user_turns`, `job_turns` turns an append
    (one index job each, as one chat request queues); wait until all are indexed."""
    have_user, have_other = progress["user_turns"] // SESSION_TURNS, progress["other_turns"] // SESSION_TURNS
    want_user, want_other = user_turns // SESSION_TURNS, round(share * user_turns) // SESSION_TURNS
    plan = [((s - have_user) / max(1, want_user - have_user), USER, s) for s in range(have_user, want_user)]
    plan += [((k - have_other) / max(1, want_other - have_other), f"other-{k % others:03d}", k)
             for k in range(have_other, want_other)]  # interleaved, as in a shared database
    started, append_s = time.perf_counter(), 0.0
    for n, (_, user, number) in enumerate(sorted(plan)):
        turns = corpus.session(user, number)
        mark, after = time.perf_counter(), None
        for start in range(0, len(turns), job_turns):
            appended = await engine.log.append_turns(
                user, f"s{number}", turns[start : start + job_turns], after=after, job_kind=INDEX_JOB
            )
            after = appended.last_id
        append_s += time.perf_counter() - mark
        if n % 25 == 0:
            engine.worker.notify()
    await engine.worker.run_until_idle(timeout=4 * 3600)
    seconds = time.perf_counter() - started
    progress.update(user_turns=max(progress["user_turns"], want_user * SESSION_TURNS),
                    other_turns=max(progress["other_turns"], want_other * SESSION_TURNS))
    added = len(plan) * SESSION_TURNS
    return {"turns_added": added, "seconds": seconds, "turns_per_s": added / seconds, "append_s": append_s}


async def indexing_throughput(settings: Settings, corpus: Corpus, turns: int,
                              job_turns: int) -> dict[str, float]:
    """Index the first `turns` turns into a fresh store with the model the settings name
    (an int8 one is built first); add up each component's busy time."""
    with tempfile.TemporaryDirectory(prefix="bench-recall-fresh-") as tmp:
        engine = await MemoryEngine.open(settings.replace(data_dir=Path(tmp)))
        cpu = time.process_time()
        timed = engine.embedder = Timed(engine.embedder)
        # Index jobs write through the shared-vectors layer's index (the engine's Chroma).
        shared = engine.shared_vectors
        vectors = shared.index = Timed(shared.index)  # type: ignore[assignment]
        try:
            built = await grow(engine, corpus, {"user_turns": 0, "other_turns": 0}, turns, 0.0, 1,
                               job_turns)
        finally:
            await engine.close()
    return {**built, "embed_s": timed.seconds, "chroma_add_s": vectors.seconds,
            "cpu_ms_per_turn": (time.process_time() - cpu) * 1000 / turns}


# -- recall ----------------------------------------------------------------------------------


async def measure_recall(engine: MemoryEngine, queries: list[list[dict[str, str]]], warmup: int,
                         cpu_clock: Callable[[], float] = time.process_time) -> dict[str, Any]:
    """Recall, then each of its stages alone (as recall runs them): wall and CPU ms per query
    (`cpu_clock`: CPU seconds of this process, plus the database server's on PostgreSQL)."""
    k, where = engine.settings.recall_candidates, {"user_id": USER, "source": "turn"}
    wall: dict[str, list[float]] = {s: [] for s in STAGES}
    cpu: dict[str, list[float]] = {s: [] for s in STAGES}
    items, tokens, cold = [], [], 0.0
    for n, messages in enumerate(queries[:warmup] + queries):
        query, marks = build_query(messages), [(time.perf_counter(), cpu_clock())]
        recalled = await engine.recall(RecallRequest(USER, "bench-query", messages, MODEL, 1000, "user"))
        marks.append((time.perf_counter(), cpu_clock()))
        if n == 0:  # the first recall after opening also loads the user's vectors
            cold = (marks[1][0] - marks[0][0]) * 1000
        vector = (await engine.embedder.embed([for_embedding(query, engine.settings.query_embed_words)]))[0]
        marks.append((time.perf_counter(), cpu_clock()))
        dense = await asyncio.to_thread(engine.vectors.query, vector, k=k, where=where)
        marks.append((time.perf_counter(), cpu_clock()))
        lexical = await engine.lexical.search(USER, query, k=k)
        marks.append((time.perf_counter(), cpu_clock()))
        await engine.log.get_chunks(list({int(key[1:]) for key, _ in dense} | {i for i, _ in lexical}))
        marks.append((time.perf_counter(), cpu_clock()))
        present = "\n".join(turn_text(m) for m in messages)  # facts, summaries, profile
        await engine.learned_recall.gather(USER, "bench-query", query, vector, session_only=False, present=present)
        marks.append((time.perf_counter(), cpu_clock()))
        if n >= warmup:
            for stage, a, b in zip(STAGES, marks[:-1], marks[1:], strict=True):
                wall[stage].append((b[0] - a[0]) * 1000)
                cpu[stage].append((b[1] - a[1]) * 1000)
            items.append(len(recalled.items))
            tokens.append(recalled.tokens)
    stages = {s: {"p50": percentile(wall[s], 0.5), "p95": percentile(wall[s], 0.95),
                  "cpu_p50": percentile(cpu[s], 0.5)} for s in STAGES}
    return {"stages": stages, "queries": len(queries), "items_mean": statistics.fmean(items),
            "tokens_mean": statistics.fmean(tokens), "cold_ms": cold}


# -- end to end ------------------------------------------------------------------------------


def end_to_end(data_dir: Path, queries: list[list[dict[str, str]]], rounds: int, per_phase: int) -> dict[str, Any]:
    """Chat completions at concurrency 1: direct, through memproxy read-only, and read+write."""
    ports, base = {"direct": free_port(), "proxy": free_port()}, "http://127.0.0.1:{}"
    env = child_env(MEMPROXY_DATA_DIR=str(data_dir), MEMPROXY_UPSTREAM_BASE_URL=base.format(ports["direct"]) + "/v1",
                    MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR), LITELLM_LOCAL_MODEL_COST_MAP="True",
                    MEMPROXY_LOG_LEVEL="warning", MEMPROXY_SHUTDOWN_GRACE_SECONDS="5")
    up = [sys.executable, "-m", "scripts.scripted_upstream", "--port", str(ports["direct"])]
    proxy = [sys.executable, "-m", "proxy", "serve", "--port", str(ports["proxy"])]
    # A new session each run: in a reused store, resending an earlier run's history stores nothing.
    session = f"bench-e2e-{time.time_ns()}"
    memory = {"x-memory-user-id": USER, "x-memory-session-id": session, "x-memory-budget": "1000",
              "x-memory-scope": "user", "x-memory-read": "on"}
    arms = {"direct": (ports["direct"], {}), "read": (ports["proxy"], {**memory, "x-memory-write": "off"}),
            "write": (ports["proxy"], {**memory, "x-memory-write": "on"})}
    p50s: dict[str, list[float]] = {arm: [] for arm in arms}
    injected: list[int] = []
    with (tempfile.TemporaryDirectory(prefix="bench-recall-logs-") as logs,
          serving("upstream", up, child_env(), base.format(ports["direct"]) + "/v1/models", Path(logs)),
          serving("proxy", proxy, env, base.format(ports["proxy"]) + "/readyz", Path(logs)),
          httpx.Client(timeout=30, trust_env=False, headers={"authorization": "Bearer sk-bench"}) as http):

        def phase(arm: str, count: int, offset: int) -> list[float]:
            port, headers = arms[arm]
            latencies = []
            for i in range(offset, offset + count):
                body = {"model": MODEL, "messages": queries[i % len(queries)]}
                started = time.perf_counter()
                reply = http.post(base.format(port) + "/v1/chat/completions", json=body, headers=headers)
                latencies.append((time.perf_counter() - started) * 1000)
                if reply.status_code != 200 or "x-memory-error" in reply.headers:
                    raise BenchError(f"{arm}: {reply.status_code} {reply.headers.get('x-memory-error')}")
                if arm == "read":
                    injected.append(int(reply.headers["x-memory-injected-tokens"]))
            return latencies

        for arm in arms:
            phase(arm, 20, 0)  # warm-up: connections, model, caches
        drains = [index_queue_drained(data_dir)]
        for round_no in range(rounds):  # alternating phases, ABBA, so drift hits every arm
            for arm in arms if round_no % 2 == 0 else reversed(arms):
                p50s[arm].append(percentile(phase(arm, per_phase, round_no * per_phase), 0.5))
                if arm == "write":
                    drains.append(index_queue_drained(data_dir))
    added = {arm: statistics.median(p - d for p, d in zip(p50s[arm], p50s["direct"], strict=True))
             for arm in ("read", "write")}
    return {"p50_ms": {arm: statistics.median(v) for arm, v in p50s.items()}, "added_p50_ms": added,
            "requests_per_arm": rounds * per_phase, "injected_tokens_mean": statistics.fmean(injected),
            "drain_s_mean": statistics.fmean(drains[1:])}


def index_queue_drained(data_dir: Path, timeout: float = 600.0) -> float:
    """Wait until memproxy has no index job queued or running; return the seconds waited."""
    started = time.perf_counter()
    db = load_settings(env={"MEMPROXY_DATA_DIR": str(data_dir)}).db_path
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        while conn.execute("SELECT 1 FROM jobs WHERE kind = ? AND status IN ('queued', 'running')"
                           " LIMIT 1", (INDEX_JOB,)).fetchone():
            if time.perf_counter() - started > timeout:
                raise BenchError(f"index jobs still pending after {timeout:.0f} s")
            time.sleep(0.2)
    return time.perf_counter() - started


# -- the run ---------------------------------------------------------------------------------


async def run(args: argparse.Namespace, settings: Settings, data_dir: Path,
              cpu_clock: Callable[[], float] = time.process_time) -> dict[str, Any]:
    embedder = LocalEmbedder(MODEL_DIR, threads=settings.embedding_threads)
    builder = embedder if args.build_embedder == "model" else HashedEmbedder(args.seed)
    corpus = Corpus(args.seed, MODEL_DIR)
    queries = corpus.queries(args.queries)
    report: dict[str, Any] = {"sizes": {}}
    for arm in args.index_arms if args.index_turns else ():
        precision, batch = arm.split(":")
        print(f"indexing {args.index_turns} turns into a fresh store ({arm}) ...", file=sys.stderr)
        arm_settings = settings.replace(embedding_precision=precision, index_batch_jobs=int(batch))
        report.setdefault("indexing", {})[arm] = await indexing_throughput(
            arm_settings, corpus, args.index_turns, args.index_job_turns)
    config = {"seed": args.seed, "others": args.others, "share": args.share, "build": args.build_embedder}
    progress = {"user_turns": 0, "other_turns": 0, **config}
    if (data_dir / PROGRESS).exists():
        progress = json.loads((data_dir / PROGRESS).read_text())
        if {k: progress.get(k) for k in config} != config:
            raise BenchError(f"{data_dir} was built with {progress}; pass the same options or another --data-dir")
    for size in args.sizes:
        if size < progress["user_turns"]:
            print(f"skipping {size}: the store already holds {progress['user_turns']}", file=sys.stderr)
            continue
        print(f"growing the measured user to {size} turns ...", file=sys.stderr)
        engine = await MemoryEngine.open(settings, embedder=builder)
        try:
            built = await grow(engine, corpus, progress, size, args.share, args.others)
            (data_dir / PROGRESS).write_text(json.dumps(progress))
        finally:
            await engine.close()
        print(f"  built in {built['seconds']:.0f} s; measuring recall ...", file=sys.stderr)
        engine = await MemoryEngine.open(settings, embedder=embedder)  # queries: the real model
        try:
            total = await engine.log.count_turns()
            recall = await measure_recall(engine, queries, 20, cpu_clock)
        finally:
            await engine.close()
        report["sizes"][size] = {"total_turns": total, "build": built, **recall}
        if size == args.e2e_size:
            print(f"end to end at {size} turns ...", file=sys.stderr)
            report["e2e"] = end_to_end(data_dir, queries, args.e2e_rounds, args.e2e_per_phase)
    return report


def print_report(report: dict[str, Any]) -> list[str]:
    """The per-size table, the indexing split, the end-to-end figures and the target lines."""
    print(f"\n{'user turns':>10} {'all turns':>9}  {'stage':8} {'p50 ms':>7} {'p95 ms':>7} {'cpu p50':>7}")
    for size, r in report["sizes"].items():
        for n, (stage, t) in enumerate(r["stages"].items()):
            head = f"{size:>10} {r['total_turns']:>9}" if n == 0 else " " * 20
            print(f"{head}  {stage:8} {t['p50']:7.1f} {t['p95']:7.1f} {t['cpu_p50']:7.1f}")
        print(f"{'':22}({r['items_mean']:.1f} items, {r['tokens_mean']:.0f} tokens injected on average;"
              f" first recall after start {r.get('cold_ms', float('nan')):.0f} ms, loading the user's vectors)")
    print("(stages below recall are its building blocks timed alone; learned = facts, summaries and"
          " profile; recall also fuses, expands context and packs; cpu = this process, all threads)")
    sizes = report["sizes"]
    embeds = [r["stages"]["embed"]["p50"] for r in sizes.values()]
    lines = [f"query embedding p50: {statistics.median(embeds) if embeds else float('nan'):.1f} ms (target <= 10)"]
    for size, target in ((10_000, 30), (100_000, 60)):
        p95 = f"{sizes[size]['stages']['recall']['p95']:.1f} ms" if size in sizes else "not run"
        lines.append(f"recall p95 @{size // 1000}k: {p95} (target <= {target})")
    for arm, ix in report.get("indexing", {}).items():
        print(f"indexing {ix['turns_added']} turns ({arm}): {ix['seconds']:.1f} s wall, {ix['cpu_ms_per_turn']:.1f}"
              f" CPU ms a turn; busy: embed {ix['embed_s']:.1f} s, chroma add {ix['chroma_add_s']:.1f} s,"
              f" sqlite append {ix['append_s']:.1f} s")
        lines.append(f"indexing ({arm}): {ix['turns_per_s']:.0f} turns/s (target >= 150)")
    if e2e := report.get("e2e"):
        print("end to end p50 ms: " + ", ".join(f"{k} {v:.2f}" for k, v in e2e["p50_ms"].items())
              + f"; read+write adds {e2e['added_p50_ms']['write']:.2f} ms; after each writing phase"
              f" the index queue took {e2e['drain_s_mean']:.1f} s to drain")
        lines.append(f"end-to-end added p50 @10k: {e2e['added_p50_ms']['read']:.2f} ms (target <= 15)")
    print("\n".join(lines))
    return lines


def on_postgres(args: argparse.Namespace, settings: Settings, data_dir: Path) -> dict[str, Any]:
    """`run` again with the tables in PostgreSQL (only the sizes: the indexing slice and the
    end-to-end part open stores of their own). The cluster and the vectors live in `data_dir`,
    kept between runs as the SQLite store is. CPU adds the server's processes to this one's."""
    with PostgresServer(data_dir / "cluster") as postgres:
        pg_settings = settings.replace(data_dir=data_dir, database_url=postgres.create_database("bench"))
        pg_args = argparse.Namespace(**{**vars(args), "index_turns": 0, "e2e_size": 0})

        def cpu_clock() -> float:
            return time.process_time() + server_cpu_seconds(postgres.backend_pids())

        return asyncio.run(run(pg_args, pg_settings, data_dir, cpu_clock))


def server_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds these processes have run (/proc/<pid>/schedstat: nanoseconds, unlike the
    10 ms ticks of /proc/<pid>/stat); a process that just exited counts nothing."""
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e9


def compare(sqlite: dict[Any, Any], postgres: dict[Any, Any]) -> list[str]:
    """Recall p50/p95 and CPU p50 per size, PostgreSQL next to SQLite, and the ratios."""
    lines = []
    for size in sqlite:
        a, b = sqlite[size]["stages"]["recall"], postgres[size]["stages"]["recall"]
        lines.append(
            f"recall @{size // 1000}k, SQLite / PostgreSQL: p50 {a['p50']:.1f} / {b['p50']:.1f} ms"
            f" (x{b['p50'] / a['p50']:.2f}), p95 {a['p95']:.1f} / {b['p95']:.1f} ms"
            f" (x{b['p95'] / a['p95']:.2f}), CPU p50 {a['cpu_p50']:.1f} / {b['cpu_p50']:.1f} ms"
            f" (x{b['cpu_p50'] / a['cpu_p50']:.2f}; goal <= x1.5)")
    print("\n".join(lines))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_recall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000", help="measured user's turns, growing")
    parser.add_argument("--quick", action="store_true", help="1k and 10k, light load, hashed build")
    parser.add_argument("--data-dir", type=Path, help="store to build or reuse (default: temp)")
    parser.add_argument("--build-embedder", choices=("model", "hashed"), default="model")
    parser.add_argument("--others", type=int, default=50, help="other users in the store")
    parser.add_argument("--share", type=float, default=1.0, help="others' turns per measured turn")
    parser.add_argument("--queries", type=int, default=240, help="recall queries, after 20 warm-up ones")
    parser.add_argument("--index-turns", type=int, default=2000, help="fresh-store slice; 0 skips")
    parser.add_argument("--index-job-turns", type=int, default=2,
                        help="turns per index job in that slice (a chat request queues one job)")
    parser.add_argument("--index-arms", nargs="+", default=["float32:1", "float32:32", "int8:32"],
                        metavar="PRECISION:BATCH", help="embedding precision and index jobs a batch")
    parser.add_argument("--e2e-size", type=int, default=10_000, help="0 skips the end-to-end part")
    parser.add_argument("--e2e-rounds", type=int, default=6)
    parser.add_argument("--e2e-per-phase", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--postgres", action="store_true",
                        help="recall at the same sizes on a PostgreSQL started here, too")
    parser.add_argument("--json", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    args.sizes = sorted(int(s) for s in args.sizes.split(",") if s)  # "": indexing only
    if args.quick:
        args.sizes, args.others, args.share, args.build_embedder = [1000, 10_000], 20, 0.2, "hashed"
        args.queries, args.index_turns, args.e2e_rounds, args.e2e_per_phase = 200, 300, 2, 40
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-recall-") as tmp:
        data_dir = (args.data_dir or Path(tmp)).resolve()
        settings = load_settings(env={"MEMPROXY_DATA_DIR": str(data_dir), "MEMPROXY_LOG_LEVEL": "warning",
                                      "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR)})
        try:
            report = asyncio.run(run(args, settings, data_dir))
            if args.postgres:
                report["postgresql"] = on_postgres(args, settings, data_dir / "postgresql")
        except (BenchError, KeyboardInterrupt) as exc:
            print(f"bench_recall: {'interrupted' if isinstance(exc, KeyboardInterrupt) else exc}", file=sys.stderr)
            return 1
    loads.append(os.getloadavg()[0])
    targets = print_report(report)
    if args.postgres:
        print("\non PostgreSQL:")
        print_report(report["postgresql"])
        targets += compare(report["sizes"], report["postgresql"]["sizes"])
    print(f"(1-min load average {loads[0]:.1f} at start, {loads[1]:.1f} at end, on {os.cpu_count()} CPUs)")
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "load": loads, **report, "targets": targets}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

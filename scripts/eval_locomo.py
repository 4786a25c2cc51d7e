"""Retrieval quality on LoCoMo: replay conversations through memproxy, then ask the questions.

Each conversation of ``../shared/eval/locomo-dev.json`` is replayed through a running memproxy
the way a chat client would talk to it: speaker A is the user (messages carry ``name``),
speaker B's recorded turn is the reply of a scripted upstream, every LoCoMo session is one
proxy session, and each request resends the session's history. Once indexing is done, every
question is asked in a fresh session as a dry run (``X-Memory-Write: off``), and the recalled
items are mapped back to LoCoMo turns (``dia_id``) by their text. Reported, per arm:

* evidence recall at a budget B: the share of a question's gold evidence turns whose text is
  in the block injected at ``X-Memory-Budget: B`` (250, 500, 1000, 2000 by default);
* recall@k: the share found in the first k items of the ranking (asked at budget 100000);

for the hybrid ranking and for BM25-only and dense-only ablations (memproxy restarted on the
same data with MEMPROXY_WEIGHT_DENSE=0 or MEMPROXY_WEIGHT_BM25=0; nothing is re-ingested).
An item counts only if its text is in the injected block, as a client receives it; answers
whose block exceeds the budget are counted (there must be none). Figures are means over
questions, over categories 1-4 and over all five (category 5 is LoCoMo's adversarial set:
questions about things that did not happen), for the whole set and per conversation.

Leave-one-conversation-out: with ``--grid``, every combination of the settings is one hybrid
arm; for each conversation, the arm that does best at 1000 tokens on the other conversations
is chosen, and its figures on the held-out one are reported. With ``--baseline-src`` another
checkout (say, main) serves a copy of the same store: its figures are reported too, and the
recall latency of both is timed one question at a time, in turn, in the same run::

    .venv/bin/python -m scripts.eval_locomo                    # 5 conversations, ~10 minutes
    .venv/bin/python -m scripts.eval_locomo --quick            # 1 conversation, 30 questions
    .venv/bin/python -m scripts.eval_locomo --json out.json    # per-question details too
    .venv/bin/python -m scripts.eval_locomo --arms hybrid --baseline-src /tmp/main \
        --grid MEMPROXY_WEIGHT_CONTEXT=0.3,0.4,0.5

The scripted upstream runs in this process; memproxy runs as a subprocess; both listen on
127.0.0.1 only and are stopped at the end. The dataset stays outside the repository.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import re
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from scripts.bench_overhead import BenchError, child_env, free_port, serving
from scripts.locomo_figures import print_report, print_tables
from tests.support.scripted_upstream import (
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    chat_completion,
)
from tests.support.sql import Target, query

ROOT = Path(__file__).resolve().parents[1]
DATASET = (ROOT / "../shared/eval/locomo-dev.json").resolve()
MODEL_DIR = (ROOT / "../shared/models/all-MiniLM-L6-v2").resolve()
MODEL = "gpt-4o-mini"
BUDGETS = (250, 500, 1000, 2000)
KS = (5, 10, 25)
RANKING_BUDGET = 100_000  # large enough that every candidate is rendered: the full ranking
ARMS = {
    "hybrid": {},
    "bm25-only": {"MEMPROXY_WEIGHT_DENSE": "0"},
    "dense-only": {"MEMPROXY_WEIGHT_BM25": "0"},
}
DRAGON = {5: 0.588, 10: 0.675, 25: 0.799}  # LoCoMo paper, DRAGON over turns, 10 conversations
TARGET_BUDGET, TARGET_RECALL = 1000, 0.85
GROUPS = {"cat 1-4": (1, 2, 3, 4), "all": (1, 2, 3, 4, 5)}
REPLY_HEADER = "x-eval-reply"  # not X-Memory-*: the proxy forwards it to the upstream
_EVIDENCE = re.compile(r"D:?(\d+):(\d+)")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")  # OpenAI's pattern for a message `name`


# -- the dataset ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    dia_id: str
    speaker: str
    text: str


@dataclass(frozen=True)
class Question:
    index: int
    text: str
    category: int
    evidence: tuple[str, ...]  # dia_ids that exist in the conversation


@dataclass
class Conversation:
    sample_id: str
    speaker_a: str
    speaker_b: str
    sessions: list[tuple[int, list[Turn]]]
    questions: list[Question]
    unknown_evidence: int = 0
    by_text: dict[str, set[str]] = field(default_factory=dict)
    turn_dia: dict[int, set[str]] = field(default_factory=dict)  # memproxy turn id -> dia_ids

    def __post_init__(self) -> None:
        for _, turns in self.sessions:
            for turn in turns:
                self.by_text.setdefault(turn.text.strip(), set()).add(turn.dia_id)

    def dia_ids(self, text: str) -> set[str]:
        """The turns a recalled item's text comes from (an item may be a chunk of a turn)."""
        text = text.strip()
        found = self.by_text.get(text)
        if found is None:
            found = {d for whole, ids in self.by_text.items() if text in whole for d in ids}
            self.by_text[text] = found
        return found


def turn_text(raw: dict[str, Any]) -> str:
    """A turn as the user typed it, with the caption of a shared photo."""
    caption = raw.get("blip_caption")
    return str(raw["text"]) + (f" [shares a photo: {caption}]" if caption else "")


def load(path: Path, conversations: int, questions: int | None) -> list[Conversation]:
    """The first `conversations` of the dataset (with at most `questions` each, spread out)."""
    loaded = []
    for raw in orjson.loads(path.read_bytes())[:conversations]:
        conv = raw["conversation"]
        numbers = sorted(int(m[1]) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
        sessions = [
            (n, [Turn(t["dia_id"], t["speaker"], turn_text(t)) for t in conv[f"session_{n}"]])
            for n in numbers
        ]
        known = {t.dia_id for _, turns in sessions for t in turns}
        asked, unknown = [], 0
        for i, qa in enumerate(raw["qa"]):
            cited = [f"D{s}:{t}" for e in qa["evidence"] for s, t in _EVIDENCE.findall(e)]
            unknown += sum(1 for d in cited if d not in known) + sum(
                1 for e in qa["evidence"] if not _EVIDENCE.search(e)
            )
            evidence = tuple(dict.fromkeys(d for d in cited if d in known))
            if evidence:
                asked.append(Question(i, qa["question"], int(qa["category"]), evidence))
        if questions is not None and len(asked) > questions:
            step = len(asked) / questions
            asked = [asked[int(i * step)] for i in range(questions)]
        loaded.append(Conversation(raw["sample_id"], conv["speaker_a"], conv["speaker_b"],
                                   sessions, asked, unknown))
    return loaded


# -- replaying conversations ------------------------------------------------------------------


class Replies:
    """The scripted upstream's replies, looked up by the key the client sends along.

    Conversations are replayed concurrently, so replies cannot be paired with requests by
    order: the upstream asks this object for every request (`respond_with`). Requests
    without the key (memproxy's own learning calls) go to `learning`, if set.
    """

    def __init__(
        self, upstream: ScriptedUpstream,
        learning: Callable[[Received], Reply | None] | None = None,
    ) -> None:
        self._texts: dict[str, str] = {}
        self.learning = learning
        upstream.respond_with(self)

    def expect(self, key: str, text: str) -> None:
        self._texts[key] = text

    def __call__(self, received: Received) -> Reply | None:
        key = received.headers.get(REPLY_HEADER)
        if key is not None:
            return JSONReply(chat_completion(self._texts.pop(key, "")))
        return self.learning(received) if self.learning is not None else None


def exchanges(conv: Conversation, turns: Sequence[Turn]) -> Iterator[tuple[list[dict[str, Any]], str]]:
    """(messages to send, speaker B's reply) for one session, as a client builds them.

    Speaker A's turns are user messages; the reply to each is speaker B's next turn, which
    the client then appends as an assistant message. A session opened by speaker B starts
    with that turn as an assistant message. A last message nobody answered is sent once
    more with an empty reply, so that it is stored too.
    """
    history: list[dict[str, Any]] = []
    unsent = False
    a_name, b_name = (_NAME_UNSAFE.sub("_", n) for n in (conv.speaker_a, conv.speaker_b))
    for turn in turns:
        if turn.speaker == conv.speaker_a:
            history.append({"role": "user", "name": a_name, "content": turn.text})
            unsent = True
            continue
        if unsent and history[-1]["role"] == "user":
            yield list(history), turn.text
            unsent = False
        else:
            unsent = True
        history.append({"role": "assistant", "name": b_name, "content": turn.text})
    if unsent:
        yield list(history), ""


async def ingest(
    clients: Sequence[httpx.AsyncClient], replies: Replies, conv: Conversation
) -> int:
    """Replay one conversation, session by session, its requests sent round robin to
    `clients` (replicas sharing one store, or one server); return the number of requests."""
    sent = 0
    for number, turns in conv.sessions:
        for messages, reply in exchanges(conv, turns):
            key = f"{conv.sample_id}/{number}/{sent}"
            replies.expect(key, reply)
            response = await clients[sent % len(clients)].post("/v1/chat/completions", headers={
                "X-Memory-User-Id": conv.sample_id,
                "X-Memory-Session-Id": f"{conv.sample_id}-session-{number}",
                REPLY_HEADER: key,
            }, json={"model": MODEL, "messages": messages})
            if response.status_code != 200:
                raise BenchError(f"replay of {key} got {response.status_code}: {response.text[:300]}")
            sent += 1
    return sent


def ingested_users(db_path: Path) -> set[str]:
    """Users that already have turns in the database."""
    if not db_path.exists():
        return set()
    with contextlib.closing(sqlite3.connect(f"{db_path.as_uri()}?mode=ro", uri=True)) as db:
        return {row[0] for row in db.execute("SELECT DISTINCT user_id FROM turns")}


def wait_indexed(db: Target, timeout: float = 1800) -> dict[str, int]:
    """Poll the database (the SQLite file, or the settings naming a PostgreSQL database)
    until no job is queued or running and nothing changes."""
    deadline = time.monotonic() + timeout
    last: tuple[int, ...] | None = None
    while time.monotonic() < deadline:
        time.sleep(0.5)
        jobs = dict(query(db, "SELECT status, COUNT(*) FROM jobs GROUP BY status"))
        turns, chunks = query(
            db, "SELECT (SELECT COUNT(*) FROM turns), (SELECT COUNT(*) FROM chunks)"
        )[0]
        state = (jobs.get("queued", 0), jobs.get("running", 0), turns, chunks)
        if state[:2] == (0, 0) and state == last:  # idle, and no reply was still being stored
            return {"turns": turns, "chunks": chunks, "dead_jobs": jobs.get("dead", 0)}
        last = state
    raise BenchError(f"indexing did not finish within {timeout:.0f} s")


# -- asking -----------------------------------------------------------------------------------


@dataclass
class Answer:
    """What one arm recalled for one question."""

    ranking: list[set[str]]  # dia_ids of each item of the full ranking, best first
    found: dict[int, set[str]]  # budget -> dia_ids in the block
    tokens: dict[int, int]
    items: dict[int, int]
    recall_ms: float  # at the default budget


async def dry_run(
    http: httpx.AsyncClient, user: str, session: str, text: str, budget: int
) -> dict[str, Any]:
    """What recall would inject for `text`, asked as `user` in a new `session` (a dry run
    that writes nothing); BenchError when it fails or memory degraded."""
    response = await http.post("/v1/chat/completions", headers={
        "X-Memory-User-Id": user, "X-Memory-Session-Id": session,
        "X-Memory-Dry-Run": "on", "X-Memory-Write": "off", "X-Memory-Budget": str(budget),
    }, json={"model": MODEL, "messages": [{"role": "user", "content": text}]})
    if response.status_code != 200:
        raise BenchError(f"question got {response.status_code}: {response.text[:300]}")
    result: dict[str, Any] = response.json()
    if result.get("errors"):
        raise BenchError(f"recall degraded: {result['errors']}")
    return result


async def ask(
    http: httpx.AsyncClient, conv: Conversation, question: Question, budgets: Sequence[int]
) -> Answer:
    """Dry runs of one question at the ranking budget and at every reported budget."""
    answer = Answer([], {}, {}, {}, 0.0)
    for budget in (RANKING_BUDGET, *budgets):
        result = await dry_run(http, conv.sample_id, f"{conv.sample_id}-question-{question.index}",
                               question.text, budget)
        turns = credited(conv, result["items"], result["block"])
        if budget == RANKING_BUDGET:
            answer.ranking = turns
        else:
            answer.found[budget] = set().union(*turns)
            answer.tokens[budget] = result["tokens"]
            answer.items[budget] = len(turns)
        if budget == TARGET_BUDGET or answer.recall_ms == 0.0:
            answer.recall_ms = float(result["recall_ms"])
    return answer


async def ask_all(
    ports: Sequence[int], conversations: Sequence[Conversation], budgets: Sequence[int],
    concurrency: int,
) -> dict[tuple[str, int], Answer]:
    """Every question of every conversation, `concurrency` at a time, spread round robin over
    the servers on `ports`."""
    gate = asyncio.Semaphore(concurrency)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(_client(port)) for port in ports]

        async def one(n: int, conv: Conversation, question: Question
                      ) -> tuple[tuple[str, int], Answer]:
            async with gate:
                http = clients[n % len(clients)]
                return (conv.sample_id, question.index), await ask(http, conv, question, budgets)

        asked = [(c, q) for c in conversations for q in c.questions]
        pairs = await asyncio.gather(*(one(n, c, q) for n, (c, q) in enumerate(asked)))
    return dict(pairs)


async def latency(
    ports: dict[str, int], conversations: Sequence[Conversation], samples: int
) -> dict[str, dict[str, float]]:
    """Recall latency (`recall_ms`) of `samples` questions asked one at a time, at the target
    budget, to every server in turn (the order alternates). Under concurrent questions the
    figures would measure this machine's queueing, not recall."""
    questions = [(c, q) for c in conversations for q in c.questions]
    chosen = questions[:: max(1, len(questions) // max(1, samples))][:samples]
    times: dict[str, list[float]] = {name: [] for name in ports}
    clients = {name: _client(port) for name, port in ports.items()}
    try:
        # Untimed first: each server loads every user's vectors on its first recall for them.
        warm_up = [(c, c.questions[0]) for c in conversations if c.questions]
        for i, (conv, question) in enumerate([*warm_up, *chosen]):
            order = list(ports) if i % 2 == 0 else list(ports)[::-1]
            for name in order:
                response = await clients[name].post("/v1/chat/completions", headers={
                    "X-Memory-User-Id": conv.sample_id, "X-Memory-Session-Id": "latency",
                    "X-Memory-Dry-Run": "on", "X-Memory-Write": "off",
                    "X-Memory-Budget": str(TARGET_BUDGET),
                }, json={"model": MODEL, "messages": [{"role": "user", "content": question.text}]})
                if i >= len(warm_up):
                    times[name].append(float(response.json()["recall_ms"]))
    finally:
        for client in clients.values():
            await client.aclose()
    return {name: {"n": len(v), "p50": percentile(v, 0.5) if v else 0.0,
                   "p95": percentile(v, 0.95) if v else 0.0, "mean": statistics.fmean(v) if v else 0.0}
            for name, v in times.items()}


def _client(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=120, trust_env=False,
        headers={"authorization": "Bearer sk-eval"},
    )


# -- scoring ----------------------------------------------------------------------------------


def credited(conv: Conversation, items: Sequence[dict[str, Any]], block: str) -> list[set[str]]:
    """The LoCoMo turns each item stands for, as a client sees them: an item whose text is
    not in the injected block (whitespace aside) stands for nothing. Facts and summaries are
    credited to the turns they were learned from."""
    shown = " ".join(block.split())
    return [
        conv.dia_ids(item["text"]).union(
            *(conv.turn_dia.get(t, set()) for t in item.get("turn_ids") or ())
        ) if " ".join(item["text"].split()) in shown else set()
        for item in items
    ]


def share(evidence: Iterable[str], found: set[str]) -> float:
    wanted = set(evidence)
    return len(wanted & found) / len(wanted)


def score(question: Question, answer: Answer, budgets: Sequence[int]) -> dict[str, float]:
    """The question's figures: recall@k over the ranking and evidence recall per budget."""
    figures = {
        f"@{k}": share(question.evidence, set().union(*answer.ranking[:k])) for k in KS
    }
    figures |= {f"B{b}": share(question.evidence, answer.found[b]) for b in budgets}
    return figures


def summarise(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, dict[str, float]]:
    """Mean of each figure per group (cat 1-4, all) and per category."""
    groups = {**GROUPS, **{f"cat {c}": (c,) for c in range(1, 6)}}
    out: dict[str, dict[str, float]] = {}
    for name, categories in groups.items():
        chosen = [r for r in rows if r["category"] in categories]
        if chosen:
            out[name] = {"n": len(chosen)} | {
                k: statistics.fmean(r["figures"][k] for r in chosen) for k in keys
            }
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


# -- the run ----------------------------------------------------------------------------------


def memproxy(port: int, upstream: str, data_dir: Path, logs: Path, arm: str,
             extra: dict[str, str], source: Path | None = None) -> contextlib.AbstractContextManager[int]:
    """memproxy serving `data_dir` on `port` with the arm's weights (from `source`, another
    checkout, when given: `-P` keeps this one off its import path)."""
    env = child_env(
        MEMPROXY_UPSTREAM_BASE_URL=upstream, MEMPROXY_DATA_DIR=str(data_dir),
        MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR), MEMPROXY_LOG_LEVEL="warning",
        MEMPROXY_SHUTDOWN_GRACE_SECONDS="5", LITELLM_LOCAL_MODEL_COST_MAP="True",
        # Turns only: learning stays off unless `extra` turns it on (eval_locomo_facts).
        **{"MEMPROXY_EXTRACT_EVERY": "0", "MEMPROXY_SUMMARY_EVERY": "0", **extra,
           **ARMS.get(arm, {})},
    )
    argv = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
    if source is not None:
        env["PYTHONPATH"] = str(source)
        argv.insert(1, "-P")
    name = "memproxy-" + _NAME_UNSAFE.sub("_", arm)
    return serving(name, argv, env, f"http://127.0.0.1:{port}/readyz", logs)


def configurations(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """arm name -> its settings: the hybrid ranking under every combination of the grid,
    then the ablations asked for."""
    axes = [[(name, v) for v in values.split(",")]
            for name, values in (pair.split("=", 1) for pair in args.grid)]
    out = {}
    for combo in itertools.product(*axes):
        label = ",".join(f"{n.removeprefix('MEMPROXY_').lower()}={v}" for n, v in combo)
        out[f"hybrid[{label}]" if label else "hybrid"] = dict(combo)
    return out | {arm: {} for arm in args.arms if arm != "hybrid"}


def evaluate(args: argparse.Namespace, data_dir: Path, logs: Path) -> dict[str, Any]:
    conversations = load(args.dataset, args.conversations, args.questions)
    timings: dict[str, float] = {}
    results: dict[str, Any] = {}
    arms = configurations(args)
    with ScriptedUpstream(keep_history=False) as upstream:
        replies = Replies(upstream)
        for n, (arm, settings) in enumerate(arms.items()):
            port = free_port()
            with memproxy(port, upstream.base_url, data_dir, logs, arm, {**args.env, **settings}):
                if n == 0:
                    started = time.perf_counter()
                    done = ingested_users(data_dir / "memproxy.db") if args.reuse else set()
                    todo = [c for c in conversations if c.sample_id not in done]
                    requests = asyncio.run(_ingest_all([port], replies, todo))
                    timings["replay_s"] = time.perf_counter() - started
                    stats = wait_indexed(data_dir / "memproxy.db")
                    timings["replay_and_index_s"] = time.perf_counter() - started
                    print(f"replayed {len(todo)} conversations ({requests} requests; "
                          f"{len(conversations) - len(todo)} reused); stored {stats}", file=sys.stderr)
                results[arm] = _asked(port, conversations, args, timings, arm)
        if args.baseline_src is not None:  # the same store, served by another checkout
            shutil.copytree(data_dir, logs / "baseline-data")
            port = free_port()
            with memproxy(port, upstream.base_url, logs / "baseline-data", logs, "baseline",
                          args.env, args.baseline_src.resolve()):
                results["baseline"] = _asked(port, conversations, args, timings, "baseline")
        timings_ms = asyncio.run(_paired_latency(args, upstream.base_url, data_dir, logs, conversations))
    return {"conversations": [c.sample_id for c in conversations], "timings": timings,
            "unknown_evidence": sum(c.unknown_evidence for c in conversations), "arms": results,
            "latency": timings_ms}


def _asked(port: int, conversations: Sequence[Conversation], args: argparse.Namespace,
           timings: dict[str, float], arm: str) -> dict[str, Any]:
    started = time.perf_counter()
    answers = asyncio.run(ask_all([port], conversations, args.budgets, args.concurrency))
    timings[f"questions_{arm}_s"] = time.perf_counter() - started
    print(f"{arm}: {len(answers)} questions in {timings[f'questions_{arm}_s']:.0f} s", file=sys.stderr)
    return collect(conversations, answers, args.budgets)


async def _paired_latency(args: argparse.Namespace, upstream: str, data_dir: Path, logs: Path,
                          conversations: Sequence[Conversation]) -> dict[str, dict[str, float]]:
    """Recall latency, one question at a time, of this checkout (defaults) and, with
    --baseline-src, of the baseline: both served at once and asked in turn (ABBA), so both see
    the same machine load."""
    servers = {"this": (data_dir, None)}
    if args.baseline_src is not None:
        servers["baseline"] = (logs / "baseline-data", args.baseline_src.resolve())
    with contextlib.ExitStack() as stack:
        ports = {}
        for name, (data, source) in servers.items():
            ports[name] = free_port()
            stack.enter_context(memproxy(ports[name], upstream, data, logs, f"latency-{name}",
                                         args.env, source))
        return await latency(ports, conversations, args.latency_samples)


async def _ingest_all(
    ports: Sequence[int], replies: Replies, conversations: Sequence[Conversation]
) -> int:
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(_client(port)) for port in ports]
        return sum(await asyncio.gather(*(ingest(clients, replies, c) for c in conversations)))


def collect(conversations: Sequence[Conversation], answers: dict[tuple[str, int], Answer],
            budgets: Sequence[int]) -> dict[str, Any]:
    """Per-question rows and their summary for one arm."""
    rows = []
    for conv in conversations:
        for q in conv.questions:
            answer = answers[conv.sample_id, q.index]
            ranks = {d: next((i + 1 for i, ids in enumerate(answer.ranking) if d in ids), None)
                     for d in q.evidence}
            rows.append({
                "sample_id": conv.sample_id, "index": q.index, "question": q.text,
                "category": q.category, "evidence": list(q.evidence), "evidence_rank": ranks,
                "figures": score(q, answer, budgets), "recall_ms": answer.recall_ms,
            })
    latencies = [a.recall_ms for a in answers.values()]
    over = sum(a.tokens[b] > b for a in answers.values() for b in budgets)
    return {
        "over_budget": over,
        "summary": summarise(rows, [f"@{k}" for k in KS] + [f"B{b}" for b in budgets]),
        "items": {str(b): statistics.fmean(a.items[b] for a in answers.values()) for b in budgets},
        "tokens": {str(b): statistics.fmean(a.tokens[b] for a in answers.values()) for b in budgets},
        "recall_ms": {"p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95)},
        "questions": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.eval_locomo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=5, help="how many conversations (default all 5)")
    parser.add_argument("--questions", type=int, help="at most this many questions per conversation")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="token budgets to report")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="rankings to evaluate (the first one also replays the conversations)")
    parser.add_argument("--quick", action="store_true", help="1 conversation, 30 questions")
    parser.add_argument("--concurrency", type=int, default=4, help="questions asked at once")
    parser.add_argument("--latency-samples", type=int, default=200,
                        help="questions asked one at a time afterwards to time recall")
    parser.add_argument("--grid", action="append", default=[], metavar="MEMPROXY_X=V1,V2",
                        help="hybrid settings to try (repeatable; every combination is one arm, "
                        "and leave-one-conversation-out picks among them)")
    parser.add_argument("--baseline-src", type=Path, metavar="DIR",
                        help="another checkout (say, main) to serve the same store too: its "
                        "figures, and recall latency of both timed in turn")
    parser.add_argument("--data-dir", type=Path, help="memproxy's data directory (kept); default a temporary one")
    parser.add_argument("--reuse", action="store_true",
                        help="with --data-dir: skip replaying conversations already stored there")
    parser.add_argument("--env", action="append", default=[], metavar="MEMPROXY_X=VALUE",
                        help="extra memproxy setting for every arm (repeatable)")
    parser.add_argument("--dataset", type=Path, default=DATASET, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write figures and per-question details")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.questions = 1, args.questions or 30
    if args.reuse and args.data_dir is None:
        parser.error("--reuse needs --data-dir")
    args.env = dict(item.split("=", 1) for item in args.env)
    if bad := [k for k in [*args.env, *(g.split("=")[0] for g in args.grid)]
               if not k.startswith("MEMPROXY_")]:
        parser.error(f"--env takes MEMPROXY_* settings only, got {bad}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memproxy-locomo-") as tmp:
        data_dir = args.data_dir.resolve() if args.data_dir else Path(tmp) / "data"
        try:
            run = evaluate(args, data_dir, Path(tmp))
        except (BenchError, KeyboardInterrupt) as exc:
            print(f"eval_locomo: {'interrupted' if isinstance(exc, KeyboardInterrupt) else exc}",
                  file=sys.stderr)
            return 1
    run["timings"]["wall_s"] = time.perf_counter() - started
    hybrid = {arm: r["questions"] for arm, r in run["arms"].items()
              if not arm.startswith(("bm25", "dense"))}
    print_tables(hybrid, [f"B{b}" for b in args.budgets], f"B{TARGET_BUDGET}")
    targets = print_report(run["arms"], args.budgets, KS, DRAGON, (TARGET_BUDGET, TARGET_RECALL))
    for name, t in run["latency"].items():
        line = (f"recall latency {name}: p50 {t['p50']:.1f} ms, p95 {t['p95']:.1f} ms, mean "
                f"{t['mean']:.1f} ms ({t['n']:.0f} questions one at a time, budget {TARGET_BUDGET})")
        targets.append(line)
        print(line)
    if {"this", "baseline"} <= set(run["latency"]):
        this, base = run["latency"]["this"], run["latency"]["baseline"]
        line = (f"recall latency this / baseline, same run: p50 {this['p50'] / base['p50']:.2f}, "
                f"mean {this['mean'] / base['mean']:.2f} (limit 1.10)")
        targets.append(line)
        print(line)
    print(f"conversations {', '.join(run['conversations'])}; evidence ids not in the "
          f"conversation (skipped): {run['unknown_evidence']}; wall time {run['timings']['wall_s']:.0f} s")
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
        args.json.write_bytes(orjson.dumps({"config": config, **run, "targets": targets},
                                           option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoCoMo with learned facts: does extraction raise evidence recall at small budgets?

The conversations are replayed through memproxy (as ``scripts.eval_locomo`` does) with fact
extraction after every reply (``MEMPROXY_EXTRACT_EVERY=1``, summaries off). The scripted
upstream plays the extraction model: each extraction prompt is answered with the dataset's
own ``observation`` facts whose evidence turns are among the prompt's NEW messages, speaker
A's name turned into "User" as the prompt asks, each citing the message numbers of its
evidence, with confidence 0.9 and importance 8 (`--keep-names`: the name stays, since
LoCoMo's questions name the speakers). memproxy then applies its own rules
(thresholds, grounding, dedup, supersede; and only what the user said: observations about
speaker B, who plays the assistant, are dropped). Every question is then asked as a dry run
twice on the same store: with the learned facts (facts + turns) and after deleting them
(turns alone). A fact is credited to its source turns. Reported: evidence recall at 250 /
500 / 1000 tokens per arm, and what extraction cost per replayed turn (extra upstream calls,
prompt and completion tokens counted with o200k_base)::

    .venv/bin/python -m scripts.eval_locomo_facts --quick    # 1 conversation, 30 questions
    .venv/bin/python -m scripts.eval_locomo_facts            # 5 conversations
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sqlite3
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from memory import encoding_for_model
from scripts.bench_overhead import BenchError, free_port
from scripts.eval_locomo import (
    _EVIDENCE,
    DATASET,
    Conversation,
    Replies,
    _ingest_all,
    ask_all,
    collect,
    load,
    memproxy,
    wait_indexed,
)
from tests.support.scripted_upstream import (
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    chat_completion,
)

BUDGETS = (250, 500, 1000)
EXTRACT = "You extract durable facts"
_MESSAGE = re.compile(r"^\[(\d+)\]( NEW)? \S+ (user|assistant)(?: \(([^)]*)\))?: (.*)$")


@dataclass
class Observation:
    speaker: str
    text: str
    evidence: set[str]


@dataclass
class Cost:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    offered: dict[str, int] = field(default_factory=lambda: {"speaker A": 0, "speaker B": 0})


class ObservationModel:
    """Answers memproxy's extraction prompts with the dataset's observations."""

    def __init__(
        self, conversations: Sequence[Conversation], raw: list[dict[str, Any]], *,
        keep_names: bool = False,
    ) -> None:
        self.conversations = list(conversations)
        self.keep_names = keep_names
        self.observations: dict[str, list[Observation]] = {}
        for conv, item in zip(conversations, raw, strict=True):
            found = []
            for session in item["observation"].values():
                for speaker, facts in session.items():
                    for text, evidence in facts:
                        cited = {f"D{s}:{t}" for s, t in _EVIDENCE.findall(str(evidence))}
                        found.append(Observation(speaker, text, cited))
            self.observations[conv.sample_id] = found
        self.encoding = encoding_for_model("gpt-4o-mini")  # o200k_base, offline
        self.cost = Cost()

    def __call__(self, received: Received) -> Reply | None:
        body = received.json if isinstance(received.json, dict) else {}
        messages = body.get("messages") or []
        if not messages or not str(messages[0].get("content", "")).startswith(EXTRACT):
            return None
        facts = self.answer(str(messages[-1]["content"]))
        text = orjson.dumps(facts).decode()
        self.cost.calls += 1
        self.cost.prompt_tokens += sum(
            len(self.encoding.encode(str(m.get("content", "")))) + 4 for m in messages
        )
        self.cost.completion_tokens += len(self.encoding.encode(text))
        return JSONReply(chat_completion(text))

    def answer(self, prompt: str) -> list[dict[str, Any]]:
        """The observations evidenced by the prompt's NEW messages, as extraction items."""
        new: dict[int, set[str]] = {}
        conv: Conversation | None = None
        for number, text in _new_messages(prompt):
            for candidate in ([conv] if conv else self.conversations):
                ids = candidate.dia_ids(text)
                if ids:
                    conv, new[number] = candidate, ids
                    break
        if conv is None:
            return []
        items = []
        for obs in self.observations[conv.sample_id]:
            turns = [n for n, ids in new.items() if ids & obs.evidence]
            if not turns:
                continue
            a = obs.speaker == conv.speaker_a
            self.cost.offered["speaker A" if a else "speaker B"] += 1
            text = obs.text if self.keep_names or not a else obs.text.replace(conv.speaker_a, "User")
            items.append({"fact": text, "category": "context", "confidence": 0.9,
                          "importance": 8, "updates_previous": None, "expires": None,
                          "turns": turns})
        return items


def _new_messages(prompt: str) -> list[tuple[int, str]]:
    messages: list[tuple[int, bool, list[str]]] = []
    for line in prompt.splitlines():
        match = _MESSAGE.match(line)
        if match:
            messages.append((int(match[1]), bool(match[2]), [match[5]]))
        elif messages and line.startswith("    "):
            messages[-1][2].append(line[4:])
    return [(n, "\n".join(parts)) for n, new, parts in messages if new]


def map_turns(db_path: Path, conversations: Sequence[Conversation]) -> int:
    """Fill each conversation's memproxy turn id -> dia_ids map; return the facts stored."""
    with contextlib.closing(sqlite3.connect(f"{db_path.as_uri()}?mode=ro", uri=True)) as db:
        by_user = {c.sample_id: c for c in conversations}
        for turn_id, user_id, content in db.execute("SELECT id, user_id, content FROM turns"):
            conv = by_user.get(user_id)
            if conv is not None:
                conv.turn_dia[int(turn_id)] = conv.dia_ids(content)
        query = "SELECT COUNT(*) FROM facts WHERE valid_to IS NULL"
        return int(db.execute(query).fetchone()[0])


def evaluate(args: argparse.Namespace, data_dir: Path, logs: Path) -> dict[str, Any]:
    conversations = load(args.dataset, args.conversations, args.questions)
    raw = orjson.loads(args.dataset.read_bytes())[: args.conversations]
    model = ObservationModel(conversations, raw, keep_names=args.keep_names)
    results: dict[str, Any] = {}
    learning = {"MEMPROXY_EXTRACT_EVERY": "1"}
    with ScriptedUpstream(keep_history=False) as upstream:
        replies = Replies(upstream, learning=model)
        port = free_port()
        with memproxy(port, upstream.base_url, data_dir, logs, "hybrid", learning):
            started = time.perf_counter()
            requests = asyncio.run(_ingest_all([port], replies, conversations))
            stats = wait_indexed(data_dir / "memproxy.db")
            ingest_s = time.perf_counter() - started
            facts = map_turns(data_dir / "memproxy.db", conversations)
            print(f"replayed {requests} requests in {ingest_s:.0f} s; stored {stats}; "
                  f"{facts} active facts", file=sys.stderr)
            answers = asyncio.run(ask_all([port], conversations, args.budgets, args.concurrency))
            results["facts + turns"] = collect(conversations, answers, args.budgets)
        with contextlib.closing(sqlite3.connect(data_dir / "memproxy.db")) as db, db:
            db.execute("DELETE FROM facts")
        with memproxy(port, upstream.base_url, data_dir, logs, "hybrid", {}):
            answers = asyncio.run(ask_all([port], conversations, args.budgets, args.concurrency))
            results["turns alone"] = collect(conversations, answers, args.budgets)
    turns = stats["turns"]
    cost = model.cost
    return {
        "conversations": [c.sample_id for c in conversations], "arms": results,
        "ingest": {"requests": requests, "turns": turns, "facts": facts, "seconds": ingest_s,
                   "extraction_calls": cost.calls, "observations_offered": cost.offered,
                   "calls_per_turn": cost.calls / turns,
                   "prompt_tokens_per_turn": cost.prompt_tokens / turns,
                   "completion_tokens_per_turn": cost.completion_tokens / turns},
    }


def report(run: dict[str, Any], budgets: Sequence[int]) -> None:
    keys = [f"B{b}" for b in budgets]
    print("\nevidence recall (share of a question's evidence turns in the block at budget n)")
    print(f"{'arm':14} {'group':8} {'n':>5} " + " ".join(f"{k:>6}" for k in keys))
    for arm, result in run["arms"].items():
        for group in ("cat 1-4", "all", *(f"cat {c}" for c in range(1, 6))):
            row = result["summary"].get(group)
            if row:
                print(f"{arm:14} {group:8} {row['n']:>5} " + " ".join(f"{row[k]:6.3f}" for k in keys))
    ingest = run["ingest"]
    print(f"\ningestion: {ingest['turns']} turns, {ingest['requests']} requests, "
          f"{ingest['extraction_calls']} extraction calls, {ingest['facts']} active facts "
          f"(observations offered: {ingest['observations_offered']})")
    print(f"extra per replayed turn: {ingest['calls_per_turn']:.2f} upstream calls, "
          f"{ingest['prompt_tokens_per_turn']:.0f} prompt + "
          f"{ingest['completion_tokens_per_turn']:.0f} completion tokens")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.eval_locomo_facts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--questions", type=int, help="at most this many questions per conversation")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--quick", action="store_true", help="1 conversation, 30 questions")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--keep-names", action="store_true",
                        help="facts keep speaker A's name instead of \"User\" (questions name them)")
    parser.add_argument("--dataset", type=Path, default=DATASET, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write figures and details")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.questions = 1, args.questions or 30
    with tempfile.TemporaryDirectory(prefix="memproxy-locomo-facts-") as tmp:
        try:
            run = evaluate(args, Path(tmp) / "data", Path(tmp))
        except (BenchError, KeyboardInterrupt) as exc:
            print(f"eval_locomo_facts: {exc or 'interrupted'}", file=sys.stderr)
            return 1
    report(run, args.budgets)
    if args.json:
        args.json.write_bytes(orjson.dumps(run, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

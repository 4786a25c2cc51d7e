"""Retrieval quality on BEAM: replay long working conversations through memproxy, then ask.

Each chat of ``../shared/eval/beam-dev/<n>/`` (BEAM 100K, read its README) is replayed through a
running memproxy as a chat client would: every batch is one session of one user (one user per
chat), each user message is sent with the session's history so far, and the recorded
assistant message is the reply of a scripted upstream. ``--replay import`` instead posts each
batch to ``/v1/memory/import`` as a conversation whose messages carry timestamps taken from
the batch's time anchor, so turns keep their dates. The generator's ``->->`` markers are
stripped from the text before it is sent (here only: memproxy never sees them).

Then every question is asked in a fresh session as a dry run (``X-Memory-Write: off``) at each
budget. A source message counts as recalled when the block holds one of its sentences (at
least MIN_SENTENCE characters, occurring in no other message of the chat; whitespace aside).
Reported: the mean per question over its source messages, per kind of question and overall;
recall per source role (over all source messages); items, tokens per item and the
assistant's share of the block's characters. Abstention questions have no sources and are
not scored. ::

    .venv/bin/python -m scripts.eval_beam --data-dir /tmp/beam --reuse     # 10 chats
    .venv/bin/python -m scripts.eval_beam --chats 1 2 --data-dir /tmp/beam --reuse
    .venv/bin/python -m scripts.eval_beam --data-dir /tmp/beam --reuse --json out.json

With ``--data-dir`` and ``--reuse``, chats already stored there are not replayed again, so a
change to recall only costs the questions (a change to what is stored needs a fresh
directory). The scripted upstream runs in this process, memproxy as a subprocess; both listen
on 127.0.0.1 only. The dataset stays outside the repository.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson

from scripts.bench_overhead import BenchError, free_port
from scripts.eval_locomo import (
    REPLY_HEADER,
    Replies,
    dry_run,
    ingested_users,
    memproxy,
    wait_indexed,
)
from tests.support.scripted_upstream import ScriptedUpstream

ROOT = Path(__file__).resolve().parents[1]
DATASET = (ROOT / "../shared/eval/beam-dev").resolve()
MODEL = "gpt-4o-mini"
BUDGETS = (1000, 2000)
TARGET_BUDGET, TARGET = 1000, 0.70
MIN_SENTENCE = 40
# The generator's marker at the end of a message (` ->-> 1,14`): not part of what was said.
_MARKER = re.compile(r"\s*->->\s*[\d,\s]*$")
# A sentence ends at . ! ? followed by space, or at a line break.
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
SPEAKER_LINE = re.compile(r"^(user|assistant): ")
SECONDS_A_MESSAGE = 60  # imported messages of one batch: a minute apart, from its anchor


# -- the dataset ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    id: int
    role: str
    text: str


@dataclass(frozen=True)
class Question:
    kind: str
    index: int
    text: str
    sources: tuple[int, ...]  # message ids that hold the answer


@dataclass
class Chat:
    name: str
    batches: list[tuple[float | None, list[Message]]]  # (time anchor, messages)
    questions: list[Question]
    keys: dict[int, list[str]] = field(default_factory=dict)  # id -> its unique sentences

    @property
    def user(self) -> str:
        return f"beam-{self.name}"

    def messages(self) -> Iterator[Message]:
        for _, messages in self.batches:
            yield from messages


def clean(text: str) -> str:
    """A message as it was said: without the generator's marker."""
    return _MARKER.sub("", text).strip()


def squash(text: str) -> str:
    """Whitespace made single spaces: the block indents continuation lines."""
    return " ".join(text.split())


def sentences(text: str) -> list[str]:
    """The sentences of a text of at least MIN_SENTENCE characters, whitespace squashed."""
    return [s for part in _SENTENCE.split(text) if len(s := squash(part)) >= MIN_SENTENCE]


def unique_sentences(messages: Sequence[Message]) -> dict[int, list[str]]:
    """Each message's sentences that occur in no other message (its keys)."""
    squashed = {m.id: squash(m.text) for m in messages}
    return {
        m.id: [s for s in sentences(m.text)
               if not any(s in other for i, other in squashed.items() if i != m.id)]
        for m in messages
    }


def source_ids(raw: Any) -> tuple[int, ...]:
    """A question's source messages: a list of ids, a list of lists, or a dict of lists (a
    knowledge update's `updated_info` is what must be recalled)."""
    if isinstance(raw, Mapping):
        raw = raw["updated_info"] if "updated_info" in raw else list(raw.values())
    flat: list[int] = []
    for item in raw or ():
        flat += source_ids(item) if isinstance(item, (list, Mapping)) else [int(item)]
    return tuple(dict.fromkeys(flat))


def anchor(raw: Mapping[str, Any] | None) -> float | None:
    """`March-15-2024` as a UNIX time (UTC midnight), or None."""
    value = (raw or {}).get("time_anchor")
    if not isinstance(value, str):
        return None
    with contextlib.suppress(ValueError):
        return datetime.strptime(value, "%B-%d-%Y").replace(tzinfo=UTC).timestamp()
    return None


def load(folder: Path) -> Chat:
    batches = []
    for batch in orjson.loads((folder / "chat.json").read_bytes()):
        raw = [m for turn in batch["turns"] for m in turn]
        when = anchor(batch) or next((a for m in raw if (a := anchor(m)) is not None), None)
        batches.append((when, [Message(int(m["id"]), m["role"], clean(m["content"]))
                               for m in raw if clean(m["content"])]))
    questions = [
        Question(kind, i, q["question"], source_ids(q.get("source_chat_ids")))
        for kind, listed in orjson.loads((folder / "probing_questions.json").read_bytes()).items()
        for i, q in enumerate(listed)
    ]
    chat = Chat(folder.name, batches, [q for q in questions if q.sources])
    chat.keys = unique_sentences(list(chat.messages()))
    return chat


# -- replaying --------------------------------------------------------------------------------


def exchanges(messages: Sequence[Message]) -> Iterator[tuple[list[dict[str, str]], str]]:
    """(messages to send, the reply) for one session, as a client builds them: each user
    message is sent with the history; the assistant message after it is the reply. A last
    user message nobody answered is sent with an empty reply, so it is stored too."""
    history: list[dict[str, str]] = []
    unsent = False
    for message in messages:
        if message.role == "user":
            history.append({"role": "user", "content": message.text})
            unsent = True
            continue
        if unsent:
            yield list(history), message.text
            unsent = False
        history.append({"role": "assistant", "content": message.text})
    if unsent:
        yield list(history), ""


async def replay(http: httpx.AsyncClient, replies: Replies, chat: Chat) -> int:
    sent = 0
    for number, (_, messages) in enumerate(chat.batches, 1):
        for history, reply in exchanges(messages):
            key = f"{chat.user}/{number}/{sent}"
            replies.expect(key, reply)
            response = await http.post("/v1/chat/completions", headers={
                "X-Memory-User-Id": chat.user, "X-Memory-Session-Id": f"{chat.user}-{number}",
                REPLY_HEADER: key,
            }, json={"model": MODEL, "messages": history})
            if response.status_code != 200:
                raise BenchError(f"replay of {key} got {response.status_code}: {response.text[:300]}")
            sent += 1
    return sent


def conversations(chat: Chat) -> list[dict[str, Any]]:
    """The chat's batches as import records, each message timestamped from its batch's
    anchor (a batch without one goes a day after the one before)."""
    records, when = [], 0.0
    for number, (at, messages) in enumerate(chat.batches, 1):
        when = at if at is not None else when + 86400.0
        records.append({"session_id": f"{chat.user}-{number}", "messages": [
            {"role": m.role, "content": m.text, "timestamp": when + i * SECONDS_A_MESSAGE}
            for i, m in enumerate(messages)
        ]})
    return records


async def import_chat(http: httpx.AsyncClient, chat: Chat) -> int:
    body = b"\n".join(orjson.dumps(r) for r in conversations(chat))
    response = await http.post("/v1/memory/import", content=body, headers={
        "X-Memory-User-Id": chat.user, "content-type": "application/x-ndjson",
    })
    if response.status_code != 200:
        raise BenchError(f"import of {chat.user} got {response.status_code}: {response.text[:300]}")
    return len(chat.batches)


# -- asking and scoring -----------------------------------------------------------------------


@dataclass
class Answer:
    found: dict[int, set[int]] = field(default_factory=dict)  # budget -> source ids recalled
    tokens: dict[int, int] = field(default_factory=dict)
    items: dict[int, int] = field(default_factory=dict)
    assistant_chars: dict[int, int] = field(default_factory=dict)
    chars: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, str] = field(default_factory=dict)


def recalled(block: str, keys: Mapping[int, Sequence[str]], wanted: Iterable[int]) -> set[int]:
    """The messages of `wanted` that `block` holds one of the key sentences of."""
    shown = squash(block)
    return {i for i in wanted if any(s in shown for s in keys.get(i, ()))}


def speaker_chars(block: str) -> dict[str, int]:
    """Characters of the block's turn lines per speaker (continuation lines included)."""
    out: dict[str, int] = {}
    speaker = None
    for line in block.splitlines():
        if match := SPEAKER_LINE.match(line):
            speaker = match[1]
        elif not line.startswith("  "):
            speaker = None
        if speaker is not None:
            out[speaker] = out.get(speaker, 0) + len(line.strip())
    return out


async def ask(http: httpx.AsyncClient, chat: Chat, question: Question,
              budgets: Sequence[int]) -> Answer:
    answer = Answer()
    for budget in budgets:
        result = await dry_run(http, chat.user, f"{chat.user}-q-{question.kind}-{question.index}",
                               question.text, budget)
        block = result["block"]
        answer.found[budget] = recalled(block, chat.keys, question.sources)
        answer.tokens[budget], answer.items[budget] = result["tokens"], len(result["items"])
        chars = speaker_chars(block)
        answer.assistant_chars[budget] = chars.get("assistant", 0)
        answer.chars[budget] = sum(chars.values())
        answer.blocks[budget] = block
    return answer


def scorable(chat: Chat, question: Question) -> tuple[int, ...]:
    """The sources that can be found at all: those with a key sentence."""
    return tuple(i for i in question.sources if chat.keys.get(i))


def summarise(chats: Sequence[Chat], answers: Mapping[tuple[str, str, int], Answer],
              budgets: Sequence[int]) -> dict[str, Any]:
    """Mean per question (per kind, overall), recall per source role, and the block's
    shape, per budget; `rows` holds every question's figures."""
    rows = []
    by_role: dict[int, dict[str, list[float]]] = {b: {} for b in budgets}
    for chat in chats:
        role_of = {m.id: m.role for m in chat.messages()}
        for q in chat.questions:
            sources = scorable(chat, q)
            if not sources:
                continue
            answer = answers[chat.name, q.kind, q.index]
            row: dict[str, Any] = {"chat": chat.name, "kind": q.kind, "index": q.index,
                                   "question": q.text, "sources": list(sources)}
            for b in budgets:
                row[f"B{b}"] = len(answer.found[b]) / len(sources)
                row[f"found{b}"] = sorted(answer.found[b])
                for i in sources:
                    by_role[b].setdefault(role_of[i], []).append(float(i in answer.found[b]))
            rows.append(row)
    summary: dict[str, Any] = {}
    for b in budgets:
        done = list(answers.values())
        kinds = sorted({r["kind"] for r in rows})
        chars = sum(a.chars[b] for a in done)
        summary[str(b)] = {
            "overall": statistics.fmean(r[f"B{b}"] for r in rows),
            "kinds": {k: statistics.fmean(r[f"B{b}"] for r in rows if r["kind"] == k) for k in kinds},
            "roles": {r: statistics.fmean(v) for r, v in by_role[b].items()},
            "items": statistics.fmean(a.items[b] for a in done),
            "tokens_per_item": sum(a.tokens[b] for a in done) / max(1, sum(a.items[b] for a in done)),
            "assistant_share": sum(a.assistant_chars[b] for a in done) / chars if chars else 0.0,
            "over_budget": sum(a.tokens[b] > b for a in done),
        }
    return {"questions": len(rows), "summary": summary, "rows": rows}


def report(result: Mapping[str, Any], budgets: Sequence[int]) -> list[str]:
    """The figures as lines of text."""
    summary = result["summary"]
    kinds = list(summary[str(budgets[0])]["kinds"])
    lines = [f"{'kind':<26}" + "".join(f"{'B' + str(b):>8}" for b in budgets)]
    for kind in kinds:
        lines.append(f"{kind:<26}" + "".join(f"{summary[str(b)]['kinds'][kind]:>8.3f}" for b in budgets))
    lines.append(f"{'overall (mean per question)':<26}"
                 + "".join(f"{summary[str(b)]['overall']:>8.3f}" for b in budgets))
    for role in ("user", "assistant"):
        lines.append(f"{'source said by ' + role:<26}"
                     + "".join(f"{summary[str(b)]['roles'].get(role, 0.0):>8.3f}" for b in budgets))
    for key, label in (("items", "items in the block"), ("tokens_per_item", "tokens per item"),
                       ("assistant_share", "assistant share of block"),
                       ("over_budget", "blocks over budget")):
        lines.append(f"{label:<26}" + "".join(f"{summary[str(b)][key]:>8.2f}" for b in budgets))
    lines.append(f"{result['questions']} questions with sources; target at {TARGET_BUDGET} "
                 f"tokens: {TARGET:.2f}")
    return lines


# -- the run ----------------------------------------------------------------------------------


def client(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, trust_env=False,
                             headers={"authorization": "Bearer sk-eval"})


async def ingest(port: int, replies: Replies, chats: Sequence[Chat], how: str) -> int:
    async with client(port) as http:
        if how == "import":
            return sum(await asyncio.gather(*(import_chat(http, c) for c in chats)))
        return sum(await asyncio.gather(*(replay(http, replies, c) for c in chats)))


async def ask_all(port: int, chats: Sequence[Chat], budgets: Sequence[int],
                  concurrency: int) -> dict[tuple[str, str, int], Answer]:
    gate = asyncio.Semaphore(concurrency)
    async with client(port) as http:
        async def one(chat: Chat, q: Question) -> tuple[tuple[str, str, int], Answer]:
            async with gate:
                return (chat.name, q.kind, q.index), await ask(http, chat, q, budgets)

        pairs = await asyncio.gather(*(one(c, q) for c in chats for q in c.questions))
    return dict(pairs)


def evaluate(args: argparse.Namespace, data_dir: Path, logs: Path) -> dict[str, Any]:
    chats = [load(args.dataset / str(n)) for n in args.chats]
    with ScriptedUpstream(keep_history=False) as upstream:
        replies = Replies(upstream)
        port = free_port()
        with memproxy(port, upstream.base_url, data_dir, logs, "beam", args.env):
            started = time.perf_counter()
            done = ingested_users(data_dir / "memproxy.db") if args.reuse else set()
            todo = [c for c in chats if c.user not in done]
            sent = asyncio.run(ingest(port, replies, todo, args.replay))
            stats = wait_indexed(data_dir / "memproxy.db")
            print(f"ingested {len(todo)} chats ({sent} requests, {len(chats) - len(todo)} "
                  f"reused) in {time.perf_counter() - started:.0f} s; stored {stats}", file=sys.stderr)
            started = time.perf_counter()
            answers = asyncio.run(ask_all(port, chats, args.budgets, args.concurrency))
            print(f"asked {len(answers)} questions in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr)
    result = summarise(chats, answers, args.budgets)
    unscorable = sum(len(q.sources) - len(scorable(c, q)) for c in chats for q in c.questions)
    result |= {"chats": [c.name for c in chats], "unscorable_sources": unscorable}
    if args.blocks:
        result["blocks"] = {f"{c}/{k}/{i}": a.blocks for (c, k, i), a in answers.items()}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.eval_beam", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, nargs="+", default=list(range(1, 11)),
                        help="which chats of the dataset (default 1-10)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--replay", choices=("chat", "import"), default="chat",
                        help="chat: as a client sends it (default); import: timestamped "
                        "conversations through /v1/memory/import")
    parser.add_argument("--concurrency", type=int, default=4, help="questions asked at once")
    parser.add_argument("--data-dir", type=Path, help="memproxy's data directory (kept)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --data-dir: skip chats already stored there")
    parser.add_argument("--env", action="append", default=[], metavar="MEMPROXY_X=VALUE",
                        help="extra memproxy setting (repeatable)")
    parser.add_argument("--dataset", type=Path, default=DATASET, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write figures and per-question rows")
    parser.add_argument("--blocks", action="store_true", help="with --json: the blocks too")
    args = parser.parse_args(argv)
    if args.reuse and args.data_dir is None:
        parser.error("--reuse needs --data-dir")
    args.env = dict(item.split("=", 1) for item in args.env)
    if bad := [k for k in args.env if not k.startswith("MEMPROXY_")]:
        parser.error(f"--env takes MEMPROXY_* settings only, got {bad}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="memproxy-beam-") as tmp:
        data_dir = args.data_dir.resolve() if args.data_dir else Path(tmp) / "data"
        try:
            result = evaluate(args, data_dir, Path(tmp))
        except (BenchError, KeyboardInterrupt) as exc:
            print(f"eval_beam: {'interrupted' if isinstance(exc, KeyboardInterrupt) else exc}",
                  file=sys.stderr)
            return 1
    print("\n".join(report(result, args.budgets)))
    print(f"chats {', '.join(result['chats'])}; sources without a unique sentence "
          f"(never found): {result['unscorable_sources']}")
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())

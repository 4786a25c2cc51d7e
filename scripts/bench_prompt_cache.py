"""What memory costs in input tokens once provider prompt caches are counted.

A user's memory is imported through ``/v1/memory/import`` (LoCoMo dev conversations, speaker A
as the user, at most ``--turns`` turns), then multi-turn sessions are run through memproxy the
way a chat client runs them: every request resends the history. Two kinds of session:

* ``qa``: the questions of the conversations' QA lists in order, each answered with a
  ~150-token scripted reply;
* ``hopping`` (topic-hopping): one question of each dev conversation in turn, so every
  request asks about another thing (and most about conversations the imported memory does
  not hold), each answered in 10-20 tokens.

Each session runs with a ~1.2k-token and with a ~12k-token system prompt, in every mode:

* ``none``: ``X-Memory: off``, the cost every other mode is divided by;
* ``fresh``: one newly recalled block per request, in the system prompt (the old default);
* ``fresh-last-user``: the same, placed right before the last user message;
* ``stable``: stable injection (the default): earlier blocks stay where they were, a
  request adds only new items relevant enough (MEMPROXY_MEMORY_DELTA_RELEVANCE);
* ``fresh-write-off``, ``stable-write-off``: the same with ``X-Memory-Write: off`` (stable
  injection then keeps the session's blocks in the process);
* the floor, priced rather than run: the ``stable`` sessions' prompts with the first block
  only (every later block taken out), the least a session with memory can cost.

``--today`` runs the rules from before: no relevance threshold, no kept blocks with writing
off (so a write-off request gets a new block each time).

Every request the upstream receives is tokenised (o200k_base; each message or content block
a segment of its own) and compared with the session's earlier requests:

* OpenAI (chat completions): the prefix shared with the previous request is read from the
  cache when it is at least 1024 tokens, in steps of 128 tokens, at 10 % of the price;
* Anthropic (``/v1/messages``, the client marks the end of the system prompt and its last
  user message with ``cache_control``): the longest prefix ending at an earlier request's
  breakpoint that this request repeats is read at 10 %; the rest up to its own last
  breakpoint is written at 125 % (prefixes of 1024+ tokens only); anything after at 100 %.

Each memory mode has a user of its own (the same import), so no mode recalls another's
sessions. Printed per kind of session: each mode's cost against no memory and (in brackets)
against the floor, the tokens injected per request (the new block only), and for each
question whose evidence turns were imported, the share of them anywhere in its prompt (in
stable injection an earlier block of the session may hold it; scripts/eval_locomo.py asks its
questions in fresh sessions, where both modes inject the same block)::

    .venv/bin/python -m scripts.bench_prompt_cache              # ~15 minutes
    .venv/bin/python -m scripts.bench_prompt_cache --today      # the rules before, same figures
    .venv/bin/python -m scripts.bench_prompt_cache --kinds hopping --modes stable stable-write-off
    .venv/bin/python -m scripts.bench_prompt_cache --stable-share 1   # no cap
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from memory import encoding_for_model
from scripts.bench_overhead import BenchError, child_env, free_port, serving
from scripts.eval_locomo import DATASET, MODEL_DIR, Conversation, exchanges, load, wait_indexed
from tests.support.formats import message_object
from tests.support.scripted_upstream import (
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    chat_completion,
)

KEY_HEADER = "x-bench-key"  # not X-Memory-*: memproxy forwards it to the upstream
MODES: dict[str, dict[str, str]] = {
    "none": {"X-Memory": "off"},
    "fresh": {"X-Memory-Injection": "fresh"},
    "fresh-last-user": {"X-Memory-Injection": "fresh", "X-Memory-Placement": "last_user"},
    "stable": {"X-Memory-Injection": "stable"},
    "fresh-write-off": {"X-Memory-Injection": "fresh", "X-Memory-Write": "off"},
    "stable-write-off": {"X-Memory-Injection": "stable", "X-Memory-Write": "off"},
}
FLOOR = "floor"  # stable's sessions with the first block only (priced, not run)
SYSTEM_TOKENS = {"short": 1200, "long": 12000}
GOALS = {"short": 2.0, "long": 1.15}  # the topic-hopping session, OpenAI's rule (issue 26)
KINDS = ("qa", "hopping")
CACHE_READ, CACHE_WRITE = 0.1, 1.25
MIN_CACHED, STEP = 1024, 128
FORMATS = ("chat", "messages")
MODEL = "gpt-4o"  # tokenised with its encoding, o200k_base
FILLER = (
    "Here is what I found, with the reasoning behind it so you can check each step. "
    "The details come from what you told me before; if anything changed since, say so and "
    "I will take it into account. Otherwise this should be accurate, and I can go into "
    "more depth on any part of it, suggest next steps, or compare it with alternatives. "
    "Let me know which of these would help most, and whether you want a shorter summary."
)


def system_prompt(tokens: int) -> str:
    """A deterministic system prompt of about `tokens` tokens (numbered house rules)."""
    rules: list[str] = ["You are a helpful assistant for a small team. Follow these house rules."]
    n = used = 0
    while used < tokens:
        n += 1
        used += len(encoding_for_model(MODEL).encode(rules[-1])) + 1
        rules.append(f"Rule {n}: when a question touches topic {n} (planning, travel, family, "
                     f"hobbies or work item {n * 7 % 101}), answer plainly, cite what the user "
                     f"said before, and keep the reply under {120 + n % 5 * 20} words.")
    return "\n".join(rules)


def reply_text(question: str) -> str:
    """The scripted assistant's answer: about 150 tokens."""
    return f"About \u201c{question}\u201d: {FILLER} {FILLER}"


def short_reply(question: str) -> str:
    """A topic-hopping session's answer: 10-20 tokens."""
    return f"In short, about {' '.join(question.split()[:6]).rstrip('?')}: yes, noted."


# -- the prefix each request shares with earlier ones, and what it costs -----------------


@dataclass(frozen=True)
class Prompt:
    """A request as tokens: the segments' token ids joined, and where its breakpoints end."""

    tokens: list[int]
    breakpoints: list[int]


def tokenise(segments: Sequence[tuple[str, bool]]) -> Prompt:
    """Segments (text, ends at a cache_control breakpoint) as one token sequence."""
    encoding = encoding_for_model(MODEL)
    tokens: list[int] = []
    breakpoints: list[int] = []
    for text, breakpoint in segments:
        tokens += encoding.encode(text, disallowed_special=())
        if breakpoint:
            breakpoints.append(len(tokens))
    return Prompt(tokens, breakpoints)


def chat_segments(body: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """One segment per message: its role, then its text."""
    return [(f"<|{m['role']}|>{_text(m.get('content'))}<|end|>", False) for m in body["messages"]]


def messages_segments(body: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """The system blocks, then each message's role and content blocks."""
    segments: list[tuple[str, bool]] = []
    system = body.get("system")
    for block in system if isinstance(system, list) else [{"text": system or ""}]:
        segments.append((block.get("text", ""), bool(block.get("cache_control"))))
    for message in body["messages"]:
        segments.append((f"<|{message['role']}|>", False))
        content = message["content"]
        for block in content if isinstance(content, list) else [{"text": content}]:
            segments.append((block.get("text", ""), bool(block.get("cache_control"))))
    return segments


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def shared(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def openai_cost(session: Sequence[Prompt]) -> float:
    """Input cost of a session in full-price tokens under OpenAI's prefix rule."""
    cost = 0.0
    for previous, prompt in zip([None, *session], session, strict=False):
        common = shared(previous.tokens, prompt.tokens) if previous is not None else 0
        cached = common // STEP * STEP if common >= MIN_CACHED else 0
        cost += len(prompt.tokens) - cached + CACHE_READ * cached
    return cost


def anthropic_cost(session: Sequence[Prompt]) -> float:
    """Input cost of a session in full-price tokens with Anthropic's breakpoints."""
    cost = 0.0
    written: list[tuple[Prompt, int]] = []  # (request, breakpoint) prefixes in the cache
    for prompt in session:
        read = max((end for earlier, end in written
                    if end <= len(prompt.tokens) and shared(earlier.tokens, prompt.tokens) >= end),
                   default=0)
        last = max(prompt.breakpoints, default=0)
        write = last - read if last >= MIN_CACHED and last > read else 0
        cost += CACHE_READ * read + CACHE_WRITE * write + (len(prompt.tokens) - read - write)
        written += [(prompt, end) for end in prompt.breakpoints if end >= MIN_CACHED]
    return cost


# -- running the sessions ------------------------------------------------------------------


class Upstream:
    """The scripted upstream's replies, and every request it received, by the bench's key."""

    def __init__(self, upstream: ScriptedUpstream) -> None:
        self.received: dict[str, dict[str, Any]] = {}
        self.answers: dict[str, str] = {}
        upstream.respond_with(self)

    def __call__(self, received: Received) -> Reply | None:
        key = received.headers.get(KEY_HEADER)
        if key is None:
            return None
        self.received[key] = received.json
        text = self.answers.pop(key, "")
        if received.path.endswith("/messages"):
            return JSONReply(message_object(text))
        return JSONReply(chat_completion(text))


def import_records(conversations: Sequence[Conversation], turns: int) -> tuple[bytes, set[str]]:
    """JSON Lines of OpenAI-format conversations (one per LoCoMo session), `turns` at most,
    and the texts of the turns they hold."""
    lines: list[bytes] = []
    texts: set[str] = set()
    left = turns
    for conv in conversations:
        for number, session in conv.sessions:
            if left <= 0:
                return b"\n".join(lines), texts
            messages: list[dict[str, Any]] = []
            for sent, reply in exchanges(conv, session[:left]):
                messages = [*sent, {"role": "assistant", "content": reply}] if reply else sent
            left -= len(messages)
            texts.update(m["content"] for m in messages)
            if messages:
                lines.append(orjson.dumps({"session_id": f"{conv.sample_id}-{number}",
                                           "messages": messages}))
    return b"\n".join(lines), texts


@dataclass(frozen=True)
class Asked:
    """A question and the texts of its evidence turns that were imported."""

    text: str
    evidence: tuple[str, ...]


def questions(
    conversations: Sequence[Conversation], imported: set[str], *, hopping: bool = False
) -> Iterator[Asked]:
    """The QA questions of the conversations, in order, round and round; `hopping`: one
    of each conversation in turn, so every question is about another thing (and most are
    about conversations the user's memory does not hold)."""
    lists = []
    for conv in conversations:
        turns = {t.dia_id: t.text for _, session in conv.sessions for t in session}
        lists.append([Asked(q.text, tuple(turns[d] for d in q.evidence if turns[d] in imported))
                      for q in conv.questions])
    asked = ([q for row in zip(*lists, strict=False) for q in row] if hopping
             else [q for row in lists for q in row])
    while True:
        yield from asked


def without_later_blocks(fmt: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """`body` as it would be with the session's first block only (the floor): the blocks
    placed before later user messages taken out."""
    marked = "<memory>"
    if fmt == "chat":
        return {**body, "messages": [
            m for m in body["messages"]
            if not (m["role"] == "system" and _text(m.get("content")).startswith(marked))]}
    messages = []
    users = 0
    for message in body["messages"]:
        content = message["content"]
        if message["role"] == "user" and isinstance(content, list):
            users += 1
            if users > 1:
                content = [b for b in content if not str(b.get("text", "")).startswith(marked)]
        messages.append({**message, "content": content})
    return {**body, "messages": messages}


def body_for(fmt: str, system: str, history: Sequence[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The path and body a client sends: Messages marks the system prompt and the last
    user message as breakpoints, as a client caching its conversation does."""
    if fmt == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "system", "content": system}, *history]}
    messages: list[dict[str, Any]] = [{"role": m["role"], "content": m["content"]} for m in history]
    messages[-1] = {"role": "user", "content": [
        {"type": "text", "text": messages[-1]["content"], "cache_control": {"type": "ephemeral"}}]}
    return "/v1/messages", {"model": "claude-bench", "max_tokens": 512, "messages": messages,
                            "system": [{"type": "text", "text": system,
                                        "cache_control": {"type": "ephemeral"}}]}


@dataclass
class Session:
    """What one session's requests showed and cost."""

    prompts: list[Prompt]
    injected: list[int]  # tokens memory injected into each (the new block only)
    found: list[float]  # per question with imported evidence: the share of it in the prompt
    floor: list[Prompt]  # the prompts with the session's first block only


async def run_session(
    http: httpx.AsyncClient, upstream: Upstream, *, key: str, headers: Mapping[str, str],
    fmt: str, system: str, asked: Sequence[Asked], short: bool = False,
) -> Session:
    """One session of len(asked) requests (`short`: replies of 10-20 tokens)."""
    history: list[dict[str, Any]] = []
    prompts: list[Prompt] = []
    floor: list[Prompt] = []
    injected: list[int] = []
    found: list[float] = []
    for n, (question, evidence) in enumerate((a.text, a.evidence) for a in asked):
        history.append({"role": "user", "content": question})
        request_key = f"{key}/{n}"
        answer = short_reply(question) if short else reply_text(question)
        upstream.answers[request_key] = answer
        path, body = body_for(fmt, system, history)
        response = await http.post(path, json=body, headers={
            **headers, "X-Memory-Session-Id": key, KEY_HEADER: request_key})
        if response.status_code != 200:
            raise BenchError(f"{request_key}: {response.status_code} {response.text[:300]}")
        received = upstream.received.pop(request_key)
        segments = chat_segments(received) if fmt == "chat" else messages_segments(received)
        prompts.append(tokenise(segments))
        bare = without_later_blocks(fmt, received)
        floor.append(tokenise(chat_segments(bare) if fmt == "chat" else messages_segments(bare)))
        shown = "".join(text for text, _ in segments)
        if evidence:
            found.append(sum(text.strip() in shown for text in evidence) / len(evidence))
        injected.append(int(response.headers.get("x-memory-injected-tokens", 0)))
        history.append({"role": "assistant", "content": answer})
    return Session(prompts, injected, found, floor)


def price(fmt: str, prompts: Sequence[Prompt]) -> float:
    """A session's input cost under the format's provider rule."""
    return openai_cost(prompts) if fmt == "chat" else anthropic_cost(prompts)


async def bench(port: int, upstream: Upstream, args: argparse.Namespace,
                conversations: Sequence[Conversation], db_path: Path) -> dict[str, Any]:
    records, imported = import_records(conversations, args.turns)
    modes = {m: MODES[m] for m in ["none", *args.modes]}
    users = {(mode, fmt): f"bench-{mode}-{fmt}" for mode in modes if mode != "none" for fmt in FORMATS}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                 trust_env=False) as http:
        for user in users.values():
            reply = await http.post("/v1/memory/import", content=records,
                                    headers={"X-Memory-User-Id": user})
            if reply.status_code != 200:
                raise BenchError(f"import: {reply.status_code} {reply.text[:300]}")
        indexed = await asyncio.to_thread(wait_indexed, db_path)
        print(f"imported {len(records.splitlines())} conversations for {len(users)} users; "
              f"stored {indexed}", file=sys.stderr)
        results: dict[str, Any] = {}
        blocks: dict[str, list[int]] = {}  # kind/mode -> tokens injected into each request
        evidence: dict[str, list[float]] = {}  # kind/mode -> share of each question's evidence
        for kind in args.kinds:
            for size, tokens in SYSTEM_TOKENS.items():
                system = system_prompt(tokens)
                source = questions(conversations, imported, hopping=kind == "hopping")
                sessions = [[next(source) for _ in range(args.rounds)]
                            for _ in range(args.sessions)]
                for fmt in FORMATS:
                    costs: dict[str, float] = {}
                    for mode, headers in modes.items():
                        user = users.get((mode, fmt), "bench-none")
                        for i, asked in enumerate(sessions):
                            run = await run_session(
                                http, upstream, key=f"{kind}-{size}-{fmt}-{mode}-{i}", fmt=fmt,
                                headers={**headers, "X-Memory-User-Id": user}, system=system,
                                asked=asked, short=kind == "hopping")
                            costs[mode] = costs.get(mode, 0.0) + price(fmt, run.prompts)
                            if mode == "stable":
                                costs[FLOOR] = costs.get(FLOOR, 0.0) + price(fmt, run.floor)
                            blocks.setdefault(f"{kind}/{mode}", []).extend(run.injected)
                            evidence.setdefault(f"{kind}/{mode}", []).extend(run.found)
                        print(f"{kind} {size} {fmt} {mode}: x{costs[mode] / costs['none']:.2f}",
                              file=sys.stderr)
                    results.setdefault(kind, {}).setdefault(size, {})[fmt] = costs
    return {"costs": results, "injected": {
        key: sum(tokens) / len(tokens) for key, tokens in blocks.items() if tokens},
        "evidence": {key: sum(shares) / len(shares) for key, shares in evidence.items() if shares}}


def report(results: Mapping[str, Any], modes: Sequence[str]) -> list[str]:
    """Markdown tables, one per kind of session: each mode's cost relative to the same
    sessions without memory, and (in brackets) to the floor."""
    lines: list[str] = []
    for kind, by_size in results["costs"].items():
        shown = [m for m in modes if m != "none"]
        floor = FLOOR in next(iter(next(iter(by_size.values())).values()))
        lines += ["", f"{kind} sessions: cost vs no memory (vs the floor)", "",
                  "| system prompt | provider rule | " + " | ".join(shown)
                  + (" | floor" if floor else "") + " | goal |",
                  "|---|---|" + "---|" * (len(shown) + floor + 1)]
        for size, by_format in by_size.items():
            for fmt, costs in by_format.items():
                rule = "OpenAI (chat)" if fmt == "chat" else "Anthropic (messages)"
                cells = [f"x{costs[m] / costs['none']:.2f}"
                         + (f" ({costs[m] / costs[FLOOR]:.2f})" if floor else "") for m in shown]
                if floor:
                    cells.append(f"x{costs[FLOOR] / costs['none']:.2f}")
                goal = f"<= x{GOALS[size]}" if kind == "hopping" and fmt == "chat" else ""
                lines.append(f"| ~{SYSTEM_TOKENS[size] // 100 / 10:g}k tokens | {rule} | "
                             + " | ".join(cells) + f" | {goal} |")
        lines.append("| tokens injected per request (mean) | | " + " | ".join(
            f"{results['injected'].get(f'{kind}/{m}', 0.0):.0f}" for m in shown)
            + (" |" if floor else "") + " | |")
        lines.append("| evidence anywhere in the prompt (mean per question) | | " + " | ".join(
            f"{results['evidence'].get(f'{kind}/{m}', 0.0):.3f}" for m in shown)
            + (" |" if floor else "") + " | |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_prompt_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=600, help="imported turns per user (default 600)")
    parser.add_argument("--sessions", type=int, default=2, help="sessions per system prompt and mode")
    parser.add_argument("--rounds", type=int, default=20, help="requests per session (default 20)")
    parser.add_argument("--budget", type=int, default=1000, help="X-Memory-Budget (default 1000)")
    parser.add_argument("--stable-share", type=float, default=0.25,
                        help="MEMPROXY_MEMORY_STABLE_SHARE (default 0.25)")
    parser.add_argument("--delta-relevance", type=float,
                        help="MEMPROXY_MEMORY_DELTA_RELEVANCE (default: the setting's)")
    parser.add_argument("--today", action="store_true", help="the rules before issue 26: no "
                        "relevance threshold, and no kept blocks with writing off")
    parser.add_argument("--modes", nargs="+", choices=[m for m in MODES if m != "none"],
                        default=[m for m in MODES if m != "none"], help="memory modes to run")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="sessions: qa (consecutive questions, ~150-token replies), "
                        "hopping (every question about another conversation, 10-20-token replies)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the costs")
    args = parser.parse_args(argv)
    conversations = load(DATASET, 5, None)
    with tempfile.TemporaryDirectory(prefix="memproxy-prompt-cache-") as tmp, \
            ScriptedUpstream(keep_history=False) as scripted:
        upstream = Upstream(scripted)
        port = free_port()
        data = Path(tmp) / "data"
        env = child_env(
            MEMPROXY_UPSTREAM_BASE_URL=scripted.base_url, MEMPROXY_DATA_DIR=str(data),
            MEMPROXY_ANTHROPIC_BASE_URL=scripted.base_url.removesuffix("/v1"),
            MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR), MEMPROXY_LOG_LEVEL="warning",
            MEMPROXY_MEMORY_BUDGET=str(args.budget), MEMPROXY_EXTRACT_EVERY="0",
            MEMPROXY_MEMORY_STABLE_SHARE=str(args.stable_share),
            MEMPROXY_SUMMARY_EVERY="0", LITELLM_LOCAL_MODEL_COST_MAP="True",
        )
        if args.today:  # the rules before issue 26
            env |= {"MEMPROXY_MEMORY_DELTA_RELEVANCE": "0", "MEMPROXY_UNSAVED_BLOCKS_ENTRIES": "0"}
        if args.delta_relevance is not None:
            env["MEMPROXY_MEMORY_DELTA_RELEVANCE"] = str(args.delta_relevance)
        argv_ = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
        try:
            with serving("memproxy", argv_, env, f"http://127.0.0.1:{port}/readyz", Path(tmp)):
                results = asyncio.run(bench(port, upstream, args, conversations,
                                            data / "memproxy.db"))
        except (BenchError, KeyboardInterrupt) as exc:
            print(f"bench_prompt_cache: {exc or 'interrupted'}", file=sys.stderr)
            return 1
    print("\n".join(report(results, ["none", *args.modes])))
    if args.json:
        args.json.write_bytes(orjson.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                            **results}, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

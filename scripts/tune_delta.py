"""Choosing stable injection's delta rule (`MEMPROXY_MEMORY_DELTA_RELEVANCE`) on LoCoMo dev.

Each of the dev conversations is imported for a user of its own (through
``/v1/memory/import`` on a memproxy started here, once: ``--data-dir`` keeps the store), then
``MemoryEngine.recall`` is called in-process the way a stable-injection session calls it:
sessions of ``--rounds`` questions from the conversation's QA list, one after the other, the
history resent with a short reply (10-20 tokens) after each question, and every later
request asking only for what the session's earlier blocks do not show (`shown`). The blocks
are placed as memproxy places them (memory.recall.inject.place) and each request's prompt is
priced under OpenAI's rule with the ~1.2k-token system prompt (scripts/bench_prompt_cache).
``--oracle`` gives the bound on any relevance rule: a later block only where the question's
evidence is in memory.

Two kinds of session: `kept`, consecutive questions about the user's own conversation, and
`hopping`, where every other question is about another dev conversation, which the user's
memory does not hold (the session changes topic at every turn, and half its questions have
nothing to recall). For each configuration (a relevance threshold and a share cap) and kind it
prints the curve: the session's input cost against the same sessions without memory, the memory tokens injected
per request, and the evidence anywhere in the prompt (bench_prompt_cache's measure: the
share of a question's evidence turns whose text is in its prompt). Leave-one-conversation-out
then picks, for each conversation, the cheapest configuration whose evidence on the other
conversations (both kinds pooled) is at most 0.01 below the rule without a threshold (share
0.25, no relevance cut, no similarity gate), and reports it on the held-out one::

    .venv/bin/python -m scripts.tune_delta --data-dir /tmp/memproxy-delta-store
    .venv/bin/python -m scripts.tune_delta --data-dir DIR --relevance 0,0.2,0.3 \
        --shares 0.2,0.25 --similarity 0,0.3,0.35
    .venv/bin/python -m scripts.tune_delta --data-dir DIR --relevance 0 --shares 0.25,0.35 --oracle
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from config import load_settings
from memory import LocalEmbedder, MemoryEngine, Placed, Recalled, RecallRequest, place
from scripts.bench_overhead import BenchError, child_env, free_port, serving
from scripts.bench_prompt_cache import (
    SYSTEM_TOKENS,
    Asked,
    chat_segments,
    import_records,
    openai_cost,
    short_reply,
    system_prompt,
    tokenise,
)
from scripts.eval_locomo import DATASET, MODEL_DIR, Conversation, load, wait_indexed
from scripts.tune_locomo import CachedEmbedder

MODEL = "gpt-4o"
BASELINE = (0.0, 0.25, 0.0)  # the rule before: no threshold, a quarter of the budget, no gate
MAX_EVIDENCE_DROP = 0.01
KINDS = ("kept", "hopping")
Config = tuple[float, float, float]  # relevance threshold, share cap, similarity gate


@dataclass
class Run:
    """One configuration on one conversation's sessions."""

    cost: float = 0.0
    cost_none: float = 0.0
    injected: int = 0
    requests: int = 0
    evidence: float = 0.0
    questions: int = 0


def asked_of(conv: Conversation, held: bool) -> list[Asked]:
    """`conv`'s QA questions, with their evidence texts when the user's memory holds it."""
    turns = {t.dia_id: t.text for _, session in conv.sessions for t in session}
    return [Asked(q.text, tuple(turns[d] for d in q.evidence) if held else ())
            for q in conv.questions]


def sessions_of(
    conv: Conversation, other: Conversation, count: int, rounds: int
) -> dict[str, list[list[Asked]]]:
    """`count` sessions of `rounds` questions of each kind: `kept`, consecutive questions
    about `conv` (the user's memory); `hopping`, every other one about `other`, which the
    user's memory does not hold (so the session changes topic at every turn)."""
    own, foreign = asked_of(conv, True), asked_of(other, False)
    mixed = [q for pair in zip(own, foreign, strict=False) for q in pair]
    return {kind: [asked[i * rounds:(i + 1) * rounds] for i in range(count)
                   if len(asked) >= (i + 1) * rounds]
            for kind, asked in (("kept", own), ("hopping", mixed))}


async def run_session(
    engine: MemoryEngine, user: str, session: str, system: str, asked: Sequence[Asked], *,
    budget: int, relevance: float, share: float, similarity: float, oracle: bool = False,
) -> Run:
    """One session as memproxy's stable injection runs it (proxy/flow/memory_step.py).
    `oracle`: a later block only for questions whose evidence the user's memory holds (a
    gate no rule can beat: the bound on what any relevance rule can save)."""
    run = Run()
    history: list[dict[str, Any]] = []
    blocks: dict[int, tuple[Placed, frozenset[str]]] = {}  # user message number -> block
    with_memory, without = [], []
    for n, question in enumerate(asked):
        history.append({"role": "user", "content": question.text})
        messages = [{"role": "system", "content": system}, *history]
        shown = frozenset(k for _, keys in blocks.values() for k in keys)
        recalled = await engine.recall(RecallRequest(
            user, session, messages, MODEL, budget, "user", shown=shown,
            add_budget=round(budget * share), relevance=relevance, similarity=similarity,
        ))
        if oracle and n and not question.evidence:
            recalled = Recalled()
        if recalled.items:
            blocks[n] = (Placed(n, recalled.block, "system" if n == 0 else "last_user"),
                         frozenset(i.id for i in recalled.items))
        prompt = place(messages, [p for p, _ in blocks.values()])
        segments = chat_segments({"messages": prompt})
        with_memory.append(tokenise(segments))
        without.append(tokenise(chat_segments({"messages": messages})))
        run.injected += recalled.tokens
        run.requests += 1
        text = "".join(t for t, _ in segments)
        if question.evidence:
            run.evidence += sum(e.strip() in text for e in question.evidence) / len(question.evidence)
            run.questions += 1
        history.append({"role": "assistant", "content": short_reply(question.text)})
    run.cost, run.cost_none = openai_cost(with_memory), openai_cost(without)
    return run


async def import_store(conversations: Sequence[Conversation], data: Path) -> None:
    """Each conversation, whole, for the user named by its sample id (memproxy on a port)."""
    port = free_port()
    env = child_env(MEMPROXY_UPSTREAM_BASE_URL="http://127.0.0.1:9/v1", MEMPROXY_DATA_DIR=str(data),
                    MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR), MEMPROXY_LOG_LEVEL="warning",
                    MEMPROXY_EXTRACT_EVERY="0", MEMPROXY_SUMMARY_EVERY="0",
                    LITELLM_LOCAL_MODEL_COST_MAP="True")
    argv = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
    with serving("memproxy", argv, env, f"http://127.0.0.1:{port}/readyz", data.parent):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                     trust_env=False) as http:
            for conv in conversations:
                records, _ = import_records([conv], 10**6)
                reply = await http.post("/v1/memory/import", content=records,
                                        headers={"X-Memory-User-Id": conv.sample_id})
                if reply.status_code != 200:
                    raise BenchError(f"import: {reply.status_code} {reply.text[:300]}")
        print(f"stored {await asyncio.to_thread(wait_indexed, data / 'memproxy.db')}",
              file=sys.stderr)


async def measure(
    args: argparse.Namespace, conversations: Sequence[Conversation],
    configs: Sequence[Config],
) -> dict[Config, dict[str, Run]]:
    """{configuration: {conversation: its sessions summed}}."""
    model = LocalEmbedder(MODEL_DIR / "onnx" if (MODEL_DIR / "onnx").is_dir() else MODEL_DIR)
    embedder = CachedEmbedder(model, args.cache)
    env = {"MEMPROXY_DATA_DIR": str(args.data_dir), "MEMPROXY_EXTRACT_EVERY": "0",
           "MEMPROXY_SUMMARY_EVERY": "0", "MEMPROXY_LOG_LEVEL": "warning",
           "MEMPROXY_RECALL_CACHE_ENTRIES": "0", "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR)}
    engine = await MemoryEngine.open(load_settings(env), embedder=embedder)
    system = system_prompt(SYSTEM_TOKENS["short"])
    runs: dict[Config, dict[str, Run]] = {}
    try:
        for config in configs:
            started = time.perf_counter()
            for n, conv in enumerate(conversations):
                other = conversations[(n + 1) % len(conversations)]
                for kind, sessions in sessions_of(conv, other, args.sessions, args.rounds).items():
                    total = Run()
                    for i, asked in enumerate(sessions):
                        run = await run_session(
                            engine, conv.sample_id, f"tune-{kind}-{i}", system, asked,
                            budget=args.budget, relevance=config[0], share=config[1],
                            similarity=config[2], oracle=args.oracle)
                        for name in vars(total):
                            setattr(total, name, getattr(total, name) + getattr(run, name))
                    runs.setdefault(config, {})[f"{conv.sample_id}/{kind}"] = total
            embedder.save()
            print(f"{describe(config)}: "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    finally:
        await engine.close()
    return runs


def pooled(by_conv: Mapping[str, Run], names: Sequence[str],
           kinds: Sequence[str] = KINDS) -> tuple[float, float, float]:
    """(cost relative to no memory, memory tokens per request, evidence per question) of
    the conversations `names`, sessions of `kinds`."""
    runs = [by_conv[f"{n}/{k}"] for n in names for k in kinds]
    cost, none = sum(r.cost for r in runs), sum(r.cost_none for r in runs)
    tokens, requests = sum(r.injected for r in runs), sum(r.requests for r in runs)
    evidence, questions = sum(r.evidence for r in runs), sum(r.questions for r in runs)
    return cost / none, tokens / max(requests, 1), evidence / max(questions, 1)


def describe(config: Config) -> str:
    return f"relevance {config[0]:g}, share {config[1]:g}, similarity {config[2]:g}"


def choose(runs: Mapping[Config, Mapping[str, Run]], names: Sequence[str]) -> Config:
    """The cheapest configuration on `names` whose evidence is within MAX_EVIDENCE_DROP of
    the baseline's (ties: more evidence)."""
    floor = pooled(runs[BASELINE], names)[2] - MAX_EVIDENCE_DROP
    scored = {config: pooled(by_conv, names) for config, by_conv in runs.items()}
    allowed = [c for c, (_, _, evidence) in scored.items() if evidence >= floor]
    return min(allowed, key=lambda c: (round(scored[c][0], 4), -scored[c][2]))


def report(runs: Mapping[Config, Mapping[str, Run]], names: Sequence[str]) -> list[str]:
    """The curve over all conversations, then the leave-one-conversation-out choices."""
    lines = ["| relevance | share cap | similarity | sessions | cost vs no memory (OpenAI, "
             "~1.2k) | memory tokens per request | evidence in the prompt |",
             "|---|---|---|---|---|---|---|"]
    for (relevance, share, similarity), by_conv in sorted(runs.items()):
        for kinds in ([kind] for kind in KINDS):
            cost, tokens, evidence = pooled(by_conv, names, kinds)
            lines.append(f"| {relevance:g} | {share:g} | {similarity:g} | {kinds[0]} "
                         f"| x{cost:.2f} | {tokens:.0f} | {evidence:.3f} |")
    lines += ["", "| held out | chosen on the others | its cost | baseline cost | its evidence "
              "| baseline evidence |", "|---|---|---|---|---|---|"]
    chosen: list[Config] = []
    for held in names:
        config = choose(runs, [n for n in names if n != held])
        chosen.append(config)
        cost, _, evidence = pooled(runs[config], [held])
        base_cost, _, base_evidence = pooled(runs[BASELINE], [held])
        lines.append(f"| {held} | {describe(config)} | x{cost:.2f} "
                     f"| x{base_cost:.2f} | {evidence:.3f} | {base_evidence:.3f} |")
    held_out = [runs[c][f"{h}/{k}"] for c, h in zip(chosen, names, strict=True) for k in KINDS]
    pooled_cost = sum(r.cost for r in held_out)
    pooled_none = sum(r.cost_none for r in held_out)
    found = sum(r.evidence for r in held_out)
    asked = sum(r.questions for r in held_out)
    base = pooled(runs[BASELINE], names)
    lines.append(f"| all, held out | | x{pooled_cost / pooled_none:.2f} | x{base[0]:.2f} "
                 f"| {found / asked:.3f} | {base[2]:.3f} |")
    lines.append(f"\nchosen on all conversations: {describe(choose(runs, names))}")
    return lines


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


async def main_async(args: argparse.Namespace) -> int:
    conversations = load(DATASET, args.conversations, None)
    if not (args.data_dir / "memproxy.db").exists():
        args.data_dir.mkdir(parents=True, exist_ok=True)
        await import_store(conversations, args.data_dir)
    configs = sorted({BASELINE, *((r, s, g) for r in floats(args.relevance)
                                  for s in floats(args.shares) for g in floats(args.similarity))})
    runs = await measure(args, conversations, configs)
    print("\n".join(report(runs, [c.sample_id for c in conversations])))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.tune_delta", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="the imported store (made here when it holds no database)")
    parser.add_argument("--relevance", default="0,0.2,0.3,0.35,0.4,0.45,0.5,0.55,0.6,0.7",
                        help="thresholds to try (comma-separated)")
    parser.add_argument("--shares", default="0.25", help="share caps to try (comma-separated)")
    parser.add_argument("--similarity", default="0",
                        help="raw cosine gates to try (comma-separated)")
    parser.add_argument("--oracle", action="store_true",
                        help="the bound: later blocks only for questions memory holds")
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=3, help="sessions per conversation")
    parser.add_argument("--rounds", type=int, default=20, help="requests per session")
    parser.add_argument("--budget", type=int, default=1000)
    parser.add_argument("--cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "memproxy-delta-queries.npz",
                        help="query vectors kept between runs (outside the repository)")
    try:
        return asyncio.run(main_async(parser.parse_args(argv)))
    except BenchError as exc:
        print(f"tune_delta: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

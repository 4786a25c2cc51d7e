"""In-process recall tuning on LoCoMo: `MemoryEngine.recall` called directly on a replayed store.

For searching ranking changes quickly. The store is one that ``scripts.eval_locomo
--data-dir DIR`` replayed through the proxy (copied, so the original stays as it was);
questions are asked the way the evaluation asks them (a fresh session, the question as the
only message), and scored with the same code. Query vectors are computed by the real model
once and kept in a cache file outside the repository. Figures to report come from
``scripts.eval_locomo``, through the proxy::

    .venv/bin/python -m scripts.tune_locomo --data-dir /tmp/locomo-data
    .venv/bin/python -m scripts.tune_locomo --data-dir /tmp/locomo-data \\
        --grid weight_context=0.2,0.4,0.6 --grid weight_conversation=0.2,0.4

Every combination of the grid is one configuration; leave-one-conversation-out then picks,
for each conversation, the configuration that does best on the other four.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from config import load_settings
from memory import LocalEmbedder, MemoryEngine, RecallRequest
from scripts.eval_locomo import (
    BUDGETS,
    DATASET,
    KS,
    MODEL,
    MODEL_DIR,
    RANKING_BUDGET,
    TARGET_BUDGET,
    Answer,
    Conversation,
    credited,
    load,
    percentile,
    score,
)
from scripts.locomo_figures import print_tables


class CachedEmbedder:
    """The real model, with every text's vector kept (in `path` between runs)."""

    def __init__(self, model: LocalEmbedder, path: Path) -> None:
        self.model = model
        self.path = path
        self.vectors: dict[str, np.ndarray] = {}
        if path.exists():
            saved = np.load(path, allow_pickle=False)
            self.vectors = dict(zip(saved["texts"].tolist(), saved["vectors"], strict=True))
        self.added = 0

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self.vectors]
        if missing:
            for text, vector in zip(missing, await self.model.embed(missing), strict=True):
                self.vectors[text] = vector
            self.added += len(missing)
        return np.stack([self.vectors[t] for t in texts])

    def save(self) -> None:
        if self.added:
            texts = list(self.vectors)
            np.savez(self.path, texts=np.array(texts), vectors=np.stack([self.vectors[t] for t in texts]))


async def run_config(
    data_dir: Path, embedder: CachedEmbedder, changes: dict[str, str],
    conversations: Sequence[Conversation], budgets: Sequence[int], ranking: bool,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per-question rows for one configuration, and its block statistics."""
    env = {"MEMPROXY_DATA_DIR": str(data_dir), "MEMPROXY_EXTRACT_EVERY": "0",
           "MEMPROXY_SUMMARY_EVERY": "0", "MEMPROXY_LOG_LEVEL": "warning",
           "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR)}
    env |= {f"MEMPROXY_{k.upper()}": v for k, v in changes.items()}
    engine = await MemoryEngine.open(load_settings(env), embedder=embedder)
    rows: list[dict[str, Any]] = []
    over = 0
    times: list[float] = []
    try:
        for conv in conversations:
            for q in conv.questions:
                answer = Answer([], {}, {}, {}, 0.0)
                for budget in ((RANKING_BUDGET,) if ranking else ()) + tuple(budgets):
                    recalled = await engine.recall(RecallRequest(
                        conv.sample_id, f"{conv.sample_id}-question-{q.index}",
                        [{"role": "user", "content": q.text}], MODEL, budget, "user",
                    ))
                    items = [{"text": i.text, "turn_ids": i.turn_ids} for i in recalled.items]
                    turns = credited(conv, items, recalled.block)
                    if budget == RANKING_BUDGET:
                        answer.ranking = turns
                        continue
                    answer.found[budget] = set().union(*turns)
                    answer.tokens[budget] = recalled.tokens
                    over += recalled.tokens > budget
                    if budget == TARGET_BUDGET:
                        times.append(recalled.recall_ms)
                if not ranking:
                    answer.ranking = [answer.found[max(budgets)]]
                ranks = {d: next((i + 1 for i, ids in enumerate(answer.ranking) if d in ids), None)
                         for d in q.evidence}
                rows.append({"sample_id": conv.sample_id, "index": q.index, "question": q.text,
                             "category": q.category, "evidence": list(q.evidence),
                             "evidence_rank": ranks, "figures": score(q, answer, budgets)})
    finally:
        await engine.close()
    stats = {"over_budget": over, "p50_ms": percentile(times, 0.5), "p95_ms": percentile(times, 0.95)}
    return rows, stats


def grid(pairs: Sequence[str]) -> list[dict[str, str]]:
    """Every combination of `name=v1,v2,...` settings (field names, lower case)."""
    axes = []
    for pair in pairs:
        name, values = pair.split("=", 1)
        axes.append([(name.strip().lower().removeprefix("memproxy_"), v) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] or [{}]


async def main_async(args: argparse.Namespace) -> int:
    conversations = load(args.dataset, args.conversations, args.questions)
    model = LocalEmbedder(MODEL_DIR / "onnx" if (MODEL_DIR / "onnx").is_dir() else MODEL_DIR)
    embedder = CachedEmbedder(model, args.cache)
    configs: dict[str, list[dict[str, Any]]] = {}
    keys = ([f"@{k}" for k in KS] if args.ranking else []) + [f"B{b}" for b in args.budgets]
    with tempfile.TemporaryDirectory(prefix="memproxy-tune-") as tmp:
        data = Path(tmp) / "data"
        shutil.copytree(args.data_dir, data)
        for changes in grid(args.grid):
            name = ",".join(f"{k}={v}" for k, v in changes.items()) or "defaults"
            started = time.perf_counter()
            rows, stats = await run_config(data, embedder, changes, conversations, args.budgets,
                                           args.ranking)
            embedder.save()
            configs[name] = rows
            print(f"{name}: {time.perf_counter() - started:.0f} s, over budget {stats['over_budget']}, "
                  f"recall p50 {stats['p50_ms']:.1f} ms p95 {stats['p95_ms']:.1f} ms",
                  file=sys.stderr)
    print_tables(configs, keys, f"B{TARGET_BUDGET}")
    if args.json:
        args.json.write_bytes(orjson.dumps(configs, option=orjson.OPT_INDENT_2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.tune_locomo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True, help="a store eval_locomo replayed")
    parser.add_argument("--grid", action="append", default=[], metavar="SETTING=V1,V2",
                        help="setting values to try (repeatable; every combination runs)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--ranking", action="store_true", help="recall@k too (one more recall a question)")
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--questions", type=int, help="at most this many questions per conversation")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "memproxy-locomo-queries.npz",
                        help="query vectors kept between runs (outside the repository)")
    parser.add_argument("--dataset", type=Path, default=DATASET, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, metavar="FILE", help="per-question rows per configuration")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

"""The rerank stage: a reranker reorders the best of recall's fused candidates.

It sits after fusion and before packing (docs/architecture.md, "Request flow"). The best
`top_n` candidates by fused score, facts, summaries and turns together, go to the reranker
(a `Scorer` the proxy gives memory: a rerank endpoint or the learning model), which scores
each for the query. Within each kind the scored candidates move to the front in the
reranker's order, and the rest keep their fused order after them. Packing is unchanged, so
the block keeps its exact budget and its fence, and a stable injection's later block still
only adds items its session has not shown.

A reranker that is slower than its budget, fails, or answers something that cannot be used
(`RerankFailed`) leaves the fused order, and the reason is reported (`RerankReport.fallback`,
which the proxy puts in X-Memory-Error): the chat never waits longer than the budget for it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from memory import tracing
from memory.recall.learned_recall import Learned, LearnedItem
from memory.recall.ranking import Candidate

# (query, documents, user id) -> one relevance score per document, in order (higher: more
# relevant). The user id lets a reranker on the learning route use that user's own key.
Scorer = Callable[[str, Sequence[str], str], Awaitable[Sequence[float]]]
# A reranker reads the start of a long text only (cross-encoders take 512 tokens); sending
# more costs transfer and time, not quality.
MAX_DOCUMENT_CHARS = 2000
# Why the fused order stood although rerank was asked for (memproxy_rerank_fallbacks' labels).
OFF = "not configured"  # asked for with MEMPROXY_RERANK=off
TIMEOUT = "timeout"
ERROR = "error"
MALFORMED = "malformed"

_Keyed = TypeVar("_Keyed", Candidate, LearnedItem)  # both carry a `key`


class RerankFailed(Exception):
    """The reranker gave no usable answer; `reason` is a short label (metrics, headers)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


@dataclass(frozen=True)
class RerankReport:
    """What the rerank stage did for one recall (shown by a dry run and the search API)."""

    fused: list[str]  # the keys sent to the reranker, in fused order
    reranked: list[str]  # the same keys in the reranker's order ([] when it fell back)
    ms: float
    fallback: str | None = None  # why the fused order stands (OFF, TIMEOUT, ERROR, ...)


@dataclass(frozen=True)
class Reranked:
    """Recall's candidates after the rerank stage, and its report."""

    turns: list[Candidate]
    learned: Learned
    report: RerankReport


@dataclass(kw_only=True)
class Reranker:
    """Reorders the best fused candidates with `scorer` within `timeout_ms`.

    `redact` is applied to the query and to every text before it leaves the process.
    """

    scorer: Scorer | None = field(kw_only=False)
    top_n: int
    timeout_ms: int
    redact: Callable[[str], str]

    async def rerank(
        self, query: str, user_id: str, turns: list[Candidate], learned: Learned
    ) -> Reranked:
        """The candidates in the reranker's order (the fused order on a fallback)."""
        started = time.perf_counter()
        best = best_candidates(turns, learned, self.top_n)
        keys = [key for key, _ in best]
        if self.scorer is None or not best:
            fallback = OFF if self.scorer is None else None
            return Reranked(turns, learned, RerankReport(keys, [], elapsed_ms(started), fallback))
        with tracing.span("memproxy.recall.rerank", {"memproxy.rerank.candidates": len(best)}) as span:
            try:
                scores = await self._scores(query, user_id, [text for _, text in best])
            except RerankFailed as failed:
                report = RerankReport(keys, [], elapsed_ms(started), failed.reason)
                if span is not None:
                    span.set_attribute("memproxy.rerank.fallback", failed.reason)
                return Reranked(turns, learned, report)
        order = [key for _, key in sorted(zip(scores, keys, strict=True), key=lambda p: -p[0])]
        rank = {key: i for i, key in enumerate(order)}
        reordered = replace(
            learned, facts=_reorder(learned.facts, rank),
            summaries=_reorder(learned.summaries, rank),
            shared=_reorder(learned.shared, rank),
        )
        return Reranked(_reorder(turns, rank), reordered,
                        RerankReport(keys, order, elapsed_ms(started)))

    async def _scores(self, query: str, user_id: str, texts: list[str]) -> list[float]:
        """The scorer's scores for `texts`, checked; RerankFailed on any failure."""
        assert self.scorer is not None
        documents = [self.redact(text[:MAX_DOCUMENT_CHARS]) for text in texts]
        try:
            async with asyncio.timeout(self.timeout_ms / 1000):
                scores = list(await self.scorer(self.redact(query), documents, user_id))
        except TimeoutError:
            raise RerankFailed(TIMEOUT) from None
        except RerankFailed:
            raise
        except Exception as exc:  # the reranker's own failure never reaches the chat
            raise RerankFailed(ERROR, f"{type(exc).__name__}: {exc}") from None
        if len(scores) != len(documents) or not all(_is_score(s) for s in scores):
            raise RerankFailed(MALFORMED, "not one finite score per document")
        return [float(s) for s in scores]


def best_candidates(
    turns: Sequence[Candidate], learned: Learned, top_n: int
) -> list[tuple[str, str]]:
    """(key, text) of the `top_n` best candidates by fused score, facts, summaries, the
    organisation's facts and turns together, best first (ties: learned items first)."""
    pool = [(item.score, -1, item.key, item.text)
            for item in [*learned.facts, *learned.summaries, *learned.shared]]
    pool += [(c.score, i, c.key, c.text) for i, c in enumerate(turns[:top_n])]
    pool.sort(key=lambda p: (-p[0], p[1]))
    return [(key, text) for _, _, key, text in pool[:top_n]]


def _reorder(items: list[_Keyed], rank: dict[str, int]) -> list[_Keyed]:
    """The ranked items first, in the reranker's order; the others after, as they were
    (the sort is stable)."""
    last = len(rank)
    return sorted(items, key=lambda item: rank.get(item.key, last))


def _is_score(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def elapsed_ms(started: float) -> float:
    """Milliseconds since `started` (a perf_counter reading), to the microsecond."""
    return round((time.perf_counter() - started) * 1000, 3)

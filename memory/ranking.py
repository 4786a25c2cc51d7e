"""Fusing dense and lexical candidates into one ranked list with tunable weights."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Weights:
    """How much each signal counts in the fused score."""

    dense: float = 1.0
    bm25: float = 0.6
    identifier: float = 0.5
    recency: float = 0.1
    session: float = 0.1
    half_life_days: float = 30.0


@dataclass
class Candidate:
    """One recallable item and its signals (each in [0, 1])."""

    key: str
    session_id: str
    created_at: float
    text: str
    speaker: str = ""
    turn_id: int = 0
    dense: float = 0.0
    bm25: float = 0.0
    signals: dict[str, float] = field(default_factory=dict)
    score: float = 0.0


def fuse(
    candidates: Mapping[str, Candidate],
    weights: Weights,
    *,
    session_id: str,
    query_identifiers: set[str],
    now: float,
) -> list[Candidate]:
    """Score every candidate and return them best first.

    Dense similarity is used as is (cosine, clipped at 0). BM25 scores are unbounded, so
    they are divided by the best one of this query. Recency halves every half-life.
    """
    top_bm25 = max((c.bm25 for c in candidates.values()), default=0.0) or 1.0
    half_life = weights.half_life_days * 86400.0
    for c in candidates.values():
        ident = _identifier_share(query_identifiers, c.text)
        recency = math.pow(0.5, max(0.0, now - c.created_at) / half_life)
        c.signals = {
            "dense": round(max(0.0, c.dense), 4),
            "bm25": round(c.bm25 / top_bm25, 4),
            "identifier": round(ident, 4),
            "recency": round(recency, 4),
            "session": 1.0 if c.session_id == session_id else 0.0,
        }
        c.score = round(
            weights.dense * c.signals["dense"]
            + weights.bm25 * c.signals["bm25"]
            + weights.identifier * c.signals["identifier"]
            + weights.recency * c.signals["recency"]
            + weights.session * c.signals["session"],
            6,
        )
    return sorted(candidates.values(), key=lambda c: (-c.score, -c.created_at, c.key))


def _identifier_share(wanted: set[str], text: str) -> float:
    if not wanted:
        return 0.0
    return sum(1 for name in wanted if name in text) / len(wanted)

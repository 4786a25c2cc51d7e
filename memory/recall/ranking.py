"""Fusing dense and lexical candidates into one ranked list with tunable weights."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config import Settings

# How many of the best items lend context to their neighbours (see `add_context`).
CONTEXT_SEEDS = 30
# How many of a session's best items make its score (see `add_conversation`).
CONVERSATION_ITEMS = 3
# The role, and speaker, of the user's own messages in a conversation with the model: those
# carry no name (see `lift_user`).
USER = "user"


@dataclass(frozen=True)
class Weights:
    """How much each signal counts in the fused score."""

    dense: float = 1.0
    bm25: float = 1.5
    identifier: float = 0.5
    recency: float = 0.1
    session: float = 0.1
    half_life_days: float = 30.0
    context: float = 0.4
    conversation: float = 0.4
    user: float = 0.6
    standing: float = 1.0

    @classmethod
    def of(cls, settings: Settings) -> Weights:
        """The weights the settings give (`MEMPROXY_WEIGHT_*`)."""
        return cls(
            settings.weight_dense, settings.weight_bm25, settings.weight_identifier,
            settings.weight_recency, settings.weight_session, settings.recency_half_life_days,
            settings.weight_context, settings.weight_conversation, settings.weight_user,
            settings.weight_standing,
        )


@dataclass
class Candidate:
    """One recallable item and its signals (each in [0, 1])."""

    key: str
    session_id: str
    created_at: float
    text: str
    speaker: str = ""
    turn_id: int = 0
    # The message's role (user or assistant); `speaker` is its name when it has one.
    role: str = ""
    dense: float = 0.0
    bm25: float = 0.0
    signals: dict[str, float] = field(default_factory=dict)
    score: float = 0.0
    # Whether the text shown was cut before and after (memory.recall.excerpt).
    cut: tuple[bool, bool] = (False, False)


def fuse(
    candidates: Mapping[str, Candidate],
    weights: Weights,
    *,
    session_id: str,
    query_identifiers: set[str],
    now: float,
) -> list[Candidate]:
    """Score every candidate and return them best first.

    Dense similarity and BM25 are each min-max scaled over this query's candidates: raw
    cosines of a small model crowd into a narrow band and BM25 is unbounded, so only their
    order within the query carries meaning. A candidate one search did not return gets 0
    from it. Recency halves every half-life.
    """
    dense = _scaled({key: c.dense for key, c in candidates.items()})
    bm25 = _scaled({key: c.bm25 for key, c in candidates.items()})
    half_life = weights.half_life_days * 86400.0
    for key, c in candidates.items():
        ident = _identifier_share(query_identifiers, c.text)
        recency = math.pow(0.5, max(0.0, now - c.created_at) / half_life)
        c.signals = {
            "dense": round(dense[key], 4),
            "bm25": round(bm25[key], 4),
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
    return _best_first(candidates.values())


def signal_scores(
    dense: Iterable[tuple[str, float]], lexical: Iterable[tuple[int, float]]
) -> dict[int, list[float]]:
    """{item id: [dense, bm25]} from the two searches' hits (dense keys: a letter, the id)."""
    scores: dict[int, list[float]] = {}
    for key, similarity in dense:
        scores.setdefault(int(key[1:]), [0.0, 0.0])[0] = similarity
    for item_id, bm25 in lexical:
        scores.setdefault(item_id, [0.0, 0.0])[1] = bm25
    return scores


def add_conversation(ranked: Sequence[Candidate], weight: float) -> list[Candidate]:
    """Lift the items of sessions that match as a whole, and re-rank.

    A session is usually about one task or topic, so an item is likelier relevant when its
    session holds other strong matches (passage retrieval's document-score interpolation,
    with the session as the document). A session's score is the mean of its
    CONVERSATION_ITEMS best scores (missing ones count 0), scaled to the best session's.
    """
    best: dict[str, list[float]] = {}
    for c in ranked:  # best first, so each list is too
        best.setdefault(c.session_id, []).append(c.score)
    sessions = {s: sum(v[:CONVERSATION_ITEMS]) / CONVERSATION_ITEMS for s, v in best.items()}
    top = max(sessions.values(), default=0.0)
    if top <= 0:
        return list(ranked)
    for c in ranked:
        c.signals["conversation"] = round(sessions[c.session_id] / top, 4)
        c.score = round(c.score + weight * c.signals["conversation"], 6)
    return _best_first(ranked)


def add_context(
    ranked: Sequence[Candidate],
    neighbours: Mapping[str, Sequence[str]],
    added: Mapping[str, Candidate],
    share: float,
) -> list[Candidate]:
    """Give the turns around each of the best items `share` of its score, and re-rank.

    An answer often shares no words with the question that the turn before it asked
    ("How long have you been painting?" / "Seven years now"), so the neighbours of a
    strong match are likely relevant too. `neighbours` maps a seed's key to its
    neighbours' keys; `added` holds the neighbours that were not candidates (scored 0).
    Each neighbour takes the largest share offered, from the first CONTEXT_SEEDS items.
    """
    bonus: dict[str, float] = {}
    for seed in ranked[:CONTEXT_SEEDS]:
        for key in neighbours.get(seed.key, ()):
            if key != seed.key:
                bonus[key] = max(bonus.get(key, 0.0), share * seed.score)
    everyone = {c.key: c for c in ranked} | {k: c for k, c in added.items() if k in bonus}
    for key, extra in bonus.items():
        c = everyone.get(key)
        if c is not None:
            c.signals["context"] = round(extra, 4)
            c.score = round(c.score + extra, 6)
    return _best_first(everyone.values())


def lift_user(ranked: Sequence[Candidate], weight: float) -> list[Candidate]:
    """Lift the user's own turns (a message of role user without a name) by `weight`, and
    re-rank.

    With a model, the user's messages state the facts of their project and plans once,
    while the model's long replies elaborate on them and match many questions weakly; chat
    between named people (every turn carries a name) is left as it is (docs/memory.md,
    "Recall"). It comes last, so a session's score and a neighbour's share are of what
    matched, and a later block's relevance cut can leave it out (outcome.new_relevant).
    """
    return _lift(ranked, "user", weight, lambda c: c.role == c.speaker == USER)


def lift_standing(ranked: Sequence[Candidate], keys: Collection[str], weight: float
                  ) -> list[Candidate]:
    """Lift the standing statements `keys` (memory.index.standing: the user's lasting
    instructions and preferences that are about the query) by `weight`, and re-rank.

    A one-line "Always use APA style when I ask about references" shares few words with a
    question on references and ranks below every turn that discusses them; said once, it
    holds for every such question. Like `lift_user`, it comes last and a later block's
    relevance cut leaves it out (`lifted`).
    """
    return _lift(ranked, "standing", weight, lambda c: c.key in keys)


def lifted(c: Candidate, weights: Weights) -> float:
    """What `lift_user` and `lift_standing` added to a candidate's score: a lift ranks, it does
    not say that a turn matches (outcome.new_relevant)."""
    return weights.user * c.signals.get("user", 0.0) + weights.standing * c.signals.get(
        "standing", 0.0)


def _lift(ranked: Sequence[Candidate], signal: str, weight: float,
          chosen: Callable[[Candidate], bool]) -> list[Candidate]:
    """Set `signal` to 1 on the `chosen` candidates (0 on the others), add `weight` to their
    score, and re-rank."""
    for c in ranked:
        c.signals[signal] = 1.0 if chosen(c) else 0.0
        c.score = round(c.score + weight * c.signals[signal], 6)
    return _best_first(ranked)


def _scaled(values: Mapping[str, float]) -> dict[str, float]:
    """Positive values min-max scaled into [0, 1] (all 1 when equal); the others 0."""
    present = [v for v in values.values() if v > 0]
    low, high = min(present, default=0.0), max(present, default=0.0)
    span = high - low
    return {
        key: 0.0 if v <= 0 else (v - low) / span if span > 0 else 1.0
        for key, v in values.items()
    }


def _best_first(candidates: Iterable[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (-c.score, -c.created_at, c.key))


def _identifier_share(wanted: set[str], text: str) -> float:
    if not wanted:
        return 0.0
    return sum(1 for name in wanted if name in text) / len(wanted)

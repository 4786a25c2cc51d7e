"""What recall is asked and what it answers (memory.engine.MemoryEngine.recall), and the
steps between its ranking and its answer: packing the ranked items into a block, keeping
only what a stable injection has not shown yet, and the items the answer lists."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from memory.recall.block import BlockPack, pack_block
from memory.recall.learned_recall import Learned, LearnedItem
from memory.recall.ranking import Candidate, Weights, lifted
from memory.recall.render import LATER_PREAMBLE, PREAMBLE, Entry
from memory.recall.rerank import RerankReport
from memory.scopes import organization_memory
from memory.tokens import count_tokens


@dataclass(frozen=True)
class RecallRequest:
    """What recall needs to know about one chat request."""

    user_id: str
    session_id: str
    messages: Sequence[Mapping[str, Any]]
    model: str
    budget: int
    scope: str  # session | user | organization
    org_id: str | None = None  # the organisation whose shared memory scope organization adds
    # Keys of items the session's earlier blocks in this prompt show: not shown again.
    shown: frozenset[str] = frozenset()
    add_budget: int | None = None  # with `shown`: at most this many tokens of new items
    # With `shown`: a new item goes in only when its fused score is at least this share of
    # the ceiling the weights allow (`new_relevant`, `score_ceiling`); 0: every new item may.
    relevance: float = 0.0
    # With `shown`: new items go in only when the best of them by meaning has at least this
    # raw cosine similarity to the query (`new_relevant`); 0: no such gate.
    similarity: float = 0.0
    # Reorder the best fused candidates with the reranker (memory.recall.rerank).
    rerank: bool = False


@dataclass(frozen=True)
class RecalledItem:
    """One injected item, with where it came from and why it ranked."""

    source: str
    id: str
    turn_id: int
    session_id: str
    speaker: str
    created_at: float
    text: str
    score: float
    signals: dict[str, float]
    turn_ids: list[int] = field(default_factory=list)  # facts, summaries: their source turns


@dataclass(frozen=True)
class Recalled:
    """The outcome of recall for one request."""

    block: str = ""
    items: list[RecalledItem] = field(default_factory=list)
    tokens: int = 0
    truncated: bool = False
    candidates: int = 0
    recall_ms: float = 0.0
    embed_ms: float = 0.0
    skipped: str | None = None
    cached: bool = False  # reused from the recall cache
    rerank: RerankReport | None = None  # when rerank was asked for: what it did

    def as_dict(self, redact: Callable[[str], str] = str) -> dict[str, Any]:
        """JSON-ready view (dry runs and the search API), its texts passed through `redact`:
        text stored before a secret's shape was known leaves redacted (docs/security.md)."""
        view = asdict(self)
        view["block"] = redact(self.block)
        for item in view["items"]:
            item["text"] = redact(item["text"])
        return view


def shared_memory(request: RecallRequest) -> str | None:
    """The id of the organisation memory `request` reaches, if any."""
    if request.scope == "organization" and request.org_id:
        return organization_memory(request.org_id)
    return None


def pack_ranked(
    learned: Learned, ranked: list[Candidate], budget: int, model: str, shared_share: float,
    *, later: bool = False,
) -> BlockPack:
    """Pack the ranked turns (as dated excerpts) with the learned items, counted as `model`
    counts; `later`: as a later block of a stable injection, under the short preamble."""
    entries = [Entry(c.speaker, c.created_at, c.text, c.session_id, candidate_chunk(c), c.cut)
               for c in ranked]
    return pack_block(
        learned, entries, budget, lambda t: count_tokens(t, model), shared_share=shared_share,
        preamble=LATER_PREAMBLE if later else PREAMBLE,
    )


def unshown(
    learned: Learned, ranked: list[Candidate], packed: BlockPack, shown: frozenset[str]
) -> tuple[Learned, list[Candidate]]:
    """What `packed` chose that the session's earlier blocks do not show: a stable
    injection adds these only, so the session sees every item a fresh block would show."""
    chosen = {item.key for item in packed.chosen(learned)} - shown
    profile = learned.profile if learned.profile and learned.profile.key in chosen else None
    return Learned(
        [f for f in learned.facts if f.key in chosen],
        [s for s in learned.summaries if s.key in chosen], profile,
        [f for f in learned.shared if f.key in chosen],
    ), [ranked[i] for i in packed.turns if ranked[i].key not in shown]


def score_ceiling(weights: Weights) -> float:
    """The largest fused score the weights allow without context (each signal is in [0, 1]),
    the user-turn weight aside: it ranks, it does not say that a turn matches (new_relevant)."""
    return (weights.dense + weights.bm25 + weights.identifier + weights.recency
            + weights.session + weights.conversation)


def new_relevant(
    learned: Learned, ranked: list[Candidate], packed: BlockPack, shown: frozenset[str],
    cut: float, similarity: float = 0.0, weights: Weights | None = None,
) -> tuple[Learned, list[Candidate]]:
    """What a later block of a stable injection may carry: the items `packed` chose that the
    earlier blocks do not show (`unshown`), when the best of them by meaning has a raw cosine
    similarity of at least `similarity` to the query, and of those, the ones whose fused
    score is at least `cut`.

    The fused score ranks, but it cannot say whether anything matches at all: its dense and
    lexical signals are scaled to the query's best candidate, so some item always scores
    high. The raw cosine is on one scale for every query (the same model embeds both), so
    it is the gate: a question about something memory does not hold finds nothing new that
    close, and adds no block, where a fixed share would have been filled anyway. The cut
    then keeps, of a gated-in delta, the items the signals agree on. A turn's lifts for being
    the user's own or a standing statement (`weights`, ranking.lifted) do not count towards
    the cut: they would let any new turn of the user's in.
    """
    new, turns = unshown(learned, ranked, packed, shown)
    if similarity > 0:
        best = max((i.similarity for i in [*new.facts, *new.summaries, *new.shared]), default=0.0)
        if max([best, *(c.dense for c in turns)]) < similarity:
            return Learned(), []
    if cut <= 0:
        return new, turns

    def kept(items: list[LearnedItem]) -> list[LearnedItem]:
        return [i for i in items if i.score >= cut]

    return Learned(kept(new.facts), kept(new.summaries), new.profile, kept(new.shared)), [
        c for c in turns if c.score - (lifted(c, weights) if weights else 0.0) >= cut
    ]


def candidate_chunk(c: Candidate) -> int:
    """The chunk a turn candidate stands for (turn candidates are keyed "c<chunk id>")."""
    return int(c.key[1:])


def turn_item(c: Candidate) -> RecalledItem:
    """A ranked turn as an injected item."""
    return RecalledItem(
        "turn", c.key, c.turn_id, c.session_id, c.speaker, c.created_at, c.text, c.score,
        c.signals,
    )


def learned_item(item: LearnedItem) -> RecalledItem:
    """A fact, summary or profile as an injected item."""
    return RecalledItem(
        item.source, item.key, item.turn_ids[-1] if item.turn_ids else 0, item.session_id,
        item.source, item.created_at, item.text, item.score, item.signals, item.turn_ids,
    )

"""Recall, end to end: embed the query, search by meaning and by words, rank, pack.

One request's pipeline (docs/architecture.md, "Request flow"): the query is built from the
request's last user message, embedded once for turns and learned items alike, and searched in
parallel in the user's vectors and in the lexical index; the candidates are fused
(`memory.recall.ranking`), turns around the best ones lifted, each turn's best chunk put
first, long items cut to the part that matches and near-duplicates dropped
(`memory.recall.excerpt`), and the lot packed into the
budget (`memory.recall.outcome`). Results are kept while the user's memory is unchanged
(`memory.recall.cache`). While the local spool holds turns of the request's session, they
are read too (`memory.recall.spooled`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import numpy as np

from config import Settings
from memory import tracing
from memory.index.shared_vectors import SharedVectors
from memory.index.standing import STANDING
from memory.log.messages import TURN_ROLES, last_user_text, turn_text
from memory.log.turn_log import TurnLog
from memory.outages import is_outage
from memory.recall.cache import RecallCache, cache_key
from memory.recall.excerpt import excerpt_ranked, one_per_turn, query_terms
from memory.recall.learned_recall import Learned, LearnedRecall, given, owned
from memory.recall.lexical import ChunkSearch
from memory.recall.outcome import (
    Recalled,
    RecallRequest,
    candidate_chunk,
    learned_item,
    new_relevant,
    pack_ranked,
    score_ceiling,
    shared_memory,
    turn_item,
)
from memory.recall.query import build_query, for_embedding, identifiers, is_trivial
from memory.recall.ranking import (
    CONTEXT_SEEDS,
    Candidate,
    Weights,
    add_context,
    add_conversation,
    fuse,
    lift_standing,
    lift_user,
    signal_scores,
)
from memory.recall.rerank import Reranker, RerankReport, elapsed_ms
from memory.recall.speakers import SpeakerQuery
from memory.recall.spooled import SpoolRecall, spooled_candidates
from memory.storage import versions
from memory.storage.database import Database
from memory.storage.fts import search_terms
from memory.storage.turns import ChunkRow, NewTurn

# Standing statements searched a request (memory.index.standing): a user states a handful,
# and the lift would let more crowd out the turns that match.
STANDING_CANDIDATES = 4
# (user, session) -> the session's turns still waiting in the local spool, oldest first.
SpooledTurns = Callable[[str, str], Awaitable[list[NewTurn]]]


class RecallPipeline:
    """What one request should be reminded of, from the user's turns and learned items."""

    def __init__(
        self, settings: Settings, db: Database, log: TurnLog, *,
        shared_vectors: SharedVectors, learned_recall: LearnedRecall, weights: Weights,
        embed: Callable[[Sequence[str]], Awaitable[np.ndarray]],
        redact: Callable[[str], str],
    ) -> None:
        self.settings = settings
        self.db = db
        self.log = log
        self.shared_vectors = shared_vectors
        self.learned_recall = learned_recall
        self.weights = weights
        self.redact = redact
        self.lexical = ChunkSearch(db)
        self.speaker_query = SpeakerQuery(
            db, embed, weight=settings.query_name_weight, enabled=settings.query_split_names,
        )
        self.cache: RecallCache[Recalled] = RecallCache(settings.recall_cache_entries)
        # Its scorer is set by the engine when the proxy gives one (MEMPROXY_RERANK).
        self.reranker = Reranker(
            None, top_n=settings.rerank_candidates, timeout_ms=settings.rerank_timeout_ms,
            redact=redact,
        )
        # Set by the engine when it runs a spool (memory.log.spooling); returns [] at once
        # while the spool is empty.
        self.spooled: SpooledTurns | None = None

    async def cached_recall(self, request: RecallRequest) -> Recalled:
        """`recall`, or the result of the same request kept while the user's memory is
        unchanged (memory.recall.cache)."""
        with tracing.span("memproxy.recall") as span:
            return _described(span, request, await self._cached_recall(request))

    async def _cached_recall(self, request: RecallRequest) -> Recalled:
        spooled = await self._spooled(request)
        if self.cache.size <= 0 or spooled:
            # Spooled turns change no stamp of the database (which may not answer at all).
            return await self._recall(request, spooled)
        started = time.perf_counter()
        org = shared_memory(request)
        key = cache_key(
            request.user_id, request.session_id, request.model, request.budget, request.scope,
            org, sorted(request.shown), request.add_budget, request.relevance, request.similarity,
            request.rerank, messages=request.messages,
        )
        with tracing.db_span(self.db.dialect, "stamp", "memory_versions"):
            stamp = (
                await versions.stamp(self.db, request.user_id, request.session_id),
                None if org is None else await versions.stamp(self.db, org, ""),
            )
        kept = self.cache.get(key, stamp)
        if kept is not None:
            return replace(kept, cached=True, recall_ms=elapsed_ms(started), embed_ms=0.0)
        recalled = await self._recall(request, [])
        if recalled.rerank is None or recalled.rerank.fallback is None:
            self.cache.put(key, stamp, recalled)  # a fallback is not kept: the next try reranks
        return recalled

    async def recall(self, request: RecallRequest) -> Recalled:
        """Find, rank and pack what this request should be reminded of.

        Raises SpoolRecall, holding a block made of the session's spooled turns, when the
        database is unreachable and the spool holds turns of the request's session.
        """
        with tracing.span("memproxy.recall") as span:
            recalled = await self._recall(request, await self._spooled(request))
            return _described(span, request, recalled)

    async def _spooled(self, request: RecallRequest) -> list[NewTurn]:
        if self.spooled is None:
            return []
        return await self.spooled(request.user_id, request.session_id)

    async def _recall(self, request: RecallRequest, spooled: list[NewTurn]) -> Recalled:
        started = time.perf_counter()
        query = build_query(request.messages)
        if not query or is_trivial(last_user_text(request.messages)):
            return Recalled(skipped="trivial", recall_ms=elapsed_ms(started))
        present = "\n".join(turn_text(m) for m in request.messages)
        # Stored turns are redacted: compare them with the redacted messages too.
        if (redacted := self.redact(present)) != present:
            present += "\n" + redacted

        try:
            return await self._search(request, query, present, spooled, started)
        except Exception as exc:
            if not spooled or not is_outage(exc):
                raise
            raise SpoolRecall(self._from_spool(request, query, present, spooled, started)) from exc

    def _from_spool(
        self, request: RecallRequest, query: str, present: str, spooled: list[NewTurn],
        started: float,
    ) -> Recalled:
        """The block of the session's spooled turns alone (the database is unreachable)."""
        candidates = spooled_candidates(spooled, query, present, request.session_id)
        ranked = self._fused(request, query, candidates)
        # The whole block, not a stable injection's delta: `shown` is not looked at.
        return self._pack(replace(request, shown=frozenset()), Learned(), ranked, started, 0.0)

    async def _search(
        self, request: RecallRequest, query: str, present: str, spooled: list[NewTurn],
        started: float,
    ) -> Recalled:
        session = request.session_id if request.scope == "session" else None
        k, words = self.settings.recall_candidates, self.settings.query_embed_words
        org = shared_memory(request)

        async def by_meaning() -> tuple[list[tuple[str, float]], set[str], Learned, float]:
            # The query is embedded once, for turns and learned items alike.
            embedding = time.perf_counter()
            vector: np.ndarray | None = None
            if self.weights.dense:
                # Meanwhile: are the copies of the vectors to search still current?
                with tracing.span("memproxy.recall.embed_query"):
                    embedded, _ = await asyncio.gather(
                        self.speaker_query.embed(request.user_id, for_embedding(query, words)),
                        self.shared_vectors.refresh([request.user_id, *([org] if org else [])]),
                    )
                vector = embedded[0]
            embed_ms = elapsed_ms(embedding) if vector is not None else 0.0
            # Facts, summaries and the profile that match: no span of their own (they are
            # searched beside the turns; how many were found is on the rank span).
            dense, standing, learned, shared = await asyncio.gather(
                self._dense(request.user_id, session, vector, k),
                self._standing(request.user_id, session, vector),
                self.learned_recall.gather(
                    request.user_id, request.session_id, query, vector,
                    session_only=session is not None, present=present,
                ),
                self.learned_recall.shared(org, query, vector, present=present)
                if org is not None else given([]),
            )
            # A standing statement about the query is a candidate, found or not among the best.
            found = {key for key, _ in dense}
            dense += [(key, sim) for key, sim in standing if key not in found]
            return dense, {key for key, _ in standing}, replace(learned, shared=shared), embed_ms

        async def by_words() -> tuple[list[tuple[int, float]], list[ChunkRow]]:
            if not self.weights.bm25:
                return [], []
            # A database step (FTS5, or tsvector on PostgreSQL) and the rows it found.
            with tracing.db_span(self.db.dialect, "lexical_search", "chunks") as span:
                found = await self.lexical.search(request.user_id, query, k=k, session_id=session)
                rows = await self.log.get_chunks([chunk_id for chunk_id, _ in found])
                if span is not None:
                    span.set_attribute("memproxy.recall.candidates", len(found))
                return found, rows

        # A signal weighted 0 is not searched at all (that is how ablations run); the
        # lexical search, and reading what it found, runs while the query is embedded.
        (dense, standing, learned, embed_ms), (lexical, rows) = await asyncio.gather(
            by_meaning(), by_words()
        )
        # Ranking and packing: one span (a span costs more CPU than packing takes); what
        # was packed is on the recall span.
        with tracing.span("memproxy.recall.rank") as ranking:
            ranked = await self._rank(request, query, present, spooled, dense, lexical, rows)
            if standing:
                ranked = lift_standing(ranked, standing, self.weights.standing)
            report: RerankReport | None = None
            if request.rerank:
                reranked = await self.reranker.rerank(query, request.user_id, ranked, learned)
                ranked, learned, report = reranked.turns, reranked.learned, reranked.report
            ranked = await self._excerpt(query, ranked)
            recalled = replace(self._pack(request, learned, ranked, started, embed_ms),
                               rerank=report)
            if ranking is not None:
                ranking.set_attributes({"memproxy.recall.candidates": len(ranked) + len(learned),
                                        "memproxy.recall.learned": len(learned)})
            return recalled

    async def _rank(
        self, request: RecallRequest, query: str, present: str, spooled: list[NewTurn],
        dense: list[tuple[str, float]], lexical: list[tuple[int, float]], rows: list[ChunkRow],
    ) -> list[Candidate]:
        candidates = await self._candidates(request.user_id, present, dense, lexical, rows)
        if spooled:  # not in the database yet: matched by words, beside what it holds
            scale = max((c.bm25 for c in candidates.values()), default=0.0) or 1.0
            stored = {_same_text(c.text) for c in candidates.values()}
            candidates |= {
                key: c for key, c in spooled_candidates(
                    spooled, query, present, request.session_id, scale=scale).items()
                if _same_text(c.text) not in stored
            }
        ranked = self._fused(request, query, candidates)
        if self.weights.conversation:
            ranked = add_conversation(ranked, self.weights.conversation)
        if self.weights.context and ranked:
            ranked = await self._with_context(request.user_id, present, ranked)
        if self.weights.user:
            ranked = lift_user(ranked, self.weights.user)
        return ranked

    def _fused(
        self, request: RecallRequest, query: str, candidates: dict[str, Candidate]
    ) -> list[Candidate]:
        return fuse(candidates, self.weights, session_id=request.session_id,
                    query_identifiers=identifiers(query), now=time.time())

    async def _excerpt(self, query: str, ranked: list[Candidate]) -> list[Candidate]:
        """Each turn's best chunk first, long items cut to the part that matches,
        near-duplicates dropped (memory.recall.excerpt); the words' counts were read by the
        lexical search."""
        ranked = one_per_turn(ranked)
        cap = self.settings.recall_excerpt_tokens
        if cap <= 0 or not ranked:
            return ranked
        terms = search_terms(query)
        counts = await self.lexical.terms.counts(terms) if self.weights.bm25 else dict.fromkeys(terms, 0)
        return excerpt_ranked(ranked, query_terms(counts), cap)

    def _pack(
        self, request: RecallRequest, learned: Learned, ranked: list[Candidate], started: float,
        embed_ms: float,
    ) -> Recalled:
        share = self.settings.org_budget_share
        packed = pack_ranked(learned, ranked, request.budget, request.model, share)
        if request.shown:  # a later block of a stable injection (outcome.new_relevant)
            add = request.budget if request.add_budget is None else request.add_budget
            cut = request.relevance * score_ceiling(self.weights)
            learned, ranked = new_relevant(
                learned, ranked, packed, request.shown, cut, request.similarity, self.weights,
            )
            packed = pack_ranked(learned, ranked, min(add, request.budget), request.model, share,
                                 later=True)
        items = [
            *map(learned_item, packed.chosen(learned)), *(turn_item(ranked[i]) for i in packed.turns)
        ]
        return Recalled(
            packed.block, items, packed.tokens, packed.truncated, len(ranked) + len(learned),
            elapsed_ms(started), embed_ms,
        )

    async def _dense(
        self, user_id: str, session_id: str | None, vector: np.ndarray | None, k: int
    ) -> list[tuple[str, float]]:
        if vector is None:
            return []
        # Facts, summaries and profiles share the collection: only turn chunks here.
        with tracing.span("memproxy.recall.dense_search") as span:
            found = await self.shared_vectors.query(vector, k=k,
                                                    where=owned(user_id, "turn", session_id))
            if span is not None:
                span.set_attribute("memproxy.recall.candidates", len(found))
            return found

    async def _standing(
        self, user_id: str, session_id: str | None, vector: np.ndarray | None
    ) -> list[tuple[str, float]]:
        """The user's standing statements (memory.index.standing) about the query: those
        with a raw cosine similarity of at least recall_standing_similarity, best first."""
        if vector is None or not self.weights.standing:
            return []
        where = {**owned(user_id, "turn", session_id), STANDING: True}
        found = await self.shared_vectors.query(vector, k=STANDING_CANDIDATES, where=where)
        floor = self.settings.recall_standing_similarity
        return [(key, similarity) for key, similarity in found if similarity >= floor]

    async def _chunks(self, ids: list[int]) -> list[ChunkRow]:
        """The chunks `ids` name, read from the database (a database step of recall)."""
        if not ids:
            return []
        with tracing.db_span(self.db.dialect, "read", "chunks"):
            return await self.log.get_chunks(ids)  # the candidates' rows, or their neighbours

    async def _candidates(
        self, user_id: str, present: str, dense: list[tuple[str, float]],
        lexical: list[tuple[int, float]], read: list[ChunkRow],
    ) -> dict[str, Candidate]:
        """One candidate per distinct text found; `read` holds rows already read."""
        scores = signal_scores(dense, lexical)
        have = {row.id for row in read}
        unread = [chunk_id for chunk_id in scores if chunk_id not in have]
        # The same text can be stored more than once (an edited history's branches, a reply
        # logged before the client resent it with a name): one candidate per text, with the
        # best of each signal, shown under a name when any copy has one.
        by_text: dict[str, Candidate] = {}
        for row in [*read, *await self._chunks(unread)]:
            if row.user_id != user_id or row.text.strip() in present:
                continue  # already in the prompt (or, defensively, not this user's)
            dense_score, bm25 = scores[row.id]
            found = by_text.get(same := _same_text(row.text))
            if found is None:
                by_text[same] = _candidate(row, dense_score, bm25)
                continue
            found.dense, found.bm25 = max(found.dense, dense_score), max(found.bm25, bm25)
            if row.name and found.speaker in TURN_ROLES:
                found.key, found.turn_id, found.speaker = f"c{row.id}", row.turn_id, row.name
                found.role = row.role
                found.session_id, found.created_at = row.session_id, row.created_at
        return {c.key: c for c in by_text.values()}

    async def _with_context(
        self, user_id: str, present: str, ranked: list[Candidate]
    ) -> list[Candidate]:
        """The ranking with the turns around the best items lifted (ranking.add_context)."""
        seeds = ranked[:CONTEXT_SEEDS]
        pairs = await self.log.neighbour_chunks([candidate_chunk(c) for c in seeds])
        known = {c.key for c in ranked}
        by_text = {_same_text(c.text): c.key for c in ranked}
        alias: dict[str, str] = {}
        added: dict[str, Candidate] = {}
        unknown = list(dict.fromkeys(n for _, n in pairs if f"c{n}" not in known))
        for row in await self._chunks(unknown):
            if row.user_id != user_id or row.text.strip() in present:
                continue
            same = by_text.setdefault(_same_text(row.text), f"c{row.id}")
            if same == f"c{row.id}":
                added[same] = _candidate(row, 0.0, 0.0)
            alias[f"c{row.id}"] = same
        neighbours: dict[str, list[str]] = {}
        for seed, neighbour in pairs:
            key = f"c{neighbour}"
            if key in known or key in alias:
                neighbours.setdefault(f"c{seed}", []).append(alias.get(key, key))
        return add_context(ranked, neighbours, added, self.weights.context)


def _candidate(row: ChunkRow, dense: float, bm25: float) -> Candidate:
    return Candidate(
        f"c{row.id}", row.session_id, row.created_at, row.text, speaker=row.name or row.role,
        turn_id=row.turn_id, dense=dense, bm25=bm25, role=row.role,
    )


def _same_text(text: str) -> str:
    return " ".join(text.split())


def _described(
    span: tracing.Span | None, request: RecallRequest, recalled: Recalled
) -> Recalled:
    """`recalled`, its span (if any) given its attributes: what was asked and found (never
    the text)."""
    if span is None:
        return recalled
    span.set_attributes({
        "memproxy.recall.budget": request.budget, "memproxy.recall.scope": request.scope,
        "memproxy.recall.candidates": recalled.candidates,
        "memproxy.recall.items": len(recalled.items),
        "memproxy.recall.injected_tokens": recalled.tokens,
        "memproxy.recall.cache_hit": recalled.cached,
        "memproxy.recall.truncated": recalled.truncated,
        **({"memproxy.recall.skipped": recalled.skipped} if recalled.skipped else {}),
    })
    return recalled

"""The memory engine: remember turns, index them in the background, recall within a budget."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
from threadpoolctl import threadpool_limits

from config import Settings
from memory.admin.manage import Management
from memory.index.chunking import chunk_text
from memory.index.embeddings import LocalEmbedder, UnavailableEmbedder, find_model_dir
from memory.index.learned_vectors import LearnedVectors
from memory.index.quantized import int8_model_dir
from memory.index.rebuild import VectorRebuild
from memory.index.shared_vectors import SharedVectors
from memory.index.vectors import VectorIndex
from memory.jobs.queue import JobQueue
from memory.jobs.worker import JobWorker
from memory.learning.facts import SYNC_JOB, FactStore
from memory.learning.learner import DEFAULT_ROUTE, EXTRACT_JOB, LLM, SUMMARY_JOB, Learner
from memory.learning.lifecycle import prune_all, purge_expired
from memory.learning.profiles import ProfileStore
from memory.learning.summaries import SummaryStore
from memory.log.messages import TURN_ROLES, last_user_text, turn_text
from memory.log.turn_log import INDEX_JOB, ReplyChain, TurnLog
from memory.recall.cache import RecallCache, cache_key
from memory.recall.learned_recall import Learned, LearnedItem, LearnedRecall
from memory.recall.lexical import ChunkSearch
from memory.recall.outcome import (
    Recalled,
    RecallRequest,
    candidate_chunk,
    learned_item,
    pack_ranked,
    shared_memory,
    turn_item,
    unshown,
)
from memory.recall.query import build_query, for_embedding, identifiers, is_trivial
from memory.recall.ranking import (
    CONTEXT_SEEDS,
    Candidate,
    Weights,
    add_context,
    add_conversation,
    fuse,
)
from memory.recall.speakers import SpeakerQuery
from memory.redact import Redactor
from memory.storage import injections, metrics, versions
from memory.storage.database import Database, Transaction, open_database
from memory.storage.injections import Injection
from memory.storage.metrics import RequestMetrics
from memory.storage.turns import ChunkRow, NewTurn
from memory.tokens import count_tokens, ensure_offline_tiktoken, load_encodings

MAINTENANCE_INTERVAL = 3600.0
DONE_JOB_RETENTION = 7 * 86400.0
CHUNK_COUNT_MODEL = "gpt-4"
log = logging.getLogger("memproxy.memory")  # chunk caps are model-agnostic: cl100k_base


class Embedder(Protocol):
    """Anything that turns texts into unit vectors."""

    async def embed(self, texts: Sequence[str]) -> np.ndarray: ...


class MemoryEngine:
    """Storage, vectors, embeddings and the job worker, behind recall and remember."""

    def __init__(
        self, settings: Settings, db: Database, vectors: VectorIndex, embedder: Embedder
    ) -> None:
        self.settings = settings
        self.db = db
        # Every turn, fact, summary and imported record is redacted before it is stored.
        self.redact = Redactor(settings.redact)
        self.log = TurnLog(db, redact=self.redact)
        self.queue = JobQueue(db, lease_seconds=settings.job_lease_seconds)
        self.lexical = ChunkSearch(db)
        self.speaker_query = SpeakerQuery(
            db, embedder.embed, weight=settings.query_name_weight,
            enabled=settings.query_split_names,
        )
        self.vectors = vectors
        # Every search and write of users' vectors goes through this (index/shared_vectors.py).
        self.shared_vectors = SharedVectors(db, vectors)
        self.embedder = embedder
        self.weights = Weights(
            settings.weight_dense, settings.weight_bm25, settings.weight_identifier,
            settings.weight_recency, settings.weight_session, settings.recency_half_life_days,
            settings.weight_context, settings.weight_conversation,
        )
        self._maintenance: asyncio.Task[None] | None = None
        self.recall_cache: RecallCache[Recalled] = RecallCache(settings.recall_cache_entries)
        # Index jobs embed one at a time, each on embedding_threads threads: measured on 2
        # cores, nearly as fast as two jobs of one thread each (27 vs 29 turns/s, the same CPU
        # per turn), while a query's embedding still gets both cores when they are free.
        self._indexing = asyncio.Lock()
        self.facts = FactStore(
            db, lifetimes_days=settings.fact_lifetimes_days(),
            max_pinned=settings.fact_max_pinned, redact=self.redact, notify=self._notify,
        )
        # Vectors lost under the running engine are rebuilt from the database.
        self.rebuild = VectorRebuild(
            db, vectors, index_job=INDEX_JOB, max_attempts=settings.job_max_attempts,
            notify=self._notify,
        )
        self.summaries = SummaryStore(db, redact=self.redact, notify=self._notify)
        self.profiles = ProfileStore(db, redact=self.redact, notify=self._notify)
        self.learned_vectors = LearnedVectors(
            db, self.profiles, self.shared_vectors, embedder.embed
        )
        self.manage = Management(
            settings, self.log, self.shared_vectors, self.facts, self.summaries, self.profiles,
            index_job=INDEX_JOB, notify=self._notify,
        )
        self.learned_recall = LearnedRecall(
            self.facts, self.summaries, self.profiles, self.shared_vectors, self.weights,
            k=settings.recall_candidates,
        )
        self.learner = Learner(
            settings, self.log, self.facts, self.summaries, self.shared_vectors, embedder.embed
        )
        self.worker = JobWorker(
            self.queue, {
                INDEX_JOB: self._index_job, SYNC_JOB: self.learned_vectors.sync,
                EXTRACT_JOB: self.learner.extract, SUMMARY_JOB: self.learner.summarize,
                **self.manage.handlers,
            },
            batch_handlers={INDEX_JOB: self._index_jobs}, batch_size=settings.index_batch_jobs,
            concurrency=settings.job_concurrency, backoff_base=settings.job_backoff_seconds,
        )

    def _notify(self) -> None:
        self.worker.notify()

    @classmethod
    async def open(
        cls, settings: Settings, *, embedder: Embedder | None = None, llm: LLM | None = None
    ) -> MemoryEngine:
        """Open the database, the vector index and the model, then start the worker.

        `llm` answers the learning jobs (facts, summaries); without one nothing is learned.
        """
        ensure_offline_tiktoken()
        # Process-wide: numpy's OpenBLAS keeps idle worker threads busy-waiting, and the
        # products recall needs (one query against a user's vectors) gain nothing from them.
        # Measured at 10k turns: 45 -> 24 ms of CPU per recall with one BLAS thread.
        threadpool_limits(1, user_api="blas")
        db = await open_database(settings.database_url, settings.db_path)
        try:
            # The first recall after a start waited 2.3 s for these (counting its block).
            await asyncio.to_thread(load_encodings)
            cache_bytes = settings.vector_cache_mb * 1024 * 1024
            if settings.chroma_url:
                vectors = await asyncio.to_thread(
                    VectorIndex.connect, settings.chroma_url, collection_name(settings),
                    cache_bytes=cache_bytes,
                )
            else:
                vectors = await asyncio.to_thread(
                    VectorIndex.open, settings.vectors_path, collection_name(settings),
                    cache_bytes=cache_bytes,
                )
            if embedder is None:
                embedder = _local_embedder(settings)
        except BaseException:
            await db.close()
            raise
        engine = cls(settings, db, vectors, embedder)
        engine.learner.llm = llm
        await engine.rebuild.fill_if_new(vectors)
        await engine.worker.start()
        engine._maintenance = asyncio.get_running_loop().create_task(engine._maintain())
        return engine

    async def stop_jobs(self, timeout: float) -> None:
        """Claim no more jobs; running ones get `timeout` seconds, then go back to the queue."""
        await self.worker.stop(timeout)

    async def close(self, timeout: float = 10.0) -> None:
        """Stop the worker (unfinished jobs stay queued; after stop_jobs this waits for that
        stop), then close stores."""
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
        await self.worker.stop(timeout)
        await self.rebuild.close()
        await asyncio.to_thread(self.vectors.close)
        await self.db.close()

    async def health(self) -> dict[str, str]:
        """Each dependency's state: "ok" or the error it raised."""
        probes = {
            "database": self.db.check(),
            "vectors": asyncio.to_thread(self.vectors.count),
            "embeddings": self.embedder.embed(["ready?"]),
        }
        parts = {}
        for name, probe in probes.items():
            try:
                await probe
                parts[name] = "ok"
            except Exception as exc:
                parts[name] = f"error: {type(exc).__name__}: {exc}"[:200]
        if parts["vectors"] == "ok" and (rebuilding := await self.rebuild.progress()):
            parts["vectors"] = rebuilding
        return parts

    async def prune(self, now: float | None = None) -> dict[str, int]:
        """Drop metrics rows past retention, finished jobs older than a week, long-expired
        facts, and evict facts of users above `fact_prune_at`."""
        now = time.time() if now is None else now
        retention = self.settings.metrics_retention_days * 86400.0
        expired_cutoff = now - self.settings.fact_expired_retention_days * 86400.0
        keep = min(self.settings.fact_prune_at, self.settings.fact_cap)
        async with self.db.autocommit() as tx:
            pruned_metrics = await metrics.prune(tx, now - retention)
        return {
            "request_metrics": pruned_metrics,
            "done_jobs": await self.queue.prune_done_jobs(now - DONE_JOB_RETENTION),
            "expired_facts": await purge_expired(self.facts, expired_cutoff),
            "evicted_facts": await prune_all(self.facts, keep, now),
        }

    async def _maintain(self) -> None:
        while True:
            try:
                await self.prune()
                # After a crash, only users changed within the last interval load from Chroma.
                await asyncio.to_thread(self.vectors.save_copies)
            except Exception:  # retried next round; never kills the engine
                log.warning("pruning failed", exc_info=True)
            await asyncio.sleep(MAINTENANCE_INTERVAL)

    # -- remember

    async def remember_request(
        self, user_id: str, session_id: str, messages: Sequence[Mapping[str, Any]], *,
        model: str, request_id: str, after: int | None = None,
        injected: tuple[int, Injection] | None = None,
    ) -> int | None:
        """Store the request's turns (each once, however often resent); return the last id.

        `after`: the stored turn these messages continue (a request that sends only its
        new messages, like a Responses API call with `previous_response_id`).
        `injected`: the memory block placed at `messages[index]`, kept with that turn so
        the session's later requests put it back (placed_blocks).
        """
        now = time.time()
        turns, at = _new_turns(messages, model=model, request_id=request_id, now=now)
        if not turns:
            return after
        result = await self.log.append_turns(
            user_id, session_id, turns, after=after, job_kind=INDEX_JOB,
            max_attempts=self.settings.job_max_attempts,
        )
        if result.new_ids:
            self.worker.notify()
        if injected is not None and injected[0] in at:
            async with self.db.write() as tx:
                await injections.put(
                    tx, user_id, session_id, result.ids[at.index(injected[0])], injected[1], now
                )
        return result.last_id

    async def placed_blocks(
        self, user_id: str, session_id: str, messages: Sequence[Mapping[str, Any]], *,
        after: int | None = None,
    ) -> dict[int, Injection]:
        """{index into `messages`: the block kept with that stored turn} for the request's
        messages that earlier requests of the session injected a block at."""
        turns, at = _new_turns(messages, model="", request_id=None, now=0.0, count=False)
        ids = await self.log.locate(user_id, session_id, turns, after=after)
        kept = await injections.of_turns(self.db, user_id, ids) if ids else {}
        return {at[i]: kept[turn_id] for i, turn_id in enumerate(ids) if turn_id in kept}

    async def session_summary(
        self, user_id: str, session_id: str, *, through: int | None, model: str,
        route: str = DEFAULT_ROUTE,
    ) -> str | None:
        """The session's current summary; with none, one is made now of the conversation
        ending at turn `through` (one call to the learning model). None when there is none."""
        latest = await self.summaries.latest(user_id, session_id)
        if latest is None and through is not None:
            await self.learner.summarize({
                "user_id": user_id, "session_id": session_id, "turn_id": through,
                "model": self.settings.extract_model or model, "route": route,
            })
            latest = await self.summaries.latest(user_id, session_id)
        return latest.text if latest is not None else None

    async def reply_chain(self, user_id: str, reply_id: str, *, limit: int = 40) -> ReplyChain | None:
        """The stored conversation ending at the reply remembered under `reply_id`."""
        return await self.log.reply_chain(user_id, reply_id, limit)

    async def remember_reply(
        self, user_id: str, session_id: str, after: int | None, text: str, *,
        model: str, request_id: str, incomplete: bool, route: str = DEFAULT_ROUTE,
    ) -> None:
        """Store the assistant's reply after the turn it answers; its learning jobs go
        through `route`, the way in that served the conversation."""
        turn = NewTurn(
            role="assistant", content=text, created_at=time.time(), model=model,
            tokens=count_tokens(text, model), request_id=request_id, incomplete=incomplete,
        )
        async def learn(tx: Transaction, turn_id: int) -> None:
            await self.learner.queue_after_reply(tx, user_id, session_id, turn_id, model, route)

        result = await self.log.append_turns(
            user_id, session_id, [turn], after=after, job_kind=INDEX_JOB,
            max_attempts=self.settings.job_max_attempts, then=learn,
        )
        if result.new_ids:
            self.worker.notify()

    async def record(self, row: RequestMetrics) -> None:
        """Keep one per-request metrics row."""
        async with self.db.autocommit() as tx:
            await metrics.insert(tx, row)

    async def _index_job(self, payload: dict[str, Any]) -> None:
        await self._index_jobs([payload])

    async def _index_jobs(self, payloads: list[dict[str, Any]]) -> None:
        """Chunk the jobs' turns, embed every chunk in one call and add them in one write."""
        turn_ids = dict.fromkeys(i for payload in payloads for i in payload["turn_ids"])
        turns = await self.log.get_turns(list(turn_ids))
        ids: list[str] = []
        texts: list[str] = []
        metas: list[dict[str, str | int | float | bool]] = []
        for turn in turns:
            chunks = chunk_text(
                turn.content, max_tokens=self.settings.chunk_max_tokens,
                count=lambda t: count_tokens(t, CHUNK_COUNT_MODEL),
            )
            chunk_ids = await self.log.add_chunks(
                turn.id, [(c.ordinal, c.kind, c.text, c.tokens) for c in chunks]
            )
            speaker = turn.name or turn.role
            for chunk, chunk_id in zip(chunks, chunk_ids, strict=True):
                ids.append(f"c{chunk_id}")
                texts.append(f"{speaker}: {chunk.text}")
                metas.append({
                    "user_id": turn.user_id, "session_id": turn.session_id,
                    "turn_id": turn.id, "source": "turn", "created_at": turn.created_at,
                })
        if ids:
            async with self._indexing:
                vectors = await self.embedder.embed(texts)
            await self.shared_vectors.add(ids, vectors, metas)

    # -- recall

    async def cached_recall(self, request: RecallRequest) -> Recalled:
        """`recall`, or the result of the same request kept while the user's memory is
        unchanged (memory.recall.cache)."""
        if self.recall_cache.size <= 0:
            return await self.recall(request)
        started = time.perf_counter()
        org = shared_memory(request)
        key = cache_key(
            request.user_id, request.session_id, request.model, request.budget, request.scope,
            org, sorted(request.shown), request.add_budget, messages=request.messages,
        )
        stamp = (
            await versions.stamp(self.db, request.user_id, request.session_id),
            None if org is None else await versions.stamp(self.db, org, ""),
        )
        kept = self.recall_cache.get(key, stamp)
        if kept is not None:
            return replace(kept, cached=True, recall_ms=_ms(started), embed_ms=0.0)
        recalled = await self.recall(request)
        self.recall_cache.put(key, stamp, recalled)
        return recalled

    async def recall(self, request: RecallRequest) -> Recalled:
        """Find, rank and pack what this request should be reminded of."""
        started = time.perf_counter()
        query = build_query(request.messages)
        if not query or is_trivial(last_user_text(request.messages)):
            return Recalled(skipped="trivial", recall_ms=_ms(started))
        session = request.session_id if request.scope == "session" else None
        k, words = self.settings.recall_candidates, self.settings.query_embed_words
        present = "\n".join(turn_text(m) for m in request.messages)
        # Stored turns are redacted: compare them with the redacted messages too.
        if (redacted := self.redact(present)) != present:
            present += "\n" + redacted

        org = shared_memory(request)

        async def by_meaning() -> tuple[list[tuple[str, float]], Learned, float]:
            # The query is embedded once, for turns and learned items alike.
            embedding = time.perf_counter()
            vector: np.ndarray | None = None
            if self.weights.dense:
                # Meanwhile: are the copies of the vectors to search still current?
                embedded, _ = await asyncio.gather(
                    self.speaker_query.embed(request.user_id, for_embedding(query, words)),
                    self.shared_vectors.refresh([request.user_id, *([org] if org else [])]),
                )
                vector = embedded[0]
            embed_ms = _ms(embedding) if vector is not None else 0.0
            dense, learned, shared = await asyncio.gather(
                self._dense(request.user_id, session, vector, k),
                self.learned_recall.gather(
                    request.user_id, request.session_id, query, vector,
                    session_only=session is not None, present=present,
                ),
                self.learned_recall.shared(org, query, vector, present=present)
                if org is not None else _no_items(),
            )
            return dense, replace(learned, shared=shared), embed_ms

        async def by_words() -> tuple[list[tuple[int, float]], list[ChunkRow]]:
            if not self.weights.bm25:
                return [], []
            found = await self.lexical.search(request.user_id, query, k=k, session_id=session)
            return found, await self.log.get_chunks([chunk_id for chunk_id, _ in found])

        # A signal weighted 0 is not searched at all (that is how ablations run); the
        # lexical search, and reading what it found, runs while the query is embedded.
        (dense, learned, embed_ms), (lexical, rows) = await asyncio.gather(
            by_meaning(), by_words()
        )
        candidates = await self._candidates(request.user_id, present, dense, lexical, rows)
        ranked = fuse(
            candidates, self.weights, session_id=request.session_id,
            query_identifiers=identifiers(query), now=time.time(),
        )
        if self.weights.conversation:
            ranked = add_conversation(ranked, self.weights.conversation)
        if self.weights.context and ranked:
            ranked = await self._with_context(request.user_id, present, ranked)
        share = self.settings.org_budget_share
        packed = pack_ranked(learned, ranked, request.budget, request.model, share)
        add = request.budget if not request.shown or request.add_budget is None else request.add_budget
        if packed.tokens > add or not request.shown.isdisjoint(
            item.key for item in packed.chosen(learned)
        ) or any(ranked[i].key in request.shown for i in packed.turns):
            learned, ranked = unshown(learned, ranked, packed, request.shown)
            packed = pack_ranked(learned, ranked, min(add, request.budget), request.model, share)
        items = [
            *map(learned_item, packed.chosen(learned)), *(turn_item(ranked[i]) for i in packed.turns)
        ]
        return Recalled(
            packed.block, items, packed.tokens, packed.truncated, len(ranked) + len(learned),
            _ms(started), embed_ms,
        )

    async def _dense(
        self, user_id: str, session_id: str | None, vector: np.ndarray | None, k: int
    ) -> list[tuple[str, float]]:
        if vector is None:
            return []
        # Facts, summaries and profiles share the collection: only turn chunks here.
        where = {"user_id": user_id, "source": "turn"} if session_id is None else {
            "user_id": user_id, "session_id": session_id, "source": "turn",
        }
        return await self.shared_vectors.query(vector, k=k, where=where)

    async def _candidates(
        self, user_id: str, present: str, dense: list[tuple[str, float]],
        lexical: list[tuple[int, float]], read: list[ChunkRow],
    ) -> dict[str, Candidate]:
        """One candidate per distinct text found; `read` holds rows already read."""
        scores: dict[int, list[float]] = {}
        for key, similarity in dense:
            scores.setdefault(int(key[1:]), [0.0, 0.0])[0] = similarity
        for chunk_id, bm25 in lexical:
            scores.setdefault(chunk_id, [0.0, 0.0])[1] = bm25
        have = {row.id for row in read}
        unread = [chunk_id for chunk_id in scores if chunk_id not in have]
        # The same text can be stored more than once (an edited history's branches, a reply
        # logged before the client resent it with a name): one candidate per text, with the
        # best of each signal, shown under a name when any copy has one.
        by_text: dict[str, Candidate] = {}
        for row in [*read, *await self.log.get_chunks(unread)]:
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
        for row in await self.log.get_chunks(unknown):
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


def _new_turns(
    messages: Sequence[Mapping[str, Any]], *, model: str, request_id: str | None, now: float,
    count: bool = True,
) -> tuple[list[NewTurn], list[int]]:
    """The turns memory keeps of `messages`, and the index of the message each came from."""
    turns: list[NewTurn] = []
    at: list[int] = []
    for i, m in enumerate(messages):
        if m.get("role") in TURN_ROLES and (text := turn_text(m)):
            turns.append(NewTurn(
                role=m["role"], content=text, name=m.get("name"), created_at=now, model=model,
                tokens=count_tokens(text, model) if count else 0, request_id=request_id,
            ))
            at.append(i)
    return turns, at


def _candidate(row: ChunkRow, dense: float, bm25: float) -> Candidate:
    return Candidate(
        f"c{row.id}", row.session_id, row.created_at, row.text, speaker=row.name or row.role,
        turn_id=row.turn_id, dense=dense, bm25=bm25,
    )


def _same_text(text: str) -> str:
    return " ".join(text.split())


def _local_embedder(settings: Settings) -> Embedder:
    """The local model, or, when it is missing or will not load, a stand-in that raises
    that error: memory degrades (X-Memory-Error, /readyz names "embeddings") and the proxy
    still serves, instead of not starting at all."""
    try:
        model_dir = find_model_dir(settings.embedding_model_dir)
        if settings.embedding_precision == "int8":
            model_dir = int8_model_dir(model_dir, settings.data_dir)
        return LocalEmbedder(model_dir, threads=settings.embedding_threads)
    except Exception as exc:  # missing files, onnxruntime/tokenizers refusing them, a bad int8 copy
        log.error("embedding model unavailable; memory runs degraded: %s", exc)
        return UnavailableEmbedder(exc)


def collection_name(settings: Settings) -> str:
    """One collection per embedding model: vectors of different models never mix."""
    if settings.embedding_backend == "local":
        return "chunks-minilm-l6" + ("-int8" if settings.embedding_precision == "int8" else "")
    slug = "".join(ch if ch.isalnum() else "-" for ch in settings.embedding_upstream_model)
    return f"chunks-{slug}"[:60]


async def _no_items() -> list[LearnedItem]:
    return []


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)

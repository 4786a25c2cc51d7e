"""The memory engine: the wiring and lifecycle of storage, vectors, the model and the job
worker, behind remember and recall (recall in memory/recall/pipeline.py, index jobs in
memory/index/turn_index.py, upkeep in memory/jobs/maintenance.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from threadpoolctl import threadpool_limits

from config import Settings
from config.settings import without_password
from memory import tracing
from memory.admin.api_keys import KeyStore
from memory.admin.manage import Management
from memory.admin.rates import SharedBuckets
from memory.admin.usage import UsageLedger
from memory.index.embeddings import LocalEmbedder, UnavailableEmbedder, find_model_dir
from memory.index.learned_vectors import LearnedVectors
from memory.index.quantized import int8_model_dir
from memory.index.rebuild import VectorRebuild
from memory.index.shared_vectors import SharedVectors
from memory.index.turn_index import TurnIndexer
from memory.index.vectors import VectorIndex, check_server
from memory.jobs.maintenance import Maintenance
from memory.jobs.queue import JobQueue
from memory.jobs.worker import JobWorker
from memory.learning.facts import SYNC_JOB, FactStore
from memory.learning.learner import DEFAULT_ROUTE, EXTRACT_JOB, LLM, SUMMARY_JOB, Learner
from memory.learning.profiles import ProfileStore
from memory.learning.summaries import SummaryStore
from memory.log.spooling import Spooled, Spooling
from memory.log.turn_log import INDEX_JOB, ReplyChain, TurnLog, counted_turns, new_turns
from memory.outages import is_outage
from memory.recall.learned_recall import LearnedRecall
from memory.recall.outcome import Recalled, RecallRequest
from memory.recall.pipeline import RecallPipeline
from memory.recall.ranking import Weights
from memory.recall.rerank import Scorer
from memory.recall.unsaved_blocks import Stamp as UnsavedStamp
from memory.recall.unsaved_blocks import UnsavedBlocks
from memory.redact import Redactor
from memory.storage import injections, metrics, versions
from memory.storage.database import Database, Transaction, open_database
from memory.storage.facts import Fact
from memory.storage.file_modes import open_data_dir
from memory.storage.injections import Injection
from memory.storage.metrics import RequestMetrics
from memory.storage.spool import SpoolFile
from memory.storage.turns import NewTurn
from memory.tokens import count_tokens, ensure_offline_tiktoken, load_encodings, off_loop

log = logging.getLogger("memproxy.memory")


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
        self.keys = KeyStore(db)  # proxy keys kept in the database (docs/keys.md)
        self.queue = JobQueue(db, lease_seconds=settings.job_lease_seconds)
        self.usage = UsageLedger(db)  # requests and tokens per day, key and user
        self.rates = SharedBuckets(db)  # request-rate buckets of proxy keys, every replica's
        self.vectors = vectors
        # Every search and write of users' vectors goes through this (index/shared_vectors.py).
        self.shared_vectors = SharedVectors(db, vectors)
        self.embedder = embedder
        self.weights = Weights.of(settings)
        self._maintenance: asyncio.Task[None] | None = None
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
        self.recaller = RecallPipeline(
            settings, db, self.log, shared_vectors=self.shared_vectors,
            learned_recall=self.learned_recall, weights=self.weights, embed=embedder.embed,
            redact=self.redact,
        )
        self.lexical = self.recaller.lexical
        # Stable injection's blocks of sessions that write nothing: in this process only.
        self.unsaved = UnsavedBlocks(settings.unsaved_blocks_entries,
                                     settings.unsaved_blocks_mb * 1024 * 1024)
        self.indexer = TurnIndexer(settings, self.log, self.shared_vectors, embedder.embed)
        self.maintenance = Maintenance(settings, db, self.queue, self.facts, vectors)
        self.learner = Learner(
            settings, self.log, self.facts, self.summaries, self.shared_vectors, embedder.embed
        )
        self.worker = JobWorker(
            self.queue, {
                INDEX_JOB: self.indexer.index_job, SYNC_JOB: self.learned_vectors.sync,
                EXTRACT_JOB: self.learner.extract, SUMMARY_JOB: self.learner.summarize,
                **self.manage.handlers,
            },
            batch_handlers={INDEX_JOB: self.indexer.index_jobs}, batch_size=settings.index_batch_jobs,
            concurrency=settings.job_concurrency, backoff_base=settings.job_backoff_seconds,
            outage_backoff_max=settings.job_outage_backoff_max_seconds,
        )

        # Turns the database cannot take wait here (memory.log.spooling); set by open().
        self.spooling: Spooling | None = None

    def _notify(self) -> None:
        self.worker.notify()

    async def open_spool(self) -> None:
        """Open the local spool (MEMPROXY_SPOOL_MAX_TURNS > 0) and replay what it holds."""
        if self.settings.spool_max_turns <= 0:
            return
        self.spooling = Spooling(
            await SpoolFile.open(self.settings.spool_path), max_turns=self.settings.spool_max_turns,
            replay=self._append_path, backoff_max=self.settings.job_outage_backoff_max_seconds,
            redact=self.redact, share=self.settings.spool_max_turns_per_user,
        )
        self.recaller.spooled = self._spooled_turns
        self.spooling.start()

    async def _spooled_turns(self, user_id: str, session_id: str) -> list[NewTurn]:
        """The session's turns waiting in the spool; nothing is read while it is empty."""
        spooling = self.spooling
        if spooling is None or not spooling.active:
            return []
        return await spooling.session_turns(user_id, session_id)

    def spool_full(self, user_id: str) -> bool:
        """Whether the spool holds its bound, or this user's share of it: the user's
        request that would store turns is refused."""
        return self.spooling is not None and self.spooling.full(user_id)

    def spool_status(self) -> tuple[int, float | None]:
        """(turns waiting in the spool, seconds the oldest has waited or None)."""
        if self.spooling is None:
            return 0, None
        return self.spooling.depth, self.spooling.oldest_age()

    @classmethod
    async def open(
        cls, settings: Settings, *, embedder: Embedder | None = None, llm: LLM | None = None,
        rerank: Scorer | None = None,
    ) -> MemoryEngine:
        """Open the database, the vector index and the model, then start the worker.

        `llm` answers the learning jobs (facts, summaries); without one nothing is learned.
        `rerank` scores recall's best candidates (memory.recall.rerank); without one a
        request that asks for rerank keeps the fused order.
        """
        ensure_offline_tiktoken()
        # Process-wide: numpy's OpenBLAS keeps idle worker threads busy-waiting, and the
        # products recall needs (one query against a user's vectors) gain nothing from them.
        # The busy-waiting cost about 20 ms of CPU per recall (docs/dependencies.md).
        threadpool_limits(1, user_api="blas")
        # 0700, or a warning when an existing one lets other accounts in (file_modes.py).
        await asyncio.to_thread(open_data_dir, settings.data_dir)
        db = await open_database(settings.database_url, settings.db_path)
        try:
            # The first recall after a start waited 2.3 s for these (counting its block).
            await asyncio.to_thread(load_encodings)
            open_vectors = (functools.partial(VectorIndex.connect, settings.chroma_url)
                            if settings.chroma_url
                            else functools.partial(VectorIndex.open, settings.vectors_path))
            vectors = await asyncio.to_thread(
                open_vectors, collection_name(settings),
                cache_bytes=settings.vector_cache_mb * 1024 * 1024,
            )
            if embedder is None:
                embedder = _local_embedder(settings)
        except BaseException:
            await db.close()
            raise
        engine = cls(settings, db, vectors, embedder)
        engine.learner.llm = llm
        engine.recaller.reranker.scorer = rerank
        await engine.rebuild.fill_if_new(vectors)
        await engine.open_spool()
        await engine.worker.start()
        engine._maintenance = asyncio.get_running_loop().create_task(engine.maintenance.run())
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
        if self.spooling is not None:
            await self.spooling.close()
        await self.rebuild.close()
        await asyncio.to_thread(self.vectors.close)
        await self.db.close()

    async def health(self) -> dict[str, str]:
        """Each dependency's state: "ok" or the error it raised."""
        probes: dict[str, Any] = {
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
        depth = self.spool_status()[0]
        if depth and parts["database"] != "ok":
            parts["database"] = f"database unreachable, spooling {depth} turns"
        elif depth:
            parts["database"] = f"replaying {depth} spooled turns"
        return parts

    async def prune(self, now: float | None = None) -> dict[str, int]:
        """Drop what is past retention now (memory.jobs.maintenance)."""
        return await self.maintenance.prune(now)

    # -- remember

    @tracing.traced("memproxy.remember.request")
    async def remember_request(
        self, user_id: str, session_id: str, messages: Sequence[Mapping[str, Any]], *,
        model: str, request_id: str, after: int | None = None,
        injected: tuple[int, Injection] | None = None,
    ) -> int | Spooled | None:
        """Store the request's turns (each once, however often resent); return the last id,
        or where they were spooled when the database is unreachable (memory.log.spooling).

        `after`: the stored turn these messages continue (a request that sends only its
        new messages, like a Responses API call with `previous_response_id`).
        `injected`: the memory block placed at `messages[index]`, kept with that turn so
        the session's later requests put it back (placed_blocks).
        """
        now = time.time()
        turns, at = await counted_turns(messages, model=model, request_id=request_id, now=now)
        if not turns:
            return after
        spooling = self.spooling
        if spooling is not None and spooling.active:  # behind what waits: in order
            return await spooling.put(user_id, session_id, turns, after=after, reply=False,
                                      model=model)
        try:
            result = await self.log.append_turns(
                user_id, session_id, turns, after=after, job_kind=INDEX_JOB,
                max_attempts=self.settings.job_max_attempts,
            )
        except Exception as exc:
            if spooling is None or not is_outage(exc):
                raise
            # The block kept for stable injection is not spooled: a later request recalls anew.
            return await spooling.put(user_id, session_id, turns, after=after, reply=False,
                                      model=model)
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
        turns, at = new_turns(messages, model="", request_id=None, now=0.0, count=False)
        try:
            ids = await self.log.locate(user_id, session_id, turns, after=after)
        except Exception as exc:
            if self.spooling is None or not self.spooling.active or not is_outage(exc):
                raise
            # The database is unreachable: recall answers from the spool (SpoolRecall), and
            # its block is placed as a session's first would be.
            return {}
        kept = await injections.of_turns(self.db, user_id, ids) if ids else {}
        return {at[i]: kept[turn_id] for i, turn_id in enumerate(ids) if turn_id in kept}

    async def unsaved_blocks(
        self, user_id: str, session_id: str, messages: Sequence[Mapping[str, Any]], *,
        org_memory: str | None,
    ) -> tuple[dict[int, Injection], UnsavedStamp]:
        """Stable injection with writing off: {index into `messages`: the block this process
        kept for that user message} (memory.recall.unsaved_blocks), and the stamp to keep
        the request's own block with. `org_memory`: the shared memory the request reaches."""
        stamp = ((await versions.stamp(self.db, user_id, ""))[0],
                 None if org_memory is None else (await versions.stamp(self.db, org_memory, ""))[0])
        return self.unsaved.placed(user_id, session_id, messages, stamp), stamp

    async def remember_fact(
        self, user_id: str, text: str, category: str, *, importance: int, source: str,
        source_session: str | None, ttl_seconds: float | None, pinned: bool = False,
        client: str | None = None,
    ) -> Fact:
        """Keep a fact a client states (MCP) as learned facts are kept: redacted, merged
        into a duplicate or superseding the same subject's old value, expiring after its
        category's lifetime unless `ttl_seconds` says otherwise."""
        now = time.time()
        expires = (now + ttl_seconds if ttl_seconds is not None
                   else self.facts.default_expiry(category, now))
        return await self.learner.remember(
            user_id, text, category, confidence=1.0, importance=importance, source=source,
            source_session=source_session, expires_at=expires, pinned=pinned, client=client,
        )

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

    async def reply_owner(self, reply_id: str) -> str | None:
        """The user whose reply is remembered under `reply_id`, None when none is."""
        return await self.log.reply_owner(reply_id)

    @tracing.traced("memproxy.remember.reply")
    async def remember_reply(
        self, user_id: str, session_id: str, after: int | Spooled | None, text: str, *,
        model: str, request_id: str, incomplete: bool, route: str = DEFAULT_ROUTE,
    ) -> None:
        """Store the assistant's reply after the turn it answers (spooled after it when that
        turn was spooled, or when the database is unreachable); its learning jobs go through
        `route`, the way in that served the conversation."""
        turn = NewTurn(
            role="assistant", content=text, created_at=time.time(), model=model,
            tokens=await off_loop(len(text), functools.partial(count_tokens, text, model)),
            request_id=request_id, incomplete=incomplete,
        )
        spooling = self.spooling
        if isinstance(after, Spooled) or (spooling is not None and spooling.active):
            assert spooling is not None  # only a spool makes a Spooled
            # A spooled request's whole path: its turns, then this reply.
            path, start = ((after.turns, after.after) if isinstance(after, Spooled)
                           else ((), after))
            await spooling.put(user_id, session_id, [*path, turn], after=start, reply=True,
                               model=model, route=route)
            return
        try:
            await self._append_path(user_id, session_id, [turn], after, True, model, route)
        except Exception as exc:
            if spooling is None or not is_outage(exc):
                raise
            await spooling.put(user_id, session_id, [turn], after=after, reply=True, model=model,
                               route=route)

    async def _append_path(
        self, user_id: str, session_id: str, turns: list[NewTurn], after: int | None,
        reply: bool, model: str, route: str = DEFAULT_ROUTE,
    ) -> None:
        """Log a path of turns; when it ends in a reply, queue that reply's learning jobs
        in the same transaction."""
        async def learn(tx: Transaction, turn_id: int) -> None:
            await self.learner.queue_after_reply(tx, user_id, session_id, turn_id, model, route)

        result = await self.log.append_turns(
            user_id, session_id, turns, after=after, job_kind=INDEX_JOB,
            max_attempts=self.settings.job_max_attempts, then=learn if reply else None,
        )
        if result.new_ids:
            self.worker.notify()

    async def record(self, row: RequestMetrics) -> None:
        """Keep one per-request metrics row."""
        async with self.db.autocommit() as tx:
            await metrics.insert(tx, row)

    # -- recall

    async def cached_recall(self, request: RecallRequest) -> Recalled:
        """`recall`, or the result of the same request kept while the user's memory is
        unchanged (memory.recall.cache)."""
        return await self.recaller.cached_recall(request)

    async def recall(self, request: RecallRequest) -> Recalled:
        """Find, rank and pack what this request should be reminded of."""
        return await self.recaller.recall(request)


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


async def check_stores(settings: Settings) -> None:
    """CannotOpen (memory.outages), before anything is opened or written, when the
    configured PostgreSQL or Chroma server does not answer: `memproxy serve` says so in one
    line instead of a traceback from its start (docs/deploy.md)."""
    if settings.database_url:
        from memory.storage.postgres import check_reachable  # asyncpg only when asked for

        await check_reachable(settings.database_url, without_password(settings.database_url),
                              named="MEMPROXY_DATABASE_URL")
    if settings.chroma_url:
        await asyncio.to_thread(check_server, settings.chroma_url,
                                without_password(settings.chroma_url), named="MEMPROXY_CHROMA_URL")


def collection_name(settings: Settings) -> str:
    """One collection per embedding model: vectors of different models never mix."""
    if settings.embedding_backend == "local":
        return "chunks-minilm-l6" + ("-int8" if settings.embedding_precision == "int8" else "")
    slug = "".join(ch if ch.isalnum() else "-" for ch in settings.embedding_upstream_model)
    return f"chunks-{slug}"[:60]

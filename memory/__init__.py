"""The memory engine's public surface: everything `proxy/` and `scripts/` may use.

    memory/
      engine.py   MemoryEngine: remember turns, index them, recall within a budget
      storage/    the database: connections, the writer, migrations, one module per table
      log/        the turn log (exactly-once turns) and chat message text
      jobs/       the durable job queue and its worker
      index/      chunking, embeddings, the vector index and its per-user copies
      recall/     query, lexical search, ranking, the memory block and its injection
      learning/   facts, summaries, the profile, and the jobs that learn them
      admin/      sessions, stats, backup, migrate, export/import, clear-all, forgetting
      scopes.py   the reserved ids of an organisation's shared memory

Names load on first use (PEP 562), so a command that needs only a constant does not pay
for the engine's imports (chromadb, numpy, the tokenizers): about 1.7 s here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memory.admin.api_keys import SECRET_PREFIX, KeyNotFound, KeyRevoked, KeyStore
    from memory.admin.api_keys import digest as key_digest
    from memory.admin.backup import BackupError, BackupResult, backup
    from memory.admin.clearing import ClearExpired, ClearNotFound, ClearReceipt
    from memory.admin.migrate import MigrateError, MigrateResult, migrate
    from memory.admin.rates import SharedBuckets
    from memory.admin.record_checks import IGNORED, RECORD_SHAPES, RecordError, check_record
    from memory.admin.sessions import MAX_PAGE as MAX_SESSIONS_PAGE
    from memory.admin.sessions import CursorError, SessionInfo, turn_dict
    from memory.admin.stats import MAX_METRICS_ROWS
    from memory.admin.usage import Hold, UsageLedger, UsageReport
    from memory.engine import Embedder, MemoryEngine, check_stores, collection_name
    from memory.index.embeddings import EmbeddingModelMissing, LocalEmbedder, find_model_dir
    from memory.index.heap_fill import mallopt
    from memory.index.vectors import VectorIndex
    from memory.learning.fact_model import (
        CATEGORIES,
        MAX_CLIENT_CHARS,
        MAX_TEXT_CHARS,
        FactError,
        FactNotFound,
    )
    from memory.learning.fact_model import MAX_PAGE as MAX_FACTS_PAGE
    from memory.learning.fact_model import SOURCES as FACT_SOURCES
    from memory.learning.profiles import ConsentRequired
    from memory.log.messages import message_text, turn_text
    from memory.log.spooling import Spooled
    from memory.log.turn_log import INDEX_JOB, ReplyChain, TurnLog
    from memory.outages import CannotOpen, Unavailable, is_outage
    from memory.recall.inject import Placed, inject, place, placing_order
    from memory.recall.lexical import ChunkSearch
    from memory.recall.outcome import Recalled, RecalledItem, RecallRequest
    from memory.recall.query import build_query, for_embedding
    from memory.recall.rerank import RerankFailed, RerankReport
    from memory.recall.rerank import Scorer as RerankScorer
    from memory.recall.spooled import SpoolRecall
    from memory.recall.unsaved_blocks import Stamp as UnsavedStamp
    from memory.redact import Redactor, redact_profile
    from memory.scopes import organization_memory
    from memory.storage.api_keys import StoredKey
    from memory.storage.bulk_copy import Batch as CopiedBatch
    from memory.storage.database import Database, SQLiteDatabase, open_database
    from memory.storage.facts import Fact
    from memory.storage.injections import Injection
    from memory.storage.metrics import RequestMetrics
    from memory.storage.turns import NewTurn
    from memory.storage.usage import UsageCounts, UsageRow
    from memory.tokens import count_tokens, encoding_for_model, off_loop
    from memory.tracing import span as trace_span

# public name -> (module, name in that module)
_EXPORTS: dict[str, tuple[str, str]] = {
    # the engine and one request's recall
    "MemoryEngine": ("memory.engine", "MemoryEngine"),
    "Embedder": ("memory.engine", "Embedder"),
    "RecallRequest": ("memory.recall.outcome", "RecallRequest"),
    "Recalled": ("memory.recall.outcome", "Recalled"),
    "SpoolRecall": ("memory.recall.spooled", "SpoolRecall"),
    # the rerank stage's scorer, which the proxy gives (memory/recall/rerank.py)
    "RerankScorer": ("memory.recall.rerank", "Scorer"),
    "RerankFailed": ("memory.recall.rerank", "RerankFailed"),
    "RerankReport": ("memory.recall.rerank", "RerankReport"),
    "UnsavedStamp": ("memory.recall.unsaved_blocks", "Stamp"),
    "RecalledItem": ("memory.recall.outcome", "RecalledItem"),
    "RequestMetrics": ("memory.storage.metrics", "RequestMetrics"),
    "ReplyChain": ("memory.log.turn_log", "ReplyChain"),
    "Spooled": ("memory.log.spooling", "Spooled"),
    "collection_name": ("memory.engine", "collection_name"),
    "inject": ("memory.recall.inject", "inject"),
    "organization_memory": ("memory.scopes", "organization_memory"),
    "place": ("memory.recall.inject", "place"),
    "Placed": ("memory.recall.inject", "Placed"),
    "placing_order": ("memory.recall.inject", "placing_order"),
    "Injection": ("memory.storage.injections", "Injection"),
    "message_text": ("memory.log.messages", "message_text"),
    "turn_text": ("memory.log.messages", "turn_text"),
    "LocalEmbedder": ("memory.index.embeddings", "LocalEmbedder"),
    "CannotOpen": ("memory.outages", "CannotOpen"),
    "check_stores": ("memory.engine", "check_stores"),
    "EmbeddingModelMissing": ("memory.index.embeddings", "EmbeddingModelMissing"),
    "find_model_dir": ("memory.index.embeddings", "find_model_dir"),
    "VectorIndex": ("memory.index.vectors", "VectorIndex"),
    # glibc's mallopt, for the proxy's cap on malloc arenas (proxy/http/serving.py)
    "mallopt": ("memory.index.heap_fill", "mallopt"),
    "count_tokens": ("memory.tokens", "count_tokens"),
    "off_loop": ("memory.tokens", "off_loop"),
    # outages of backing services (waited out, not counted as failures)
    "Unavailable": ("memory.outages", "Unavailable"),
    "is_outage": ("memory.outages", "is_outage"),
    "encoding_for_model": ("memory.tokens", "encoding_for_model"),
    "Redactor": ("memory.redact", "Redactor"),
    "redact_profile": ("memory.redact", "redact_profile"),
    # spans of the proxy's steps, through the OpenTelemetry API (memory/tracing.py)
    "trace_span": ("memory.tracing", "span"),
    # the management API's records, limits and errors
    "Fact": ("memory.storage.facts", "Fact"),
    "CATEGORIES": ("memory.learning.fact_model", "CATEGORIES"),
    "MAX_TEXT_CHARS": ("memory.learning.fact_model", "MAX_TEXT_CHARS"),
    "MAX_CLIENT_CHARS": ("memory.learning.fact_model", "MAX_CLIENT_CHARS"),
    "FACT_SOURCES": ("memory.learning.fact_model", "SOURCES"),
    "MAX_FACTS_PAGE": ("memory.learning.fact_model", "MAX_PAGE"),
    "MAX_SESSIONS_PAGE": ("memory.admin.sessions", "MAX_PAGE"),
    "SessionInfo": ("memory.admin.sessions", "SessionInfo"),
    "MAX_METRICS_ROWS": ("memory.admin.stats", "MAX_METRICS_ROWS"),
    "FactError": ("memory.learning.fact_model", "FactError"),
    "FactNotFound": ("memory.learning.fact_model", "FactNotFound"),
    "ConsentRequired": ("memory.learning.profiles", "ConsentRequired"),
    "CursorError": ("memory.admin.sessions", "CursorError"),
    "RecordError": ("memory.admin.record_checks", "RecordError"),
    "IGNORED": ("memory.admin.record_checks", "IGNORED"),
    "RECORD_SHAPES": ("memory.admin.record_checks", "RECORD_SHAPES"),
    "ClearExpired": ("memory.admin.clearing", "ClearExpired"),
    "ClearNotFound": ("memory.admin.clearing", "ClearNotFound"),
    "ClearReceipt": ("memory.admin.clearing", "ClearReceipt"),
    "check_record": ("memory.admin.record_checks", "check_record"),
    "turn_dict": ("memory.admin.sessions", "turn_dict"),
    "backup": ("memory.admin.backup", "backup"),
    "BackupError": ("memory.admin.backup", "BackupError"),
    "BackupResult": ("memory.admin.backup", "BackupResult"),
    "migrate": ("memory.admin.migrate", "migrate"),
    "MigrateError": ("memory.admin.migrate", "MigrateError"),
    "MigrateResult": ("memory.admin.migrate", "MigrateResult"),
    "CopiedBatch": ("memory.storage.bulk_copy", "Batch"),
    # proxy keys kept in the database (docs/keys.md)
    "KeyStore": ("memory.admin.api_keys", "KeyStore"),
    "KeyNotFound": ("memory.admin.api_keys", "KeyNotFound"),
    "KeyRevoked": ("memory.admin.api_keys", "KeyRevoked"),
    "SECRET_PREFIX": ("memory.admin.api_keys", "SECRET_PREFIX"),
    "StoredKey": ("memory.storage.api_keys", "StoredKey"),
    "key_digest": ("memory.admin.api_keys", "digest"),
    # usage per day, key and user (docs/usage.md)
    "UsageLedger": ("memory.admin.usage", "UsageLedger"),
    "Hold": ("memory.admin.usage", "Hold"),
    "SharedBuckets": ("memory.admin.rates", "SharedBuckets"),
    "UsageReport": ("memory.admin.usage", "UsageReport"),
    "UsageCounts": ("memory.storage.usage", "UsageCounts"),
    "UsageRow": ("memory.storage.usage", "UsageRow"),
    # the parts, for benchmarks that time one of them alone
    "Database": ("memory.storage.database", "Database"),
    "SQLiteDatabase": ("memory.storage.database", "SQLiteDatabase"),
    "open_database": ("memory.storage.database", "open_database"),
    "TurnLog": ("memory.log.turn_log", "TurnLog"),
    "NewTurn": ("memory.storage.turns", "NewTurn"),
    "INDEX_JOB": ("memory.log.turn_log", "INDEX_JOB"),
    "ChunkSearch": ("memory.recall.lexical", "ChunkSearch"),
    "build_query": ("memory.recall.query", "build_query"),
    "for_embedding": ("memory.recall.query", "for_embedding"),
}

__all__ = [
    "CATEGORIES",
    "FACT_SOURCES",
    "IGNORED",
    "INDEX_JOB",
    "MAX_CLIENT_CHARS",
    "MAX_FACTS_PAGE",
    "MAX_METRICS_ROWS",
    "MAX_SESSIONS_PAGE",
    "MAX_TEXT_CHARS",
    "RECORD_SHAPES",
    "SECRET_PREFIX",
    "BackupError",
    "BackupResult",
    "CannotOpen",
    "ChunkSearch",
    "ClearExpired",
    "ClearNotFound",
    "ClearReceipt",
    "ConsentRequired",
    "CopiedBatch",
    "CursorError",
    "Database",
    "Embedder",
    "EmbeddingModelMissing",
    "Fact",
    "FactError",
    "FactNotFound",
    "Hold",
    "Injection",
    "KeyNotFound",
    "KeyRevoked",
    "KeyStore",
    "LocalEmbedder",
    "MemoryEngine",
    "MigrateError",
    "MigrateResult",
    "NewTurn",
    "Placed",
    "RecallRequest",
    "Recalled",
    "RecalledItem",
    "RecordError",
    "Redactor",
    "ReplyChain",
    "RequestMetrics",
    "RerankFailed",
    "RerankReport",
    "RerankScorer",
    "SQLiteDatabase",
    "SessionInfo",
    "SharedBuckets",
    "SpoolRecall",
    "Spooled",
    "StoredKey",
    "TurnLog",
    "Unavailable",
    "UnsavedStamp",
    "UsageCounts",
    "UsageLedger",
    "UsageReport",
    "UsageRow",
    "VectorIndex",
    "backup",
    "build_query",
    "check_record",
    "check_stores",
    "collection_name",
    "count_tokens",
    "encoding_for_model",
    "find_model_dir",
    "for_embedding",
    "inject",
    "is_outage",
    "key_digest",
    "mallopt",
    "message_text",
    "migrate",
    "off_loop",
    "open_database",
    "organization_memory",
    "place",
    "placing_order",
    "redact_profile",
    "trace_span",
    "turn_dict",
    "turn_text",
]


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'memory' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

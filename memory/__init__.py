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

if TYPE_CHECKING:  # what mypy reads; at run time each name is imported on first use
    from memory.admin.api_keys import SECRET_PREFIX as SECRET_PREFIX
    from memory.admin.api_keys import KeyNotFound as KeyNotFound
    from memory.admin.api_keys import KeyRevoked as KeyRevoked
    from memory.admin.api_keys import KeyStore as KeyStore
    from memory.admin.api_keys import digest as key_digest
    from memory.admin.backup import BackupError as BackupError
    from memory.admin.backup import BackupResult as BackupResult
    from memory.admin.backup import backup as backup
    from memory.admin.clearing import ClearExpired as ClearExpired
    from memory.admin.clearing import ClearNotFound as ClearNotFound
    from memory.admin.clearing import ClearReceipt as ClearReceipt
    from memory.admin.migrate import MigrateError as MigrateError
    from memory.admin.migrate import MigrateResult as MigrateResult
    from memory.admin.migrate import migrate as migrate
    from memory.admin.rates import SharedBuckets as SharedBuckets
    from memory.admin.record_checks import IGNORED as IGNORED
    from memory.admin.record_checks import NON_BLANK as NON_BLANK
    from memory.admin.record_checks import RECORD_SHAPES as RECORD_SHAPES
    from memory.admin.record_checks import RecordError as RecordError
    from memory.admin.record_checks import check_record as check_record
    from memory.admin.sessions import MAX_PAGE as MAX_SESSIONS_PAGE
    from memory.admin.sessions import CursorError as CursorError
    from memory.admin.sessions import SessionInfo as SessionInfo
    from memory.admin.sessions import turn_dict as turn_dict
    from memory.admin.stats import MAX_METRICS_ROWS as MAX_METRICS_ROWS
    from memory.admin.usage import Hold as Hold
    from memory.admin.usage import UsageLedger as UsageLedger
    from memory.admin.usage import UsageReport as UsageReport
    from memory.engine import Embedder as Embedder
    from memory.engine import MemoryEngine as MemoryEngine
    from memory.engine import check_stores as check_stores
    from memory.engine import collection_name as collection_name
    from memory.index.embeddings import EmbeddingModelMissing as EmbeddingModelMissing
    from memory.index.embeddings import LocalEmbedder as LocalEmbedder
    from memory.index.embeddings import find_model_dir as find_model_dir
    from memory.index.heap_fill import mallopt as mallopt
    from memory.index.vectors import VectorIndex as VectorIndex
    from memory.learning.fact_model import CATEGORIES as CATEGORIES
    from memory.learning.fact_model import MAX_CLIENT_CHARS as MAX_CLIENT_CHARS
    from memory.learning.fact_model import MAX_PAGE as MAX_FACTS_PAGE
    from memory.learning.fact_model import MAX_TEXT_CHARS as MAX_TEXT_CHARS
    from memory.learning.fact_model import SOURCES as FACT_SOURCES
    from memory.learning.fact_model import FactError as FactError
    from memory.learning.fact_model import FactNotFound as FactNotFound
    from memory.learning.profiles import ConsentRequired as ConsentRequired
    from memory.log.messages import message_text as message_text
    from memory.log.messages import turn_text as turn_text
    from memory.log.spooling import Spooled as Spooled
    from memory.log.turn_log import INDEX_JOB as INDEX_JOB
    from memory.log.turn_log import ReplyChain as ReplyChain
    from memory.log.turn_log import TurnLog as TurnLog
    from memory.outages import CannotOpen as CannotOpen
    from memory.outages import Unavailable as Unavailable
    from memory.outages import is_outage as is_outage
    from memory.recall.inject import Placed as Placed
    from memory.recall.inject import inject as inject
    from memory.recall.inject import place as place
    from memory.recall.inject import placing_order as placing_order
    from memory.recall.lexical import ChunkSearch as ChunkSearch
    from memory.recall.outcome import Recalled as Recalled
    from memory.recall.outcome import RecalledItem as RecalledItem
    from memory.recall.outcome import RecallRequest as RecallRequest
    from memory.recall.query import build_query as build_query
    from memory.recall.query import for_embedding as for_embedding
    from memory.recall.rerank import RerankFailed as RerankFailed
    from memory.recall.rerank import RerankReport as RerankReport
    from memory.recall.rerank import Scorer as RerankScorer
    from memory.recall.spooled import SpoolRecall as SpoolRecall
    from memory.recall.unsaved_blocks import Stamp as UnsavedStamp
    from memory.redact import Redactor as Redactor
    from memory.redact import redact_profile as redact_profile
    from memory.scopes import organization_memory as organization_memory
    from memory.storage.api_keys import StoredKey as StoredKey
    from memory.storage.bulk_copy import Batch as CopiedBatch
    from memory.storage.database import Database as Database
    from memory.storage.database import SQLiteDatabase as SQLiteDatabase
    from memory.storage.database import open_database as open_database
    from memory.storage.facts import Fact as Fact
    from memory.storage.injections import Injection as Injection
    from memory.storage.metrics import RequestMetrics as RequestMetrics
    from memory.storage.turns import NewTurn as NewTurn
    from memory.storage.usage import UsageCounts as UsageCounts
    from memory.storage.usage import UsageRow as UsageRow
    from memory.tokens import count_tokens as count_tokens
    from memory.tokens import encoding_for_model as encoding_for_model
    from memory.tokens import off_loop as off_loop
    from memory.tracing import span as trace_span

# module -> the public names it gives, "public=own" where the facade renames one
_MODULES: dict[str, str] = {
    # the engine and one request's recall
    "memory.engine": "MemoryEngine Embedder collection_name check_stores",
    "memory.recall.outcome": "RecallRequest Recalled RecalledItem",
    "memory.recall.spooled": "SpoolRecall",
    # the rerank stage's scorer, which the proxy gives (memory/recall/rerank.py)
    "memory.recall.rerank": "RerankScorer=Scorer RerankFailed RerankReport",
    "memory.recall.unsaved_blocks": "UnsavedStamp=Stamp",
    "memory.storage.metrics": "RequestMetrics",
    "memory.log.spooling": "Spooled",
    "memory.recall.inject": "inject place Placed placing_order",
    "memory.scopes": "organization_memory",
    "memory.storage.injections": "Injection",
    "memory.log.messages": "message_text turn_text",
    "memory.index.embeddings": "LocalEmbedder EmbeddingModelMissing find_model_dir",
    "memory.index.vectors": "VectorIndex",
    # glibc's mallopt, for the proxy's cap on malloc arenas (proxy/http/serving.py)
    "memory.index.heap_fill": "mallopt",
    "memory.tokens": "count_tokens off_loop encoding_for_model",
    # outages of backing services (waited out, not counted as failures)
    "memory.outages": "CannotOpen Unavailable is_outage",
    "memory.redact": "Redactor redact_profile",
    # spans of the proxy's steps, through the OpenTelemetry API (memory/tracing.py)
    "memory.tracing": "trace_span=span",
    # the management API's records, limits and errors
    "memory.storage.facts": "Fact",
    "memory.learning.fact_model": (
        "CATEGORIES MAX_TEXT_CHARS MAX_CLIENT_CHARS FACT_SOURCES=SOURCES MAX_FACTS_PAGE=MAX_PAGE"
        " FactError FactNotFound"
    ),
    "memory.admin.sessions": "MAX_SESSIONS_PAGE=MAX_PAGE SessionInfo CursorError turn_dict",
    "memory.admin.stats": "MAX_METRICS_ROWS",
    "memory.learning.profiles": "ConsentRequired",
    "memory.admin.record_checks": "RecordError IGNORED RECORD_SHAPES check_record NON_BLANK",
    "memory.admin.clearing": "ClearExpired ClearNotFound ClearReceipt",
    "memory.admin.backup": "backup BackupError BackupResult",
    "memory.admin.migrate": "migrate MigrateError MigrateResult",
    "memory.storage.bulk_copy": "CopiedBatch=Batch",
    # proxy keys kept in the database (docs/keys.md)
    "memory.admin.api_keys": "KeyStore KeyNotFound KeyRevoked SECRET_PREFIX key_digest=digest",
    "memory.storage.api_keys": "StoredKey",
    # usage per day, key and user (docs/usage.md)
    "memory.admin.usage": "UsageLedger Hold UsageReport",
    "memory.admin.rates": "SharedBuckets",
    "memory.storage.usage": "UsageCounts UsageRow",
    # the parts, for benchmarks that time one of them alone
    "memory.storage.database": "Database SQLiteDatabase open_database",
    "memory.log.turn_log": "TurnLog ReplyChain INDEX_JOB",
    "memory.storage.turns": "NewTurn",
    "memory.recall.lexical": "ChunkSearch",
    "memory.recall.query": "build_query for_embedding",
}
# public name -> (module, name in that module)
_EXPORTS: dict[str, tuple[str, str]] = {
    public: (module, own or public)
    for module, names in _MODULES.items()
    for public, _, own in (name.partition("=") for name in names.split())
}
__all__ = sorted(_EXPORTS)
if TYPE_CHECKING:  # mypy exports an import that renames only when __all__ names it
    __all__ += [
        "FACT_SOURCES",
        "MAX_FACTS_PAGE",
        "MAX_SESSIONS_PAGE",
        "CopiedBatch",
        "RerankScorer",
        "UnsavedStamp",
        "key_digest",
        "trace_span",
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

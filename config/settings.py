"""One frozen, typed Settings object read once at start-up.

Every field has a default and a help text. Values come from, in rising priority: the
defaults below, an optional TOML file (`--config FILE` or `MEMPROXY_CONFIG`), and
`MEMPROXY_<FIELD>` environment variables. A bad value fails at start-up with a
`SettingsError` that names every bad setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from config.choices import INJECTIONS, MODES, PLACEMENTS, SCOPES
from config.routing import ApiKey, Route, parse_api_keys, parse_routes

ENV_PREFIX = "MEMPROXY_"
# MEMPROXY_* variables read elsewhere than Settings: the settings file, the CLI client
# (proxy/cli/memory.py), and compose.yaml's model folder.
OTHER_ENV = frozenset({
    "MEMPROXY_CONFIG", "MEMPROXY_URL", "MEMPROXY_KEY", "MEMPROXY_API_KEY", "MEMPROXY_USER",
    "MEMPROXY_MODEL_DIR",
})


class SettingsError(ValueError):
    """One or more settings are invalid; the message names each of them."""


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "memproxy"


def _setting(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def _setting_factory(factory: Any, help: str, **extra: Any) -> Any:
    return field(default_factory=factory, metadata={"help": help, **extra})


@dataclass(frozen=True)
class Settings:
    """All of memproxy's settings. Field `x` is read from `MEMPROXY_X`."""

    # -- serving
    host: str = _setting("127.0.0.1", "Address `memproxy serve` binds to.")
    port: int = _setting(8080, "Port `memproxy serve` listens on.", min=1, max=65535)
    log_level: str = _setting(
        "info", "Log level: debug, info, warning or error.",
        choices=("debug", "info", "warning", "error"),
    )
    max_body_bytes: int = _setting(
        32 * 1024 * 1024, "Largest request body accepted, in bytes; larger bodies get 413.", min=1
    )
    max_header_bytes: int = _setting(
        64 * 1024, "Largest request head (request line and headers), in bytes; a larger one "
        "gets 431 and the connection closes.", min=1024,
    )
    header_timeout_seconds: float = _setting(
        10.0, "Seconds a client may take to send a request's headers (from the connection's "
        "start, or the request's first byte); then 408 and the connection closes.", min=0.01,
    )
    body_timeout_seconds: float = _setting(
        30.0, "Seconds a request body may send nothing while memproxy waits for it; then 408 "
        "(or the connection closes).", min=0.01,
    )

    # -- upstream
    upstream_base_url: str = _setting(
        "https://api.openai.com/v1", "Base URL of the default OpenAI-compatible upstream."
    )
    upstream_api_key: str | None = _setting(
        None,
        "API key sent to the default upstream. Unset: the client's own Authorization "
        "header is forwarded (bring-your-own-key).",
        secret=True,
    )
    upstream_timeout: float = _setting(
        600.0, "Seconds to wait for the upstream's response headers and between body bytes.",
        min=0.001,
    )
    upstream_connect_timeout: float = _setting(
        10.0, "Seconds to wait for a TCP connection to the upstream.", min=0.001
    )
    upstream_max_connections: int = _setting(
        512, "Most simultaneous connections to upstreams.", min=1
    )
    upstream_retries: int = _setting(
        0,
        "Retries of a chat completion, streamed or not, whose upstream connection failed or "
        "that got 429/502/503/504, with exponential backoff honouring Retry-After up to 4 s; "
        "only before any byte reached the client (0: off).",
        min=0, max=10,
    )
    anthropic_base_url: str | None = _setting(
        None,
        "Anthropic-compatible upstream for POST /v1/messages (e.g. https://api.anthropic.com): "
        "requests and replies go through as bytes. Unset: /v1/messages goes to the model's "
        "route through litellm's translation (to the default upstream when no route matches).",
    )
    anthropic_api_key: str | None = _setting(
        None,
        "x-api-key sent to anthropic_base_url. Unset: the client's own x-api-key (or "
        "Authorization) is forwarded.",
        secret=True,
    )
    routes: tuple[Route, ...] = _setting_factory(
        tuple,
        "Model routing table (TOML `[[routes]]` only): `match` a model name or a prefix "
        "ending in `*`, then `base_url` (+ `api_key`) for an OpenAI-compatible upstream or "
        "`provider` (+ `api_key`, `base_url`) for a litellm provider such as `anthropic`; "
        "`context_window` (tokens) overrides litellm's figure for compaction.",
        env=False,
    )

    # -- access
    api_keys: tuple[ApiKey, ...] = _setting_factory(
        tuple,
        "Proxy keys, comma-separated; `key:user` binds a key to a user id, `:org=ORG` puts "
        "it in an organisation and `:org-writer` lets it change that organisation's shared "
        "memory (`key[:user][:org=ORG][:org-writer]`). Each key must be at least 8 characters "
        "(a shorter one stops start-up). When set, a request without a valid key gets 401.",
        secret=True,
    )
    admin_key: str | None = _setting(
        None, "Admin key: reaches every user's memory through X-Memory-User-Id.", secret=True
    )
    allowed_hosts: str | None = _setting(
        None,
        "Host names memproxy answers under, comma-separated (`*`: any), so a web page whose "
        "name a DNS answer pointed at memproxy (DNS rebinding) gets 400. IP addresses and "
        "localhost always pass. Unset: any name when proxy keys or an admin key are set, "
        "else only localhost, addresses and the host it binds to.",
    )
    management_remote: bool = _setting(
        False,
        "Without proxy keys, let clients other than loopback reach memory: the memory API "
        "(/v1/memory), panel data, and recall and remembering in their chats (else their "
        "chats go through with memory off). With keys set, keys decide.",
    )
    mcp: bool = _setting(
        True,
        "Serve the Model Context Protocol at /mcp (Streamable HTTP, stateless): the memory "
        "tools for MCP clients, under the same keys and access rules as the memory API.",
    )
    clear_undo_seconds: float = _setting(
        10.0, "How long a clear-all can be undone; after it the memory is deleted for good.",
        min=1.0, max=86400.0,
    )
    rate_limit: int = _setting(
        0,
        "Requests per minute each key may send to /v1 (token bucket; 0: off). The key is the "
        "proxy key when keys are set, else the client's bearer key, else the user id, and "
        "without proxy keys the client's address counts too (behind a reverse proxy every "
        "client has its address); over it: 429 with a Retry-After of the seconds until the "
        "next request is allowed.",
        min=0,
    )
    rate_limit_burst: int = _setting(
        0,
        "Requests a key may send at once before rate_limit paces it (the bucket's size; "
        "0: one minute's worth, rate_limit).",
        min=0,
    )
    max_streams_per_key: int = _setting(
        64,
        "Streamed replies (chat completions, Responses, Messages) each key may have open at "
        "once, counted like rate_limit (0: no limit); one more gets 429 with Retry-After: 1.",
        min=0,
    )

    # -- storage
    data_dir: Path = _setting_factory(
        _default_data_dir, "Where the database and the vector index live."
    )
    database_url: str | None = _setting(
        None,
        "PostgreSQL that holds turns, facts, summaries, profiles, jobs and full-text search "
        "for any number of replicas, such as postgresql://memproxy:secret@db:5432/memproxy. "
        "Unset: the embedded SQLite file under data_dir.",
    )
    chroma_url: str | None = _setting(
        None,
        "Address of a Chroma server (`chroma run`) that holds the vectors, such as "
        "http://chroma:8000. Unset: embedded Chroma under data_dir.",
    )
    redact: str = _setting(
        "secrets",
        "Replace secrets with a typed placeholder such as [REDACTED:api_key] before a turn, "
        "fact or summary is stored: secrets (API keys, Stripe, Hugging Face, GitHub and "
        "GitLab tokens, JWTs, bearer and Basic credentials, AWS key ids and secret keys, "
        "private key blocks, passwords and secret/token assignments; docs/memory.md has the "
        "table), secrets,cards (also Luhn-valid card numbers) or off. The upstream always "
        "gets the original text.",
        choices=("secrets", "secrets,cards", "off"),
    )

    # -- memory defaults (each overridable per request by an X-Memory* header)
    memory: bool = _setting(True, "Master switch for memory (X-Memory).")
    memory_read: bool = _setting(True, "Recall and inject memory (X-Memory-Read).")
    memory_write: bool = _setting(True, "Log turns and learn from them (X-Memory-Write).")
    memory_budget: int = _setting(
        1000, "Token budget of the injected memory block (X-Memory-Budget).", min=0, max=100_000
    )
    memory_scope: str = _setting(
        "organization",
        "Widest scope recall may use: session, user, or organization (the user's memory, "
        "then what the user's organisation shares) (X-Memory-Scope).",
        choices=SCOPES,
    )
    org_budget_share: float = _setting(
        0.25,
        "Share of the memory budget kept for an organisation's shared facts when some are "
        "relevant; the rest of the budget is the user's, and either takes what the other "
        "leaves.", min=0.0, max=1.0,
    )
    memory_placement: str = _setting(
        "system",
        "Where the memory block goes: system (the system prompt) or last_user (a system "
        "message right before the last user message; keeps the prefix cacheable) "
        "(X-Memory-Placement).",
        choices=PLACEMENTS,
    )
    memory_mode: str = _setting(
        "inject",
        "How the model gets memory: inject (the recalled block goes into the prompt) or tool "
        "(a small pre-fetched block, plus a memory_search tool the proxy answers itself) "
        "(X-Memory-Mode).",
        choices=MODES,
    )
    memory_tool_rounds: int = _setting(
        3, "Most rounds of memory_search calls the proxy answers in one request (mode tool; up "
        "to 4 parallel calls a round); after them the tool is no longer offered.", min=1, max=10,
    )
    memory_tool_prefetch: int = _setting(
        200, "Token budget of the block pre-fetched into the prompt in mode tool (at most "
        "memory_budget; each memory_search answer gets memory_budget).", min=0, max=100_000,
    )
    memory_injection: str = _setting(
        "stable",
        "stable: within a session every earlier memory block goes back where it was, byte for "
        "byte, and a request adds only items not shown yet, so provider prompt caches keep "
        "hitting; fresh: each request gets one newly recalled block (X-Memory-Injection).",
        choices=INJECTIONS,
    )
    memory_stable_share: float = _setting(
        0.25,
        "Stable injection: the share of the budget a request may fill with new items once "
        "earlier blocks of its session are in its prompt (the most relevant of those a fresh "
        "block would show); the session's first block gets the whole budget. 1: no limit.",
        min=0.0, max=1.0,
    )
    compact: bool = _setting(
        False,
        "Compact a conversation that, with its memory block, would pass compact_at of the "
        "model's context window: its middle is replaced by the session's summary "
        "(X-Memory-Compact). Off: such a request goes through unchanged.",
    )
    compact_at: float = _setting(
        0.8, "Share of the model's context window at which compaction starts.", min=0.05, max=1.0
    )
    compact_keep_last: int = _setting(
        8, "Messages at the end of the conversation that compaction always keeps.", min=1
    )

    # -- embeddings and indexing
    embedding_model_dir: Path | None = _setting(
        None,
        "Folder of the all-MiniLM-L6-v2 ONNX model (holding onnx/). Unset: chromadb's "
        "cache path, else a checked download where internet exists.",
    )
    embedding_backend: str = _setting(
        "local",
        "local (ONNX on this machine) or upstream (an OpenAI-compatible /embeddings endpoint).",
        choices=("local", "upstream"),
    )
    embedding_upstream_model: str = _setting(
        "text-embedding-3-small", "Model name used when embedding_backend is upstream."
    )
    embedding_threads: int = _setting(
        2, "CPU threads one local embedding may use. Index jobs embed one at a time, so "
        "indexing never takes more; a query's embedding runs beside them.", min=1, max=64
    )
    embedding_precision: str = _setting(
        "float32", "Weights of the local model: float32 (the shipped model) or int8 (a copy "
        "quantized at the first start into data_dir/models and checked against it; about half "
        "the CPU a text). Each has its own collection: switching re-indexes from the database.",
        choices=("float32", "int8"),
    )
    index_batch_jobs: int = _setting(
        32, "Index jobs that are ready together run as one, in one embedding batch (a chat "
        "request queues one job for its new turns); 1 runs each alone.", min=1, max=1024,
    )
    chunk_max_tokens: int = _setting(
        200, "Largest chunk a turn is split into for indexing, in tokens.", min=16, max=2000
    )
    index_max_chunks_per_turn: int = _setting(
        100, "Most chunks one turn is indexed as (searched by meaning and by words): a longer "
        "turn is indexed from its start and stored whole, so one huge message cannot occupy "
        "the shared index queue for minutes. 0: no limit.", min=0,
    )

    # -- recall and ranking
    recall_cache_entries: int = _setting(
        1024,
        "Recall results kept for retried and regenerated requests (same user, session, "
        "messages and settings); any write to the user's memory invalidates theirs. 0: off.",
        min=0,
    )
    recall_candidates: int = _setting(
        60, "Candidates taken from each of dense and lexical search before fusion.", min=1
    )
    query_split_names: bool = _setting(
        True, "Embed the recall query without the names of the people the user's turns were "
        "said under, adding each name it says back at query_name_weight (turns are embedded "
        "with their speaker's name, which otherwise outweighs a short question's topic).",
    )
    query_name_weight: float = _setting(
        0.3, "Weight of each speaker's name vector added to the query's vector when "
        "query_split_names is on (0: the names are left out).", min=0.0,
    )
    query_embed_words: int = _setting(
        32, "Longest query, in words, that recall embeds; a longer one keeps its first quarter "
        "and last three quarters (the lexical search still uses every word). 0: no limit.",
        min=0,
    )
    vector_cache_mb: int = _setting(
        512, "Memory for the copies of users' vectors that recall searches exactly (least "
        "recently used dropped first; the latest user always stays); 0 queries Chroma with a "
        "metadata filter instead.", min=0,
    )
    weight_dense: float = _setting(
        1.0, "Fusion weight of dense (vector) similarity, min-max scaled over a query's "
        "candidates; 0 skips the vector search.", min=0.0,
    )
    weight_bm25: float = _setting(
        1.5, "Fusion weight of BM25 (lexical) relevance over a turn's text and speaker, min-max "
        "scaled over a query's candidates; 0 skips the lexical search.", min=0.0,
    )
    weight_identifier: float = _setting(
        0.5, "Fusion weight of an exact code-identifier match.", min=0.0
    )
    weight_recency: float = _setting(0.1, "Fusion weight of recency.", min=0.0)
    weight_session: float = _setting(
        0.1, "Boost for items from the request's own session.", min=0.0
    )
    recency_half_life_days: float = _setting(
        30.0, "Age at which the recency signal halves, in days.", min=0.001
    )
    weight_context: float = _setting(
        0.4,
        "Share of a top item's score given to the turns just before and after it (an answer "
        "next to a matching question); 0 turns this off.",
        min=0.0,
    )
    weight_conversation: float = _setting(
        0.4,
        "Fusion weight of how well an item's whole session matches (the mean of its three "
        "best items, scaled to the best session's); 0 turns this off.",
        min=0.0,
    )

    # -- learning: extraction and summaries (docs/memory.md, Learning)
    extract_every: int = _setting(
        1, "Extract facts after every N-th user turn of a session (0: extraction off).", min=0
    )
    extract_model: str | None = _setting(
        None, "Model that extracts facts and writes summaries. Unset: the request's model."
    )
    extract_base_url: str | None = _setting(
        None,
        "OpenAI-compatible base URL for extraction and summary calls. Unset: the route that "
        "serves the extraction model.",
    )
    extract_api_key: str | None = _setting(
        None,
        "API key for extract_base_url. Unset: the route's key, else the client's own key "
        "(kept in memory only while the process runs, never stored).",
        secret=True,
    )
    learning_api_key: str | None = _setting(
        None,
        "Key the learning jobs send on a route that forwards the client's own key "
        "(bring-your-own-key, e.g. behind MEMPROXY_ANTHROPIC_BASE_URL), used when the route "
        "has no configured key. Unset: learning borrows the key of the user's latest request "
        "(in process memory only; after a restart a user's jobs wait for their next request). "
        "Needed when proxy keys are on and the route has no key of its own.",
        secret=True,
    )
    extract_min_confidence: float = _setting(
        0.7, "Extracted facts below this confidence (0-1) are not kept.", min=0.0, max=1.0
    )
    extract_min_importance: int = _setting(
        7, "Extracted facts below this importance (1-10) are not kept.", min=1, max=10
    )
    fact_merge_similarity: float = _setting(
        0.85,
        "Cosine similarity at or above which a new fact merges into an existing one "
        "(mentions + 1, confidence + 0.15).",
        min=0.0, max=1.0,
    )
    summary_every: int = _setting(
        5, "Summarise a session every N user turns (0: summaries off).", min=0
    )
    summary_max_tokens: int = _setting(
        300, "Token cap of a summary's readable text.", min=32, max=4000
    )
    fact_cap: int = _setting(
        150, "Most active facts per user: learning evicts the lowest-value ones beyond it.",
        min=1,
    )
    fact_prune_at: int = _setting(
        120, "Maintenance prunes a user's active facts down to this many once above it.", min=1
    )
    fact_expired_retention_days: int = _setting(
        90, "Days an expired fact is kept (not recalled) before it is deleted.", min=0
    )

    # -- learned memory: facts, summaries, profile
    fact_expiry_identity_days: int = _setting(
        365, "Days an extracted identity fact lives after it was last seen (0: never expires).",
        min=0,
    )
    fact_expiry_preference_days: int = _setting(
        180, "Days an extracted preference fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_project_days: int = _setting(
        60, "Days an extracted project fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_relationship_days: int = _setting(
        365, "Days an extracted relationship fact lives after it was last seen (0: never).",
        min=0,
    )
    fact_expiry_context_days: int = _setting(
        7, "Days an extracted context fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_todo_days: int = _setting(
        30, "Days an extracted todo fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_decision_days: int = _setting(
        180, "Days an extracted decision fact lives after it was last seen (0: never).", min=0
    )
    fact_max_pinned: int = _setting(
        10, "Most facts a user can pin (pinned facts never expire and are never evicted).",
        min=0, max=1000,
    )

    # -- background jobs and retention
    job_concurrency: int = _setting(2, "Background jobs run at once.", min=1, max=64)
    job_max_attempts: int = _setting(
        5, "Attempts before a failing job goes to the dead letters. An attempt that failed "
        "because PostgreSQL, Chroma or the upstream did not answer does not count: the job "
        "waits the outage out.", min=1
    )
    job_backoff_seconds: float = _setting(
        1.0, "First retry delay of a failed job; doubles each attempt.", min=0.0
    )
    job_outage_backoff_max_seconds: float = _setting(
        15.0, "Longest wait between retries of a job (or of settling one) while a backing "
        "service is unreachable: how long after the service answers again the job runs at "
        "most.", min=0.0
    )
    spool_max_turns: int = _setting(
        10000, "Most turns the local spool (data_dir/spool.sqlite3) holds while the database "
        "is unreachable; with it full, a request that would store turns is refused with 503 "
        "before it is forwarded, rather than answered and then lost (0: no spool; turns the "
        "database cannot take are reported in X-Memory-Error and lost).", min=0
    )
    job_lease_seconds: float = _setting(
        60.0, "PostgreSQL: how long a claimed job is held unless its worker renews it (at a "
        "third of this); a job of a replica that died runs again after it.", min=1.0,
    )
    metrics_retention_days: int = _setting(
        30, "Days a per-request metrics row is kept.", min=1
    )
    shutdown_grace_seconds: float = _setting(
        30.0, "How long a shutdown takes at most: in-flight streams and running jobs get it "
        "less a fifth (at most 1 s) kept for closing, then are cut.", min=0.0
    )

    @property
    def db_path(self) -> Path:
        """The SQLite database file."""
        return self.data_dir / "memproxy.db"

    @property
    def spool_path(self) -> Path:
        """The local spool of turns the database could not take yet."""
        return self.data_dir / "spool.sqlite3"

    @property
    def vectors_path(self) -> Path:
        """The Chroma persistent directory."""
        return self.data_dir / "vectors"

    def fact_lifetimes_days(self) -> dict[str, int]:
        """Lifetime in days of extracted facts per category (0: never expires)."""
        prefix = "fact_expiry_"
        return {
            f.name[len(prefix) : -len("_days")]: getattr(self, f.name)
            for f in setting_fields()
            if f.name.startswith(prefix)
        }

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed, each checked like a loaded value."""
        fields = {f.name: f for f in setting_fields()}
        errors = [f"{name}: unknown setting" for name in changes if name not in fields]
        values = {}
        for name, value in changes.items():
            if name in fields:
                try:
                    values[name] = _convert(fields[name], value)
                except (TypeError, ValueError) as exc:
                    errors.append(f"{name}: {exc}")
        if errors:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(errors))
        return dataclasses.replace(self, **values)


def setting_fields() -> list[dataclasses.Field[Any]]:
    """Every setting, in declaration order."""
    return list(dataclasses.fields(Settings))


def env_name(name: str) -> str:
    """The environment variable that sets field `name`."""
    return ENV_PREFIX + name.upper()


def load_settings(
    env: Mapping[str, str] | None = None, config_file: Path | str | None = None, *,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Read settings from a TOML file, `MEMPROXY_*` variables and command-line `flags`
    (highest priority: a flag's value replaces the variable's before it is checked);
    raise SettingsError. `config_file` is the `--config` flag's file."""
    env = os.environ if env is None else env
    flags = {name: value for name, value in (flags or {}).items() if value is not None}
    source = "--config" if config_file else ENV_PREFIX + "CONFIG"
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    raw: dict[str, Any] = {}
    errors: list[str] = []
    if config_file is not None:
        raw.update(_read_toml(Path(config_file), errors, source))
    for f in setting_fields():
        if f.metadata.get("env", True) and env_name(f.name) in env:
            raw[f.name] = env[env_name(f.name)]
    raw.update(flags)
    known = {f.name for f in setting_fields()}
    errors += [f"{key}: unknown setting" for key in raw if key not in known]
    values: dict[str, Any] = {}
    for f in setting_fields():
        if f.name in raw:
            try:
                values[f.name] = _convert(f, raw[f.name])
            except (TypeError, ValueError) as exc:
                where = f"--{f.name}" if f.name in flags else _source(f.name, env)
                errors.append(f"{where}: {exc}")
    if errors:
        raise SettingsError("invalid settings:\n  " + "\n  ".join(errors))
    return Settings(**values)


def _source(name: str, env: Mapping[str, str]) -> str:
    return env_name(name) if env_name(name) in env else name


def unknown_env_warnings(env: Mapping[str, str]) -> list[str]:
    """A warning for each MEMPROXY_* variable nothing reads (a typo is otherwise silently
    ignored, while the same typo in TOML is an error), naming the nearest known one."""
    known = {env_name(f.name) for f in setting_fields() if f.metadata.get("env", True)}
    known |= OTHER_ENV
    warnings = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        # Compared without the prefix, which every name shares.
        stems = {k.removeprefix(ENV_PREFIX): k for k in known}
        nearest = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), stems, n=1, cutoff=0.7)
        hint = f" (did you mean {stems[nearest[0]]}?)" if nearest else ""
        warnings.append(f"{name} is not a memproxy setting{hint}; it is ignored")
    return warnings


def describe_storage(settings: Settings) -> dict[str, str]:
    """Which database and vector store are in use, fit for a log line (no passwords)."""
    database = _without_password(settings.database_url) if settings.database_url else (
        f"sqlite:{settings.db_path}"
    )
    vectors = (f"chroma server {_without_password(settings.chroma_url)}" if settings.chroma_url
               else f"embedded chroma {settings.vectors_path}")
    return {"database": database, "vectors": vectors}


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _read_toml(path: Path, errors: list[str], source: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        errors.append(f"{source}: cannot read {path}: {exc}")
        return {}
    # Settings may sit at the top level or under a [memproxy] table.
    section = data.pop("memproxy", {})
    return {**data, **section}


def _convert(f: dataclasses.Field[Any], value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    meta = f.metadata
    if f.name == "routes":
        return value if _all(value, Route) else parse_routes(value)
    if f.name == "api_keys":
        return value if _all(value, ApiKey) else parse_api_keys(value)
    if kind == "bool":
        result: Any = _to_bool(value)
    elif kind == "int":
        result = _to_number(value, int)
    elif kind == "float":
        result = _to_number(value, float)
    elif kind in ("Path", "Path | None"):
        result = None if value in (None, "") and "None" in kind else Path(str(value)).expanduser()
    elif kind == "str | None":
        result = None if value in (None, "") else str(value)
    else:
        result = str(value)
    if "choices" in meta and str(result).lower() not in meta["choices"]:
        raise ValueError(f"must be one of {', '.join(meta['choices'])}, got {value!r}")
    if "choices" in meta:
        result = str(result).lower()
    if "min" in meta and result < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}, got {value!r}")
    if "max" in meta and result > meta["max"]:
        raise ValueError(f"must be <= {meta['max']}, got {value!r}")
    if f.name == "allowed_hosts" and result is not None:
        names = [name.strip() for name in str(result).split(",")]
        if not all(names) or any(re.search(r"[/\s@]", name) for name in names):
            raise ValueError(f"must be host names separated by commas, or *, got {value!r}")
    if (
        f.name in ("upstream_base_url", "extract_base_url", "anthropic_base_url")
        and result is not None
        and not str(result).startswith(("http://", "https://"))
    ):
        raise ValueError(f"must be an http(s) URL, got {value!r}")
    return result


def _all(value: Any, kind: type) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, kind) for v in value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"must be on/off (or true/false), got {value!r}")


def _to_number(value: Any, kind: type[int] | type[float]) -> int | float:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None

"""Settings of learning, learned memory and background jobs."""

from __future__ import annotations

from dataclasses import dataclass

from config.fields import setting
from config.sections.memory import MemorySettings


@dataclass(frozen=True)
class LearningSettings(MemorySettings):
    """Learning, learned memory, jobs and retention."""

    # -- learning: extraction and summaries (docs/memory.md, Learning)
    extract_every: int = setting(
        1, "Extract facts after every N-th user turn of a session (0: extraction off).", min=0
    )
    extract_model: str | None = setting(
        None, "Model that extracts facts and writes summaries. Unset: the request's model."
    )
    extract_base_url: str | None = setting(
        None,
        "OpenAI-compatible base URL for extraction and summary calls. Unset: the route that "
        "serves the extraction model.",
    )
    extract_api_key: str | None = setting(
        None,
        "API key for extract_base_url. Unset: the route's key, else the client's own key "
        "(kept in memory only while the process runs, never stored).",
        secret=True,
    )
    learning_api_key: str | None = setting(
        None,
        "Key the learning jobs send on a route that forwards the client's own key "
        "(bring-your-own-key, e.g. behind MEMPROXY_ANTHROPIC_BASE_URL), used when the route "
        "has no configured key. Unset: learning borrows the key of the user's latest request "
        "(in process memory only; after a restart a user's jobs wait for their next request). "
        "Needed when proxy keys are on and the route has no key of its own.",
        secret=True,
    )
    learning_api_key_url: str | None = setting(
        None,
        "Base URL of the upstream MEMPROXY_LEARNING_API_KEY belongs to: learning sends that "
        "key only to this scheme, host and port, never to another route's host. Unset: "
        "MEMPROXY_ANTHROPIC_BASE_URL when set, else MEMPROXY_UPSTREAM_BASE_URL.",
    )
    extract_min_confidence: float = setting(
        0.7, "Extracted facts below this confidence (0-1) are not kept.", min=0.0, max=1.0
    )
    extract_min_importance: int = setting(
        7, "Extracted facts below this importance (1-10) are not kept.", min=1, max=10
    )
    fact_merge_similarity: float = setting(
        0.85,
        "Cosine similarity at or above which a new fact merges into an existing one "
        "(mentions + 1, confidence + 0.15).",
        min=0.0, max=1.0,
    )
    summary_every: int = setting(
        5, "Summarise a session every N user turns (0: summaries off).", min=0
    )
    summary_max_tokens: int = setting(
        300, "Token cap of a summary's readable text.", min=32, max=4000
    )
    fact_cap: int = setting(
        150, "Most active facts per user: learning evicts the lowest-value ones beyond it.",
        min=1,
    )
    fact_prune_at: int = setting(
        120, "Maintenance prunes a user's active facts down to this many once above it.", min=1
    )
    fact_expired_retention_days: int = setting(
        90, "Days an expired fact is kept (not recalled) before it is deleted.", min=0
    )

    # -- learned memory: facts, summaries, profile
    fact_expiry_identity_days: int = setting(
        365, "Days an extracted identity fact lives after it was last seen (0: never expires).",
        min=0,
    )
    fact_expiry_preference_days: int = setting(
        180, "Days an extracted preference fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_project_days: int = setting(
        60, "Days an extracted project fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_relationship_days: int = setting(
        365, "Days an extracted relationship fact lives after it was last seen (0: never).",
        min=0,
    )
    fact_expiry_context_days: int = setting(
        7, "Days an extracted context fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_todo_days: int = setting(
        30, "Days an extracted todo fact lives after it was last seen (0: never).", min=0
    )
    fact_expiry_decision_days: int = setting(
        180, "Days an extracted decision fact lives after it was last seen (0: never).", min=0
    )
    fact_max_pinned: int = setting(
        10, "Most facts a user can pin (pinned facts never expire and are never evicted).",
        min=0, max=1000,
    )

    # -- background jobs and retention
    job_concurrency: int = setting(2, "Background jobs run at once.", min=1, max=64)
    job_max_attempts: int = setting(
        5, "Attempts before a failing job goes to the dead letters. An attempt that failed "
        "because PostgreSQL, Chroma or the upstream did not answer does not count: the job "
        "waits the outage out.", min=1
    )
    job_backoff_seconds: float = setting(
        1.0, "First retry delay of a failed job; doubles each attempt.", min=0.0
    )
    job_outage_backoff_max_seconds: float = setting(
        15.0, "Longest wait between retries of a job (or of settling one) while a backing "
        "service is unreachable: how long after the service answers again the job runs at "
        "most.", min=0.0
    )
    spool_max_turns: int = setting(
        10000, "Most turns the local spool (data_dir/spool.sqlite3) holds while the database "
        "is unreachable; with it full, a request that would store turns is refused with 503 "
        "before it is forwarded, rather than answered and then lost (0: no spool; turns the "
        "database cannot take are reported in X-Memory-Error and lost).", min=0
    )
    spool_max_turns_per_user: int = setting(
        1000, "Most turns one user may hold in the local spool (a share of "
        "MEMPROXY_SPOOL_MAX_TURNS), so one user cannot fill it for everyone: with the user's "
        "share full, that user's requests that would store turns get 503; a request whose "
        "own turns do not fit in what is left is answered, not remembered, and says so in "
        "X-Memory-Error.", min=1
    )
    job_lease_seconds: float = setting(
        60.0, "PostgreSQL: how long a claimed job is held unless its worker renews it (at a "
        "third of this); a job of a replica that died runs again after it.", min=1.0,
    )
    metrics_retention_days: int = setting(
        30, "Days a per-request metrics row is kept.", min=1
    )
    shutdown_grace_seconds: float = setting(
        30.0, "How long a shutdown takes at most: in-flight streams and running jobs get it "
        "less a fifth (at most 1 s) kept for closing, then are cut.", min=0.0
    )

"""Migration 0014_usage on both backends: the table `usage_daily` (memory/storage/usage.py),
one row per day (UTC), key and user; the quota reads a key's month through usage_by_key.
Kept here so the two migration lists stay within the module size (tests/test_layout.py)."""

from __future__ import annotations

from memory.storage import quota_schema

SQLITE = """
CREATE TABLE usage_daily (
    day TEXT NOT NULL,
    key_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    memory_tokens INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (day, key_id, user_id)
);
CREATE INDEX usage_by_key ON usage_daily (key_id, day);
"""

# PostgreSQL: the same, counters as BIGINT (a busy key's month of tokens outgrows INTEGER).
POSTGRES = SQLITE.replace("INTEGER", "BIGINT")

# The usage migrations of each backend's list, in order: 0014 here; 0015 the quota
# reservations and rate buckets (memory/storage/quota_schema.py).
SQLITE_MIGRATIONS = [("0014_usage", SQLITE), ("0015_quota_holds", quota_schema.SQLITE)]
POSTGRES_MIGRATIONS = [("0014_usage", POSTGRES), ("0015_quota_holds", quota_schema.POSTGRES)]

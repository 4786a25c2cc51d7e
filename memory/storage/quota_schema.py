"""Migration 0015_quota_holds on both backends: the tables `usage_reservations`
(memory/storage/reservations.py), the tokens each running request of a quota key holds,
and `rate_buckets` (memory/storage/rate_buckets.py), each proxy key's request-rate bucket
shared by every replica (docs/usage.md, docs/keys.md).

A reservation carries its own expiry (a lease), so one left by a replica that died stops
counting when its lease ends (LEASE_SECONDS, proxy/access/quota.py) without anyone
releasing it.
"""

from __future__ import annotations

SQLITE = """
CREATE TABLE usage_reservations (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX reservations_by_key ON usage_reservations (key_id, expires_at);
CREATE INDEX reservations_by_expiry ON usage_reservations (expires_at);
CREATE TABLE rate_buckets (
    bucket TEXT PRIMARY KEY,
    tokens REAL NOT NULL,
    updated REAL NOT NULL
);
"""

# PostgreSQL: token counts as BIGINT, times and bucket levels as DOUBLE PRECISION.
POSTGRES = SQLITE.replace("INTEGER", "BIGINT").replace("REAL", "DOUBLE PRECISION")

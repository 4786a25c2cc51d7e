"""The values a memory setting and its per-request header share (settings and flags both
read them; neither imports the other for them)."""

from __future__ import annotations

MAX_BUDGET = 100_000
# Recall's widest scope, narrowest first (X-Memory-Scope).
SCOPES = ("session", "user", "organization")
PLACEMENTS = ("system", "last_user")
MODES = ("inject", "tool")
INJECTIONS = ("stable", "fresh")
# The rerank stage (MEMPROXY_RERANK); X-Memory-Rerank turns a configured one on or off.
RERANKERS = ("off", "endpoint", "llm")

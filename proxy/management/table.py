"""The memory API's and the admin API's operations, as their modules declare them: what
the router serves and the OpenAPI document describes (proxy/management/operations.py)."""

from __future__ import annotations

from proxy.management import (
    admin_keys,
    admin_usage,
    clearing,
    facts,
    profile,
    search,
    sessions,
    stats,
    transfer,
)
from proxy.management.operations import declared

MEMORY_API = declared(facts, sessions, search, clearing, transfer, profile, stats)
ADMIN_API = declared(admin_keys, admin_usage)

"""What each MCP tool tells a client: its name, description, input schema, output schema and
annotations (MCP 2025-06-18, "Tools"). The checks the schemas promise are made again on
every call (proxy/mcp/tools.py): a client may send anything."""

from __future__ import annotations

from typing import Any

import mcp_types as types

from config.choices import MAX_BUDGET, SCOPES
from memory import CATEGORIES, MAX_TEXT_CHARS
from proxy.access.identity import MAX_ID_LENGTH

MAX_QUERY_CHARS = 8000  # as POST /v1/memory/search
MAX_LIST_PAGE = 100
MAX_TTL_DAYS = 36500.0
KINDS = ("fact", "summary")

_ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "description": "f<n> a fact, s<n> a summary, c<n> a turn"},
        "kind": {"type": "string", "description": "turn, fact, summary or profile"},
        "text": {"type": "string"},
        "created_at": {"type": "number", "description": "unix seconds"},
        "session_id": {"type": "string"},
        "score": {"type": "number"},
    },
    "required": ["id", "kind", "text", "created_at", "session_id"],
}
_FACT = {
    "type": "object",
    "properties": {
        "id": {"type": "string"}, "kind": {"type": "string"}, "text": {"type": "string"},
        "category": {"type": "string"}, "pinned": {"type": "boolean"},
        "importance": {"type": "integer"}, "created_at": {"type": "number"},
        "expires_at": {"type": ["number", "null"]}, "session_id": {"type": ["string", "null"]},
        "shared": {"type": "boolean"},
        "source": {"type": "string", "description": "extracted, manual, import or mcp"},
        "client": {"type": ["string", "null"],
                   "description": "the MCP client that added it, as it named itself"},
    },
    "required": ["id", "kind", "text", "created_at"],
}
_SHARED = {
    "type": "boolean", "default": False,
    "description": "The organisation's shared memory instead of your own (your key's "
                   "organisation; changing it needs an org-writer key).",
}


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


TOOLS: dict[str, types.Tool] = {tool.name: tool for tool in (
    types.Tool(
        name="search_memory",
        title="Search memory",
        description=(
            "Recall what the user told any of their AI apps before: the same memory a chat "
            "through memproxy is reminded of, ranked (meaning, words, recency) and cut to a "
            "token budget. Call it before answering a question that may depend on the user's "
            "history, preferences or projects. Returns the items (ids, kinds, dates, sessions) "
            "and `block`, the fenced text a chat would be given."
        ),
        input_schema=_schema({
            "query": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS,
                      "description": "What to recall, in natural language."},
            "budget": {"type": "integer", "minimum": 0, "maximum": MAX_BUDGET,
                       "description": "At most this many tokens (default: the server's)."},
            "scope": {"type": "string", "enum": list(SCOPES),
                      "description": "session, user or organization (adds the org's shared "
                                     "memory); default: the server's."},
            "session_id": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH,
                           "description": "The session scope session reads."},
        }, ["query"]),
        output_schema=_schema({
            "query": {"type": "string"}, "scope": {"type": "string"},
            "budget": {"type": "integer"}, "tokens": {"type": "integer"},
            "truncated": {"type": "boolean"}, "block": {"type": "string"},
            "items": {"type": "array", "items": _ITEM},
        }, ["query", "scope", "budget", "tokens", "truncated", "block", "items"]),
        annotations=types.ToolAnnotations(
            title="Search memory", read_only_hint=True, destructive_hint=False,
            idempotent_hint=True, open_world_hint=False,
        ),
    ),
    types.Tool(
        name="add_memory",
        title="Add a memory",
        description=(
            "Save one fact or note about the user for every later conversation (a preference, "
            "a decision, a project detail), written as a short third-person statement, e.g. "
            "\"User prefers tabs over spaces\". Secrets are redacted before storing; saving "
            "what is already known counts one more mention, and a new value of the same thing "
            "(\"User lives in Lisbon\" after \"User lives in Berlin\") replaces the old one. "
            "Use `pinned` for what must always be remembered and `ttl_days` for what expires."
        ),
        input_schema=_schema({
            "text": {"type": "string", "minLength": 1, "maxLength": MAX_TEXT_CHARS},
            "category": {"type": "string", "enum": list(CATEGORIES), "default": "context"},
            "importance": {"type": "integer", "minimum": 1, "maximum": 10, "default": 5},
            "pinned": {"type": "boolean", "default": False,
                       "description": "Never expires, never evicted (a few per user)."},
            "ttl_days": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TTL_DAYS,
                         "description": "Forget it after this many days."},
            "shared": _SHARED,
        }, ["text"]),
        output_schema=_FACT,
        annotations=types.ToolAnnotations(
            title="Add a memory", read_only_hint=False, destructive_hint=False,
            idempotent_hint=False, open_world_hint=False,
        ),
    ),
    types.Tool(
        name="list_memories",
        title="List memories",
        description=(
            "List the facts (or session summaries) memproxy keeps about the user, newest "
            "first, a page at a time; pass `next_cursor` back as `cursor` for the next page."
        ),
        input_schema=_schema({
            "kind": {"type": "string", "enum": list(KINDS), "default": "fact"},
            "category": {"type": "string", "enum": list(CATEGORIES),
                         "description": "Facts of this category only."},
            "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIST_PAGE, "default": 20},
            "cursor": {"type": "string", "maxLength": 20},
            "shared": _SHARED,
        }, []),
        output_schema=_schema({
            "items": {"type": "array", "items": _FACT},
            "next_cursor": {"type": ["string", "null"]},
        }, ["items", "next_cursor"]),
        annotations=types.ToolAnnotations(
            title="List memories", read_only_hint=True, destructive_hint=False,
            idempotent_hint=True, open_world_hint=False,
        ),
    ),
    types.Tool(
        name="delete_memory",
        title="Delete a memory",
        description=(
            "Delete one memory by the id search_memory or list_memories gave (f<n> a fact "
            "with its history, s<n> a session summary). It is not recalled again; the "
            "returned undo_token brings it back with undo_delete until expires_at."
        ),
        input_schema=_schema({
            "id": {"type": "string", "pattern": "^[fs]?[0-9]{1,18}$", "maxLength": 19},
        }, ["id"]),
        output_schema=_schema({
            "id": {"type": "string"}, "deleted": {"type": "boolean"},
            "shared": {"type": "boolean"}, "undo_token": {"type": "string"},
            "expires_at": {"type": "number"},
        }, ["id", "deleted", "shared", "undo_token", "expires_at"]),
        annotations=types.ToolAnnotations(
            title="Delete a memory", read_only_hint=False, destructive_hint=True,
            idempotent_hint=True, open_world_hint=False,
        ),
    ),
    types.Tool(
        name="undo_delete",
        title="Undo a deletion",
        description=(
            "Bring back a memory delete_memory removed, with the undo_token it returned, "
            "before its expires_at. The memory comes back under a new id."
        ),
        input_schema=_schema({
            "undo_token": {"type": "string", "minLength": 1, "maxLength": 200},
        }, ["undo_token"]),
        output_schema=_schema({
            "restored": {"type": "boolean"},
            "added": {"type": "object", "additionalProperties": {"type": "integer"}},
        }, ["restored", "added"]),
        annotations=types.ToolAnnotations(
            title="Undo a deletion", read_only_hint=False, destructive_hint=False,
            idempotent_hint=True, open_world_hint=False,
        ),
    ),
    types.Tool(
        name="read_profile",
        title="Read the user's profile",
        description=(
            "The user's profile (name, role, preferences...) when the user consented to one; "
            "`consent` false means no profile is kept."
        ),
        input_schema=_schema({}, []),
        output_schema=_schema({
            "consent": {"type": "boolean"},
            "profile": {"type": ["object", "null"]},
        }, ["consent", "profile"]),
        annotations=types.ToolAnnotations(
            title="Read the profile", read_only_hint=True, destructive_hint=False,
            idempotent_hint=True, open_world_hint=False,
        ),
    ),
)}

PROFILE_URI = "memproxy://profile"
SUMMARY_TEMPLATE = "memproxy://sessions/{session_id}/summary"

RESOURCES = [
    types.Resource(
        uri=PROFILE_URI, name="profile", title="Your profile",
        description="The profile memproxy keeps (with consent), as JSON.",
        mime_type="application/json",
    ),
]
TEMPLATES = [
    types.ResourceTemplate(
        uri_template=SUMMARY_TEMPLATE, name="session-summary", title="A session's summary",
        description="The current summary of one of your sessions, as text.",
        mime_type="text/plain",
    ),
]

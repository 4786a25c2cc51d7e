"""OpenAPI schemas of the records /v1/memory/import takes (memory/admin/record_checks.py checks them).

Records may carry other fields, which are ignored, so schemas allow additional properties.
"""

from __future__ import annotations

from typing import Any

from memory import CATEGORIES, FACT_SOURCES, MAX_CLIENT_CHARS, MAX_TEXT_CHARS
from proxy.access.identity import MAX_ID_LENGTH

# At least one character that is not whitespace to Python (str.strip) nor to ECMAScript.
NON_BLANK = r"[^\s\x1c-\x1f\x85]"
TEXT = {"type": "string", "minLength": 1, "maxLength": MAX_TEXT_CHARS, "pattern": NON_BLANK}
ID_TEXT = {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH, "pattern": NON_BLANK}
SECONDS = {"type": "number", "minimum": 0, "maximum": 32503680000}
_INT = {"type": "integer", "minimum": -(2**63) + 1, "maximum": 2**63 - 1}
_COUNT = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1, "nullable": True}

TURN_ROLES = ["user", "assistant", "tool"]
_PARTS = {"type": "array", "items": {"type": "object"}}
_CALLS = {"type": "array", "items": {"type": "object", "properties": {
    "function": {"type": "object", "nullable": True}}}}


def _message(
    roles: list[str], *, required: str | None = None, content: dict[str, Any] | None = None,
    tool_calls: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One shape of a conversation message (record_checks._conversation accepts these)."""
    return {
        "type": "object", "required": ["role"] + ([required] if required else []),
        "properties": {
            "role": {"type": "string", "enum": roles},
            "content": content or {"oneOf": [{"type": "string", "nullable": True}, _PARTS]},
            "name": {"type": "string", "maxLength": MAX_ID_LENGTH, "nullable": True},
            "timestamp": {**SECONDS, "nullable": True},
            "created_at": {**SECONDS, "nullable": True},
            "create_time": {**SECONDS, "nullable": True},
            "tool_calls": tool_calls or {**_CALLS, "nullable": True},
        },
    }


RECORD_SCHEMAS: dict[str, Any] = {
    "TurnRecord": {
        "type": "object", "required": ["type", "session_id", "role", "content"],
        "properties": {
            "type": {"type": "string", "enum": ["turn"]}, "id": {**_INT, "nullable": True},
            "session_id": ID_TEXT, "parent_id": {**_INT, "nullable": True},
            "role": {"type": "string", "enum": ["user", "assistant", "tool"]},
            "content": {"type": "string", "minLength": 1, "pattern": NON_BLANK},
            "name": {"type": "string", "maxLength": MAX_ID_LENGTH, "nullable": True},
            "created_at": {**SECONDS, "nullable": True},
            "model": {"type": "string", "maxLength": MAX_ID_LENGTH, "nullable": True},
            "tokens": _COUNT,
            "request_id": {"type": "string", "maxLength": MAX_ID_LENGTH, "nullable": True},
            "incomplete": {"type": "boolean"},
        },
    },
    "FactRecord": {
        "type": "object", "required": ["type", "text", "category"],
        "properties": {
            "type": {"type": "string", "enum": ["fact"]}, "id": {**_INT, "nullable": True},
            "text": TEXT, "category": {"type": "string", "enum": list(CATEGORIES)},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "importance": {"type": "integer", "minimum": 1, "maximum": 10, "nullable": True},
            "mentions": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1, "nullable": True},
            "source": {"type": "string", "enum": list(FACT_SOURCES)},
            "source_session": {"type": "string", "maxLength": MAX_ID_LENGTH, "nullable": True},
            "client": {"type": "string", "maxLength": MAX_CLIENT_CHARS, "nullable": True},
            "source_turn_ids": {"type": "array", "items": _INT},
            "pinned": {"type": "boolean"},
            "version": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1, "nullable": True},
            "previous_id": {**_INT, "nullable": True},
            "superseded_by": {**_INT, "nullable": True},
            **{name: {**SECONDS, "nullable": True} for name in (
                "first_seen", "last_seen", "expires_at", "valid_from", "valid_to",
                "created_at", "updated_at")},
        },
    },
    "SummaryRecord": {
        "type": "object", "required": ["type", "session_id", "text"],
        "properties": {
            "type": {"type": "string", "enum": ["summary"]},
            "id": {**_INT, "nullable": True}, "session_id": ID_TEXT,
            "text": {"type": "string", "minLength": 1, "pattern": NON_BLANK},
            "data": {"type": "object", "properties": {
                key: {"type": "array", "items": {"type": "string"}}
                for key in ("facts", "preferences", "decisions", "todos", "entities")}},
            "source_turn_ids": {"type": "array", "items": _INT},
            "last_turn_id": {**_INT, "nullable": True},
            "user_turns": _COUNT,
            "tokens": _COUNT,
            "superseded_by": {**_INT, "nullable": True},
            "created_at": {**SECONDS, "nullable": True},
        },
    },
    "ProfileRecord": {
        "type": "object", "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["profile"]}, "consent": {"type": "boolean"},
            "profile": {"type": "object", "nullable": True,
                        "properties": {"fields": {"type": "object"},
                                       "text": {"type": "string"}}},
        },
    },
    "MetaRecord": {
        "type": "object", "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["meta"]},
            "format": {"type": "string", "enum": ["memproxy-export"]},
            "version": {"type": "integer", "minimum": 1, "maximum": 1},
        },
    },
    "Conversation": {
        "type": "object", "required": ["messages"],
        "description": "OpenAI chat format. system, developer and function messages, and"
                       " messages whose content has no text part, are left out and counted"
                       " in the report's `ignored`; any other role, or a user, assistant or"
                       " tool message with empty content and no tool_calls, is a 400 naming"
                       " messages[i].role or messages[i].content. Records may carry other"
                       " fields too (they are ignored).",
        "properties": {
            "type": {"type": "string", "enum": ["conversation"]},
            "session_id": {**ID_TEXT, "nullable": True,
                           "description": "Unset: the session a chat with this start gets."},
            "created_at": {**SECONDS, "nullable": True},
            "timestamp": {**SECONDS, "nullable": True},
            "create_time": {**SECONDS, "nullable": True},
            "messages": {"type": "array", "minItems": 1, "items": {"anyOf": [
                # left out and counted; a turn needs text: in its content, or its tool calls
                _message(["system", "developer", "function"]),
                _message(TURN_ROLES, required="content", content={"type": "string", "pattern": NON_BLANK}),
                _message(TURN_ROLES, required="content", content={**_PARTS, "minItems": 1}),
                _message(TURN_ROLES, required="tool_calls", tool_calls={**_CALLS, "minItems": 1}),
            ]}},
        },
    },
}

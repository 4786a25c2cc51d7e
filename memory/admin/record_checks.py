"""Checking imported records: every field typed and bounded before anything is written.

`check_record` takes one parsed JSON line (an export record, or a conversation in OpenAI's
message format) and returns it normalised, or raises RecordError naming the field.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from memory.admin.records import FORMAT, VERSION
from memory.learning.facts import CATEGORIES, MAX_CLIENT_CHARS, MAX_TEXT_CHARS, SOURCES
from memory.learning.profiles import MAX_PROFILE_CHARS
from memory.learning.summaries import SUMMARY_KEYS
from memory.log.messages import TURN_ROLES, turn_text

MAX_ID_CHARS = 256
TYPES = ("meta", "turn", "fact", "summary", "profile", "conversation")


class RecordError(ValueError):
    """A record that cannot be imported; `field` names the offending part."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def check_record(raw: Any) -> dict[str, Any]:
    """The record, normalised (times as unix seconds); RecordError when it is invalid."""
    if not isinstance(raw, Mapping):
        raise RecordError("each line must be a JSON object")
    kind = raw.get("type")
    if "type" not in raw and "messages" in raw:
        kind = "conversation"  # OpenAI's chat format: {"messages": [...]} per line
    if kind not in TYPES:
        raise RecordError(f"type must be one of {', '.join(TYPES)}", "type")
    return {"type": kind, **_CHECKS[kind](raw)}


def _meta(raw: Mapping[str, Any]) -> dict[str, Any]:
    if raw.get("format", FORMAT) != FORMAT:
        raise RecordError(f"format must be {FORMAT!r}", "format")
    version = raw.get("version", VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
        raise RecordError(f"this memproxy reads export version {VERSION} or older", "version")
    return {}


def _turn(raw: Mapping[str, Any]) -> dict[str, Any]:
    role = raw.get("role")
    if not isinstance(role, str) or role not in TURN_ROLES:
        raise RecordError(f"role must be one of {', '.join(sorted(TURN_ROLES))}", "role")
    content = raw.get("content")
    if not isinstance(content, str) or not content.strip():
        raise RecordError("content must be a non-empty string", "content")
    return {
        "id": _opt_int(raw, "id"),
        "session_id": _ident(raw.get("session_id"), "session_id"),
        "has_parent": "parent_id" in raw,
        "parent_id": _opt_int(raw, "parent_id"),
        "role": role,
        "content": content,
        "name": _opt_str(raw, "name", MAX_ID_CHARS),
        "created_at": _time(raw.get("created_at"), "created_at"),
        "model": _opt_str(raw, "model", MAX_ID_CHARS),
        "tokens": _opt_int(raw, "tokens", minimum=0),
        "request_id": _opt_str(raw, "request_id", MAX_ID_CHARS),
        "incomplete": _bool(raw, "incomplete", False),
    }


def _fact(raw: Mapping[str, Any]) -> dict[str, Any]:
    text = raw.get("text")
    if not isinstance(text, str) or not text.strip() or len(text.strip()) > MAX_TEXT_CHARS:
        raise RecordError(f"text must be 1 to {MAX_TEXT_CHARS} characters", "text")
    if raw.get("category") not in CATEGORIES:
        raise RecordError(f"category must be one of {', '.join(CATEGORIES)}", "category")
    source = raw.get("source", "import")
    if source not in SOURCES:
        raise RecordError(f"source must be one of {', '.join(SOURCES)}", "source")
    confidence = _number(raw, "confidence", 0.6)
    if not 0.0 <= confidence <= 1.0:
        raise RecordError("confidence must be between 0 and 1", "confidence")
    importance = _opt_int(raw, "importance", minimum=1)
    if importance is not None and importance > 10:
        raise RecordError("importance must be an integer from 1 to 10", "importance")
    return {
        "id": _opt_int(raw, "id"),
        "text": text.strip(),
        "category": raw["category"],
        "confidence": confidence,
        "importance": 5 if importance is None else importance,
        "mentions": _opt_int(raw, "mentions", minimum=1) or 1,
        "source": source,
        "source_session": _opt_str(raw, "source_session", MAX_ID_CHARS),
        "client": _opt_str(raw, "client", MAX_CLIENT_CHARS),  # absent before provenance
        "source_turn_ids": _int_list(raw, "source_turn_ids"),
        "pinned": _bool(raw, "pinned", False),
        "first_seen": _time(raw.get("first_seen"), "first_seen", default=None),
        "last_seen": _time(raw.get("last_seen"), "last_seen", default=None),
        "expires_at": _time(raw.get("expires_at"), "expires_at", default=None),
        "version": _opt_int(raw, "version", minimum=1) or 1,
        "previous_id": _opt_int(raw, "previous_id"),
        "valid_from": _time(raw.get("valid_from"), "valid_from", default=None),
        "valid_to": _time(raw.get("valid_to"), "valid_to", default=None),
        "superseded_by": _opt_int(raw, "superseded_by"),
        "created_at": _time(raw.get("created_at"), "created_at", default=None),
        "updated_at": _time(raw.get("updated_at"), "updated_at", default=None),
    }


def _summary(raw: Mapping[str, Any]) -> dict[str, Any]:
    text = raw.get("text")
    if not isinstance(text, str) or not text.strip():
        raise RecordError("text must be a non-empty string", "text")
    data = raw.get("data", {})
    if not isinstance(data, Mapping):
        raise RecordError("data must be an object", "data")
    clean: dict[str, list[str]] = {}
    for key in SUMMARY_KEYS:
        values = data.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise RecordError(f"data.{key} must be a list of strings", f"data.{key}")
        clean[key] = values
    return {
        "id": _opt_int(raw, "id"),
        "session_id": _ident(raw.get("session_id"), "session_id"),
        "text": text.strip(),
        "data": clean,
        "source_turn_ids": _int_list(raw, "source_turn_ids"),
        "last_turn_id": _opt_int(raw, "last_turn_id"),
        "user_turns": _opt_int(raw, "user_turns", minimum=0) or 0,
        "tokens": _opt_int(raw, "tokens", minimum=0) or 0,
        "superseded_by": _opt_int(raw, "superseded_by"),
        "created_at": _time(raw.get("created_at"), "created_at", default=None),
    }


def _profile(raw: Mapping[str, Any]) -> dict[str, Any]:
    consent = _bool(raw, "consent", False)
    body = raw.get("profile")
    if body is None:
        return {"consent": consent, "profile": None}
    if not isinstance(body, Mapping):
        raise RecordError("profile must be an object or null", "profile")
    fields, text = body.get("fields", {}), body.get("text", "")
    if not isinstance(fields, Mapping) or not isinstance(text, str):
        raise RecordError("profile needs fields (an object) and text (a string)", "profile")
    if len(json.dumps(dict(fields), ensure_ascii=False)) + len(text) > MAX_PROFILE_CHARS:
        raise RecordError(f"a profile is at most {MAX_PROFILE_CHARS} characters", "profile")
    return {"consent": consent, "profile": {"fields": dict(fields), "text": text}}


# Roles of OpenAI's chat format that are not turns: instructions are configuration, and a
# legacy `function` result is not kept (as chat requests do not keep it). An import counts
# each, with messages whose content has no text (an image alone), in its report.
LEFT_OUT_ROLES = ("system", "developer", "function")
IGNORED = (*LEFT_OUT_ROLES, "no_text")
_ROLES = ", ".join(sorted({*TURN_ROLES, *LEFT_OUT_ROLES}))


def _conversation(raw: Mapping[str, Any]) -> dict[str, Any]:
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError("messages must be a non-empty list", "messages")
    start = _first_time(raw, ("created_at", "timestamp", "create_time"), "", _NOW)
    turns = []
    ignored = dict.fromkeys(IGNORED, 0)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RecordError("each message needs a role", where)
        calls = message.get("tool_calls")
        if calls is not None and not _calls(calls):
            raise RecordError("tool_calls must be a list of objects (each function an object)",
                              f"{where}.tool_calls")
        at = _first_time(message, ("timestamp", "created_at", "create_time"), where, start)
        name = _opt_str(message, "name", MAX_ID_CHARS)
        content = message.get("content")
        if not (content is None or isinstance(content, str) or (
            isinstance(content, list) and all(isinstance(part, Mapping) for part in content)
        )):
            raise RecordError("content must be a string or a list of parts", f"{where}.content")
        role = message["role"]
        if role in LEFT_OUT_ROLES:
            ignored[role] += 1
            continue
        if role not in TURN_ROLES:
            raise RecordError(f"role must be one of {_ROLES}", f"{where}.role")
        if not ((content.strip() if isinstance(content, str) else content) or calls):
            raise RecordError("content must be non-empty text or a list of parts (or the"
                              " message needs tool_calls)", f"{where}.content")
        text = turn_text(message)
        if not text.strip():
            ignored["no_text"] += 1  # parts without text: an image, audio
            continue
        turns.append({"role": role, "content": text, "created_at": at, "name": name})
    session = raw.get("session_id")
    return {
        "session_id": None if session is None else _ident(session, "session_id"),
        "messages": list(messages),
        "turns": turns,
        "ignored": ignored,
    }


def _calls(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(call, Mapping)
        and (call.get("function") is None or isinstance(call["function"], Mapping))
        for call in calls
    )


_CHECKS = {
    "meta": _meta, "turn": _turn, "fact": _fact, "summary": _summary, "profile": _profile,
    "conversation": _conversation,
}


def _first_time(raw: Mapping[str, Any], names: tuple[str, ...], where: str, default: Any) -> Any:
    """The first of several time fields that is set; every one that is set must be valid."""
    prefix = f"{where}." if where else ""
    times = [_time(raw[name], prefix + name) for name in names if raw.get(name) is not None]
    return times[0] if times else _time(None, where, default)


def _ident(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_ID_CHARS:
        raise RecordError(f"{field} must be a string of 1 to {MAX_ID_CHARS} characters", field)
    return value.strip()


def _opt_str(raw: Mapping[str, Any], field: str, limit: int) -> str | None:
    value = raw.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise RecordError(f"{field} must be a string of at most {limit} characters", field)
    return value


def _opt_int(raw: Mapping[str, Any], field: str, *, minimum: int | None = None) -> int | None:
    value = raw.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) >= 2**63:
        raise RecordError(f"{field} must be an integer", field)
    if minimum is not None and value < minimum:
        raise RecordError(f"{field} must be at least {minimum}", field)
    return value


def _int_list(raw: Mapping[str, Any], field: str) -> list[int]:
    value = raw.get(field, [])
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63 for v in value
    ):
        raise RecordError(f"{field} must be a list of integers", field)
    return value


def _number(raw: Mapping[str, Any], field: str, default: float) -> float:
    value = raw.get(field, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise RecordError(f"{field} must be a number", field)
    return float(value)


def _bool(raw: Mapping[str, Any], field: str, default: bool) -> bool:
    value = raw.get(field, default)
    if not isinstance(value, bool):
        raise RecordError(f"{field} must be true or false", field)
    return value


_NOW: Any = object()


def _time(value: Any, field: str, default: Any = _NOW) -> Any:
    """Unix seconds from a number or an ISO 8601 string; `default` when absent."""
    if value is None:
        return time.time() if default is _NOW else default
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        # Milliseconds (JavaScript's Date.now()) are read as such.
        seconds = float(value) / 1000 if value > 1e11 else float(value)
        if 0 <= seconds <= 32503680000:  # up to the year 3000
            return seconds
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if parsed.tzinfo is None:
                raise RecordError(f"{field}: an ISO 8601 time needs a time zone", field)
            return parsed.timestamp()
    raise RecordError(f"{field} must be unix seconds or an ISO 8601 time", field)

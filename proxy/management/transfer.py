"""Export (streamed JSON Lines) and import (the same records, or OpenAI-format conversations).

Import reads the whole body, checks every record before writing any, then writes: turns
through the exactly-once log (their indexing goes through the durable job queue), facts,
summaries and the profile. Importing the same body twice adds nothing the second time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from memory import RecordError, check_record
from proxy.access.identity import conversation_fingerprint
from proxy.http.body import read_body
from proxy.http.errors import InvalidRequest
from proxy.management.access import Caller, respond
from proxy.management.inputs import MAX_DEPTH, nested_too_deep
from proxy.management.operations import NDJSON, memory

FLUSH_BYTES = 64 * 1024
MAX_REPORTED_ERRORS = 5


@memory("GET /export", "Export as JSON Lines (streamed)", {
    "description": "meta, turns, facts, summaries, profile: one JSON object per line",
    "content": {NDJSON: {"schema": {"type": "string"}}}})
async def export(request: Request, who: Caller) -> Response:
    """GET /v1/memory/export: meta, turns, facts, summaries and profile, one JSON per line."""
    records = who.memory.manage.records.records(who.user_id)

    async def lines() -> AsyncIterator[bytes]:
        buffer = bytearray()
        async for record in records:
            buffer += orjson.dumps(record) + b"\n"
            if len(buffer) >= FLUSH_BYTES:
                yield bytes(buffer)
                buffer.clear()
        if buffer:
            yield bytes(buffer)

    return StreamingResponse(lines(), media_type=NDJSON, headers={
        "Content-Disposition": 'attachment; filename="memproxy-export.jsonl"',
        "Cache-Control": "no-store",
    })


@memory("POST /import", "Import JSON Lines of records or OpenAI-format conversations"
        " (idempotent)", "ImportReport", "400", "413", body="records")
async def import_records(request: Request, who: Caller) -> Response:
    """POST /v1/memory/import: JSON Lines (or one JSON array) of records or conversations."""
    raw = await read_body(request, who.settings.max_body_bytes)
    records = parse_records(raw)
    user_id = who.user_id

    def session_of(messages: Sequence[Mapping[str, Any]]) -> str:
        # The same session a chat with this conversation's start would land in.
        return conversation_fingerprint(user_id, messages)

    report = await who.memory.manage.importer.run(user_id, records, session_of=session_of)
    return respond({"object": "memory.import", "records": len(records), **report.as_dict()})


def parse_records(raw: bytes) -> list[dict[str, Any]]:
    """Checked records from a JSON Lines body (or a JSON array); 400 naming bad lines."""
    try:
        items = _items(raw)
    except UnicodeDecodeError:
        raise InvalidRequest("the body must be UTF-8 text") from None
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    param = None
    for number, item in items:
        try:
            if isinstance(item, _Unparsable):
                raise RecordError("not valid JSON")
            if nested_too_deep(item):
                raise RecordError(f"nests deeper than {MAX_DEPTH} levels")
            records.append(check_record(item))
        except RecordError as exc:
            param = param or exc.field
            errors.append(f"line {number}: {exc}")
    if errors:
        more = f" (and {len(errors) - MAX_REPORTED_ERRORS} more)" if len(errors) > MAX_REPORTED_ERRORS else ""
        raise InvalidRequest(
            "; ".join(errors[:MAX_REPORTED_ERRORS]) + more, param=param, code="invalid_record"
        )
    if not records:
        raise InvalidRequest("nothing to import: send JSON Lines of records or conversations")
    return records


class _Unparsable:
    """A line that is not JSON."""


def _items(raw: bytes) -> list[tuple[int, Any]]:
    text = raw.decode("utf-8").lstrip("\ufeff")
    items: list[tuple[int, Any]] = []
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and friends unescaped.
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                items.append((number, orjson.loads(line)))
            except orjson.JSONDecodeError:
                items.append((number, _Unparsable()))
    if len(items) == 1 and isinstance(items[0][1], list):
        return list(enumerate(items[0][1], start=1))
    if not any(isinstance(item, _Unparsable) for _, item in items):
        return items
    try:  # not JSON Lines: one JSON array of records, or one pretty-printed record
        whole = orjson.loads(text)
    except orjson.JSONDecodeError:
        return items
    return list(enumerate(whole, start=1)) if isinstance(whole, list) else [(1, whole)]

"""Clear all of a user's memory, and undo it within the window (memory/admin/clearing.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from proxy.management.access import Caller, respond
from proxy.management.bodies import ClearRequest, UndoRequest
from proxy.management.inputs import json_body
from proxy.management.operations import memory


@memory("POST /clear", "Clear all memory; returns an undo token", "Clear", "400", "413",
        body=ClearRequest, body_required=False)
async def clear_all(request: Request, who: Caller) -> Response:
    """POST /v1/memory/clear: everything goes; an undo token brings it back in the window."""
    await json_body(request, who.settings.max_body_bytes, ClearRequest, empty_ok=True)
    receipt = await who.memory.manage.clears.clear(who.user_id)
    return respond({
        "object": "memory.clear", "undo_seconds": who.settings.clear_undo_seconds,
        **receipt.as_dict(),
    })


@memory("POST /clear/undo", "Undo a clear or a fact's deletion within its window (409 after it)",
        "ImportReport", "400", "404", "409", "413", body=UndoRequest)
async def undo_clear(request: Request, who: Caller) -> Response:
    """POST /v1/memory/clear/undo: 404 for an unknown token, 409 once the window ended."""
    body = await json_body(request, who.settings.max_body_bytes, UndoRequest)
    report = await who.memory.manage.clears.undo(who.user_id, body.undo_token)
    return respond({"object": "memory.clear.undo", "restored": True, **report.as_dict()})

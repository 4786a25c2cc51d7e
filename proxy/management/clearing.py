"""Clear all of a user's memory, and undo it within the window (memory/admin/clearing.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from proxy.management.access import Caller, endpoint, respond
from proxy.management.bodies import ClearRequest, UndoRequest
from proxy.management.inputs import json_body


@endpoint
async def clear_all(request: Request, who: Caller) -> Response:
    """POST /v1/memory/clear: everything goes; an undo token brings it back in the window."""
    await json_body(request, who.settings.max_body_bytes, ClearRequest, empty_ok=True)
    receipt = await who.memory.manage.clears.clear(who.user_id)
    return respond({
        "object": "memory.clear", "undo_seconds": who.settings.clear_undo_seconds,
        **receipt.as_dict(),
    })


@endpoint
async def undo_clear(request: Request, who: Caller) -> Response:
    """POST /v1/memory/clear/undo: 404 for an unknown token, 409 once the window ended."""
    body = await json_body(request, who.settings.max_body_bytes, UndoRequest)
    report = await who.memory.manage.clears.undo(who.user_id, body.undo_token)
    return respond({"object": "memory.clear.undo", "restored": True, **report.as_dict()})

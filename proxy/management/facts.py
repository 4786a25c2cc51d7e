"""Facts: list (category, pinned, text filters; cursor pages), get, add, edit, delete, pin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from memory import Fact
from proxy.http.errors import Conflict, NotFound
from proxy.management.access import Caller, page, respond
from proxy.management.bodies import FactChanges, FactQuery, NewFact
from proxy.management.inputs import digits_cursor, json_body, path_id, query
from proxy.management.operations import memory


def fact_json(fact: Fact, redact: Callable[[str], str]) -> dict[str, Any]:
    """A fact as the API shows it, its text redacted again: a fact stored before a secret's
    shape was known, or while redaction was off, leaves redacted (docs/security.md)."""
    return {"object": "memory.fact", **fact.as_dict(), "text": redact(fact.text)}


@memory("GET /facts", "List facts, newest first", "FactList", "400", query=FactQuery)
async def list_facts(request: Request, who: Caller) -> Response:
    """GET /v1/memory/facts"""
    asked = query(request, FactQuery)
    facts, cursor = await who.memory.facts.list(
        who.user_id,
        category=asked.category, pinned=asked.pinned, query=asked.q,
        include_inactive=asked.include_inactive, limit=asked.limit, cursor=digits_cursor(asked.cursor),
    )
    return respond(page([fact_json(f, who.memory.redact) for f in facts], cursor))


@memory("POST /facts", "Add a fact (manual facts start at confidence 0.6)", "Fact", "400",
        "409", "413", status="201", body=NewFact)
async def add_fact(request: Request, who: Caller) -> Response:
    """POST /v1/memory/facts"""
    body = await json_body(request, who.settings.max_body_bytes, NewFact)
    fact = await who.memory.facts.add(
        who.user_id, body.text, body.category, confidence=body.confidence,
        importance=body.importance, pinned=body.pinned, expires_at=body.expires_at,
        source="manual",
    )
    return respond(fact_json(fact, who.memory.redact), 201)


@memory("GET /facts/{fact_id}", "Get one fact (any version)", "Fact", "404")
async def get_fact(request: Request, who: Caller) -> Response:
    """GET /v1/memory/facts/{fact_id}"""
    fact = await _found(who, path_id(request, "fact_id"))
    return respond(fact_json(fact, who.memory.redact))


@memory("PATCH /facts/{fact_id}",
        "Edit: a new version; the old one is kept as history (409: an old version)", "Fact",
        "400", "404", "409", "413", body=FactChanges)
async def edit_fact(request: Request, who: Caller) -> Response:
    """PATCH /v1/memory/facts/{fact_id}: a new version; the old one stays as history."""
    fact_id = path_id(request, "fact_id")
    body = await json_body(request, who.settings.max_body_bytes, FactChanges)
    await _current(who, fact_id)
    fact = await who.memory.facts.edit(who.user_id, fact_id, **body.given())
    return respond(fact_json(fact, who.memory.redact))


@memory("DELETE /facts/{fact_id}", "Delete a fact and its history; the undo token restores it"
        " within the clear window", "Deleted", "404")
async def delete_fact(request: Request, who: Caller) -> Response:
    """DELETE /v1/memory/facts/{fact_id}: the fact and its whole history, with an undo token
    that POST /v1/memory/clear/undo takes until the clear window ends."""
    fact_id = path_id(request, "fact_id")
    receipt = await who.memory.manage.clears.remove_fact(who.user_id, fact_id)
    if receipt is None:
        raise NotFound(f"no fact {fact_id}", param="fact_id")
    return respond({
        "object": "memory.fact.deleted", "id": fact_id, "deleted": True,
        "undo_token": receipt.undo_token, "expires_at": receipt.expires_at,
    })


@memory("POST /facts/{fact_id}/pin", "Pin (never expires, never evicted; 409 at the pin limit)",
        "Fact", "404", "409")
async def pin_fact(request: Request, who: Caller) -> Response:
    """POST /v1/memory/facts/{fact_id}/pin: 409 at the pin limit."""
    fact_id = await _current(who, path_id(request, "fact_id"))
    fact = await who.memory.facts.set_pinned(who.user_id, fact_id, True)
    return respond(fact_json(fact, who.memory.redact))


@memory("POST /facts/{fact_id}/unpin", "Unpin", "Fact", "404", "409")
async def unpin_fact(request: Request, who: Caller) -> Response:
    """POST /v1/memory/facts/{fact_id}/unpin"""
    fact_id = await _current(who, path_id(request, "fact_id"))
    fact = await who.memory.facts.set_pinned(who.user_id, fact_id, False)
    return respond(fact_json(fact, who.memory.redact))


@memory("GET /facts/{fact_id}/history", "Every version of a fact, oldest first", "FactList",
        "404")
async def fact_history(request: Request, who: Caller) -> Response:
    """GET /v1/memory/facts/{fact_id}/history: every version, oldest first."""
    fact_id = path_id(request, "fact_id")
    versions = await who.memory.facts.history(who.user_id, fact_id)
    if not versions:
        raise NotFound(f"no fact {fact_id}", param="fact_id")
    return respond(page([fact_json(f, who.memory.redact) for f in versions], None))


async def _current(who: Caller, fact_id: int) -> int:
    """The id, once it names a current version: 404 unknown, 409 superseded."""
    fact = await _found(who, fact_id)
    if fact.valid_to is not None:
        raise Conflict(
            f"fact {fact_id} is an old version (superseded by {fact.superseded_by});"
            " change the current one", param="fact_id", code="fact_superseded",
        )
    return fact_id


async def _found(who: Caller, fact_id: int) -> Fact:
    """The fact, any version; 404 when the user has none of this id."""
    fact = await who.memory.facts.get(who.user_id, fact_id)
    if fact is None:
        raise NotFound(f"no fact {fact_id}", param="fact_id")
    return fact

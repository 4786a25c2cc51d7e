"""The MCP tools' work, on the memory engine's public surface and the memory API's checks.

Whose memory a call reaches is the HTTP request's (its key and X-Memory-* headers, decided
when proxy/mcp/server.py authorises it as the memory API does), never an argument: a prompt
can write arguments. A tool that changes memory asks proxy/access/decision.py's `decide` for
"write" on the memory it changes, so an organisation's shared memory changes only for an org
writer.

Every failure a client can cause is a `ToolFailure` (or the memory API's own error), which
the server turns into a tool result marked as an error: nothing is stored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from memory import (
    ClearExpired,
    ClearNotFound,
    ClearReceipt,
    Fact,
    organization_memory,
)
from proxy.access.decision import Action
from proxy.http.errors import Conflict, InvalidRequest, NotFound
from proxy.management.access import Caller
from proxy.management.bodies import Body, UndoRequest, parse
from proxy.management.inputs import digits_cursor
from proxy.management.profile import profile_state
from proxy.management.search import DEFAULT_MODEL, searched
from proxy.mcp.schemas import (
    ARGUMENTS,
    DeleteRequest,
    ListRequest,
    NewMemory,
    NoArguments,
    SearchArguments,
)

DAY = 86400.0


Tool = Callable[[Caller, Any], Awaitable[dict[str, Any]]]  # Any: the tool's own arguments


def arguments(name: str, given: Mapping[str, Any] | None) -> Body:
    """The arguments as the tool declares them (proxy/mcp/schemas.py); 400-style error
    naming the first bad one, an unknown name first."""
    return parse(ARGUMENTS[name], dict(given or {}), noun="argument")


async def search_memory(who: Caller, args: SearchArguments) -> dict[str, Any]:
    """What a chat would be reminded of for `query` (as POST /v1/memory/search)."""
    who.decide(user_id=who.user_id, org_id=who.org_id, action="read")
    scope, budget, recalled = await searched(
        who, args.query, scope=args.scope, session_id=args.session_id or who.session_id,
        budget=args.budget, model=DEFAULT_MODEL,
    )
    return {
        "query": args.query, "scope": scope, "budget": budget, "tokens": recalled.tokens,
        "truncated": recalled.truncated, "block": recalled.block,
        "items": [
            {"id": item.id, "kind": item.source, "text": who.memory.redact(item.text),
             "created_at": item.created_at, "session_id": item.session_id,
             "score": round(item.score, 4)}
            for item in recalled.items
        ],
    }


async def add_memory(who: Caller, args: NewMemory) -> dict[str, Any]:
    """One fact, kept as learned facts are (redacted, merged into a duplicate, superseding
    the same subject's old value, its category's lifetime or `ttl_days`, pinned on
    request), with its provenance: source 'mcp' and the client's name."""
    ttl = args.ttl_days
    owner, shared = _target(who, args.shared, "write")
    fact = await who.memory.remember_fact(
        owner, args.text, args.category, importance=args.importance,
        pinned=args.pinned, ttl_seconds=None if ttl is None else ttl * DAY,
        source="mcp", source_session=who.session_id, client=who.client,
    )
    return fact_json(fact, shared)


async def list_memories(who: Caller, args: ListRequest) -> dict[str, Any]:
    """A page of facts or summaries, newest first."""
    category, limit, cursor = args.category, args.limit, digits_cursor(args.cursor)
    owner, shared = _target(who, args.shared, "read")
    if args.kind == "fact":
        facts, after = await who.memory.facts.list(
            owner, category=category, limit=limit, cursor=cursor
        )
        return {"items": [fact_json(f, shared, who.memory.redact) for f in facts],
                "next_cursor": after}
    if category is not None:
        raise InvalidRequest("category filters facts only", param="category")
    found = await who.memory.summaries.list(owner)
    if cursor is not None:
        found = [s for s in found if s.id < int(cursor)]
    page = found[:limit]
    return {
        "items": [
            {"id": f"s{s.id}", "kind": "summary", "text": who.memory.redact(s.text),
             "created_at": s.created_at,
             "session_id": s.session_id, "shared": shared}
            for s in page
        ],
        "next_cursor": str(page[-1].id) if len(found) > limit else None,
    }


async def delete_memory(who: Caller, args: DeleteRequest) -> dict[str, Any]:
    """One fact (its whole history) or summary by id; the org's fact for an org writer.
    Kept for the memory API's undo window: `undo_delete` with the token brings it back."""
    raw = args.id
    kind, digits = ("summary", raw[1:]) if raw.startswith("s") else ("fact", raw.removeprefix("f"))
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 18:
        raise InvalidRequest("id must look like f12 (a fact) or s3 (a summary)", param="id")
    item_id = int(digits)
    clears = who.memory.manage.clears
    who.decide(user_id=who.user_id, org_id=None, action="write")
    if kind == "summary":
        return _deleted(raw, await clears.remove_summary(who.user_id, item_id), shared=False)
    if await who.memory.facts.get(who.user_id, item_id) is not None:
        return _deleted(raw, await clears.remove_fact(who.user_id, item_id), shared=False)
    if who.org_id is not None:
        shared_owner = organization_memory(who.org_id)
        if await who.memory.facts.get(shared_owner, item_id) is not None:
            who.decide(user_id=None, org_id=who.org_id, action="write")
            return _deleted(raw, await clears.remove_fact(shared_owner, item_id), shared=True)
    raise NotFound(f"no memory {raw}", param="id")


async def undo_delete(who: Caller, args: UndoRequest) -> dict[str, Any]:
    """Bring back what delete_memory removed, inside the undo window: the caller's own
    memory, or its organisation's for an org writer."""
    token = args.undo_token
    clears = who.memory.manage.clears
    owner = await clears.owner(token)
    shared = who.org_id is not None and owner == organization_memory(who.org_id)
    if owner is None or (owner != who.user_id and not shared):
        raise NotFound("no deletion with this undo token", param="undo_token")
    who.decide(user_id=None if shared else who.user_id, org_id=who.org_id if shared else None,
               action="write")
    try:
        report = await clears.undo(owner, token)
    except ClearNotFound:
        raise NotFound("no deletion with this undo token", param="undo_token") from None
    except ClearExpired as exc:
        raise Conflict(str(exc), param="undo_token", code="undo_expired") from None
    return {"restored": True, "added": {k: n for k, n in report.added.items() if n}}


def _deleted(raw: str, receipt: ClearReceipt | None, *, shared: bool) -> dict[str, Any]:
    if receipt is None:
        raise NotFound(f"no memory {raw}", param="id")
    return {
        "id": raw, "deleted": True, "shared": shared, "undo_token": receipt.undo_token,
        "expires_at": receipt.expires_at,
    }


async def read_profile(who: Caller, args: NoArguments) -> dict[str, Any]:
    """Consent and the profile (as GET /v1/memory/profile)."""
    who.decide(user_id=who.user_id, org_id=None, action="read")
    return await profile_state(who)


async def session_summary(who: Caller, session_id: str) -> str | None:
    """The current summary of one of the caller's sessions."""
    who.decide(user_id=who.user_id, org_id=None, action="read")
    summary = await who.memory.summaries.latest(who.user_id, session_id)
    return None if summary is None else who.memory.redact(summary.text)


def fact_json(fact: Fact, shared: bool, redact: Callable[[str], str] = str) -> dict[str, Any]:
    """A fact as the tools show it; a listing redacts its text again (a fact stored before
    a secret's shape was known leaves redacted, docs/security.md)."""
    return {
        "id": f"f{fact.id}", "kind": "fact", "text": redact(fact.text), "category": fact.category,
        "pinned": fact.pinned, "importance": fact.importance, "created_at": fact.created_at,
        "expires_at": fact.expires_at, "session_id": fact.source_session, "shared": shared,
        "source": fact.source, "client": fact.client,
    }


def _target(who: Caller, shared: bool, action: Action) -> tuple[str, bool]:
    """The memory a call reads or changes: the caller's, or (`shared`) its organisation's,
    once `decide` allows it."""
    if not shared:
        who.decide(user_id=who.user_id, org_id=None, action=action)
        return who.user_id, False
    if who.org_id is None:
        raise InvalidRequest(
            "shared memory needs an organisation: an org key or X-Memory-Org-Id", param="shared"
        )
    who.decide(user_id=None, org_id=who.org_id, action=action)
    return organization_memory(who.org_id), True


HANDLERS: dict[str, Tool] = {
    "search_memory": search_memory,
    "add_memory": add_memory,
    "list_memories": list_memories,
    "delete_memory": delete_memory,
    "undo_delete": undo_delete,
    "read_profile": read_profile,
}

"""Sessions and turns: list sessions with counts and last activity, read turns, delete."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from memory import turn_dict
from proxy.access.identity import MAX_ID_LENGTH
from proxy.http.errors import InvalidRequest, NotFound
from proxy.management.access import Caller, page, respond
from proxy.management.bodies import SessionQuery, TurnQuery
from proxy.management.inputs import digits_cursor, query
from proxy.management.operations import memory


def _session_id(raw: str) -> str:
    # Any id may be looked up; one that was never stored is simply not found.
    if not raw or len(raw) > MAX_ID_LENGTH:
        raise InvalidRequest(f"session_id must be 1 to {MAX_ID_LENGTH} characters",
                             param="session_id")
    return raw


@memory("GET /sessions", "Sessions, most recently active first", "SessionList", "400",
        query=SessionQuery)
async def list_sessions(request: Request, who: Caller) -> Response:
    """GET /v1/memory/sessions: most recently active first."""
    asked = query(request, SessionQuery)
    sessions, cursor = await who.memory.manage.sessions.list(
        who.user_id, limit=asked.limit, cursor=asked.cursor,
    )
    return respond(page([{"object": "memory.session", **s.as_dict()} for s in sessions], cursor))


@memory("GET /sessions/{session_id:path}", "One session with its counts", "Session", "400",
        "404")
async def get_session(request: Request, who: Caller) -> Response:
    """GET /v1/memory/sessions/{session_id}"""
    session_id = _session_id(request.path_params["session_id"])
    found = await who.memory.manage.sessions.get(who.user_id, session_id)
    if found is None:
        raise NotFound(f"no session {session_id!r}", param="session_id")
    return respond({"object": "memory.session", **found.as_dict()})


@memory("DELETE /sessions/{session_id:path}",
        "Delete a session: turns, chunks, vectors, summaries, facts only from it", "Deleted",
        "400", "404")
async def delete_session(request: Request, who: Caller) -> Response:
    """DELETE /v1/memory/sessions/{session_id}: its turns, chunks, vectors, summaries and
    the facts learned only from it."""
    session_id = _session_id(request.path_params["session_id"])
    removed = await who.memory.manage.sessions.delete(who.user_id, session_id)
    if removed is None:
        raise NotFound(f"no session {session_id!r}", param="session_id")
    return respond({
        "object": "memory.session.deleted", "id": session_id, "deleted": True, "removed": removed,
    })


@memory("GET /turns", "A session's turns in stored order", "TurnList", "400", "404",
        query=TurnQuery)
async def list_turns(request: Request, who: Caller) -> Response:
    """GET /v1/memory/turns?session_id=...: a session's turns in the order they were stored."""
    asked = query(request, TurnQuery)
    session_id = _session_id(asked.session_id)
    after = digits_cursor(asked.cursor)
    turns, next_after = await who.memory.manage.sessions.turns(
        who.user_id, session_id, limit=asked.limit,
        after=int(after or 0),
    )
    if not turns and after is None and await who.memory.manage.sessions.get(who.user_id, session_id) is None:
        raise NotFound(f"no session {session_id!r}", param="session_id")
    # Redacted again on the way out, as an export is (docs/security.md).
    data = [{"object": "memory.turn", **turn_dict(t), "content": who.memory.redact(t.content)}
            for t in turns]
    return respond(page(data, None if next_after is None else str(next_after)))

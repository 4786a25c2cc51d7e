"""What each MCP tool tells a client: its name, description, input schema, output schema and
annotations (MCP 2025-06-18, "Tools"). Each tool's arguments and answer are declared once
here; the arguments' model also checks every call (proxy/mcp/tools.py): a client may send
anything. The schemas are made from the declarations (proxy/management/bodies.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

import mcp_types as types
from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict

from config.choices import MAX_BUDGET, SCOPES
from proxy.management.bodies import (
    STRIPPED,
    Body,
    Category,
    FactText,
    IdText,
    UndoRequest,
    characters,
    json_schema,
)

MAX_QUERY_CHARS = 8000  # as POST /v1/memory/search
MAX_LIST_PAGE = 100
MAX_TTL_DAYS = 36500.0
KINDS = ("fact", "summary")
Shared = Annotated[bool, Field(description=(
    "The organisation's shared memory instead of your own (your key's organisation; changing"
    " it needs an org-writer key)."))]


Budget = Annotated[int, Field(ge=0, le=MAX_BUDGET, description=(
    "At most this many tokens (default: the server's)."))]
Scope = Annotated[Literal[SCOPES], Field(description=(  # type: ignore[valid-type]
    "session, user or organization (adds the org's shared memory); default: the server's."))]
Days = Annotated[float, Field(gt=0, le=MAX_TTL_DAYS, description="Forget it after this many days.")]


class SearchArguments(Body):
    query: Annotated[str, characters(MAX_QUERY_CHARS), STRIPPED, Field(
        description="What to recall, in natural language.")]
    budget: Budget = None  # type: ignore[assignment]
    scope: Scope = None
    session_id: IdText = Field(  # type: ignore[assignment]
        None, description="The session scope session reads.")


class NewMemory(Body):
    text: FactText
    category: Category = "context"
    importance: Annotated[int, Field(ge=1, le=10)] = 5
    pinned: Annotated[bool, Field(description="Never expires, never evicted (a few per user).")] = False
    ttl_days: Days = None  # type: ignore[assignment]
    shared: Shared = False


class ListRequest(Body):
    kind: Literal[KINDS] = "fact"  # type: ignore[valid-type]
    category: Category = Field(None, description="Facts of this category only.")
    limit: Annotated[int, Field(ge=1, le=MAX_LIST_PAGE)] = 20
    cursor: Annotated[str, characters(20), STRIPPED] = None  # type: ignore[assignment]
    shared: Shared = False


class DeleteRequest(Body):
    # The pattern is told, not checked here: the tool's own check names the two kinds of id.
    id: Annotated[str, characters(19), STRIPPED, Field(json_schema_extra={"pattern": "^[fs]?[0-9]{1,18}$"})]


class NoArguments(Body):
    pass


# An answer holds its keys only; a nested one says so itself, or it would take its parent's.
Closed = with_config(ConfigDict(extra="forbid"))
Open = with_config(ConfigDict(extra="ignore"))


@Open
class Item(TypedDict):
    id: Annotated[str, Field(description="f<n> a fact, s<n> a summary, c<n> a turn")]
    kind: Annotated[str, Field(description="turn, fact, summary or profile")]
    text: str
    created_at: Annotated[float, Field(description="unix seconds")]
    session_id: str
    score: NotRequired[float]


@Open
class Memory(TypedDict):
    id: str
    kind: str
    text: str
    category: NotRequired[str]
    pinned: NotRequired[bool]
    importance: NotRequired[int]
    created_at: float
    expires_at: NotRequired[float | None]
    session_id: NotRequired[str | None]
    shared: NotRequired[bool]
    source: NotRequired[Annotated[str, Field(description="extracted, manual, import or mcp")]]
    client: NotRequired[Annotated[str | None, Field(
        description="the MCP client that added it, as it named itself")]]


@Closed
class Recalled(TypedDict):
    query: str
    scope: str
    budget: int
    tokens: int
    truncated: bool
    block: str
    items: list[Item]


@Closed
class Memories(TypedDict):
    items: list[Memory]
    next_cursor: str | None


@Closed
class Removed(TypedDict):
    id: str
    deleted: bool
    shared: bool
    undo_token: str
    expires_at: float


@Closed
class Restored(TypedDict):
    restored: bool
    added: dict[str, int]


@Closed
class ProfileAnswer(TypedDict):
    consent: bool
    profile: dict[str, Any] | None


def _tool(
    name: str, title: str, arguments: type[Body], answer: Any, description: str, *,
    read_only: bool, destructive: bool = False, idempotent: bool = True, short: str = "",
) -> tuple[types.Tool, type[Body]]:
    """A tool as listed, its schemas made from its declarations, with its arguments' model."""
    return types.Tool(
        name=name, title=title, description=description,
        input_schema=json_schema(arguments), output_schema=json_schema(answer),
        annotations=types.ToolAnnotations(
            title=short or title, read_only_hint=read_only, destructive_hint=destructive,
            idempotent_hint=idempotent, open_world_hint=False,
        ),
    ), arguments


_DECLARED = (
    _tool("search_memory", "Search memory", SearchArguments, Recalled, (
        "Recall what the user told any of their AI apps before: the same memory a chat "
        "through memproxy is reminded of, ranked (meaning, words, recency) and cut to a "
        "token budget. Call it before answering a question that may depend on the user's "
        "history, preferences or projects. Returns the items (ids, kinds, dates, sessions) "
        "and `block`, the fenced text a chat would be given."
    ), read_only=True),
    _tool("add_memory", "Add a memory", NewMemory, Memory, (
        "Save one fact or note about the user for every later conversation (a preference, "
        "a decision, a project detail), written as a short third-person statement, e.g. "
        "\"User prefers tabs over spaces\". Secrets are redacted before storing; saving "
        "what is already known counts one more mention, and a new value of the same thing "
        "(\"User lives in Lisbon\" after \"User lives in Berlin\") replaces the old one. "
        "Use `pinned` for what must always be remembered and `ttl_days` for what expires."
    ), read_only=False, idempotent=False),
    _tool("list_memories", "List memories", ListRequest, Memories, (
        "List the facts (or session summaries) memproxy keeps about the user, newest "
        "first, a page at a time; pass `next_cursor` back as `cursor` for the next page."
    ), read_only=True),
    _tool("delete_memory", "Delete a memory", DeleteRequest, Removed, (
        "Delete one memory by the id search_memory or list_memories gave (f<n> a fact "
        "with its history, s<n> a session summary). It is not recalled again; the "
        "returned undo_token brings it back with undo_delete until expires_at."
    ), read_only=False, destructive=True),
    _tool("undo_delete", "Undo a deletion", UndoRequest, Restored, (
        "Bring back a memory delete_memory removed, with the undo_token it returned, "
        "before its expires_at. The memory comes back under a new id."
    ), read_only=False),
    _tool("read_profile", "Read the user's profile", NoArguments, ProfileAnswer, (
        "The user's profile (name, role, preferences...) when the user consented to one; "
        "`consent` false means no profile is kept."
    ), read_only=True, short="Read the profile"),
)
TOOLS: dict[str, types.Tool] = {tool.name: tool for tool, _ in _DECLARED}
ARGUMENTS: dict[str, type[Body]] = {tool.name: model for tool, model in _DECLARED}

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

"""The answers of the memory and admin APIs, declared once: the OpenAPI document's answer
schemas are made from these (proxy/management/bodies.py, `openapi_schema`).

memproxy builds its answers from the memory engine's dataclasses. Where an answer is such a
dataclass with its `object` kind, it is declared as that (Session, Clear); the others are
typed dicts, where a key not marked `NotRequired` is always there and `X | None` may be
null. The tests check every answer against the document (tests/support/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, NotRequired, TypeVar

from pydantic import ConfigDict, Field, create_model, with_config
from typing_extensions import TypedDict

from memory import FACT_SOURCES, IGNORED, ClearReceipt, SessionInfo
from proxy.management.bodies import Category

T = TypeVar("T")
Counted = dict[str, int]  # how many of each kind


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(TypedDict):
    error: ErrorDetail


class Page(TypedDict, Generic[T]):
    object: Literal["list"]
    data: list[T]
    has_more: bool
    next_cursor: str | None


class Fact(TypedDict):
    object: Literal["memory.fact"]
    id: int
    user_id: NotRequired[str]
    text: str
    category: Category
    confidence: float
    importance: int
    mentions: NotRequired[int]
    source: NotRequired[Literal[FACT_SOURCES]]  # type: ignore[valid-type]
    source_session: NotRequired[str | None]
    client: NotRequired[str | None]
    source_turn_ids: NotRequired[list[int]]
    pinned: bool
    first_seen: NotRequired[float]
    last_seen: NotRequired[float]
    expires_at: NotRequired[float | None]
    version: int
    previous_id: NotRequired[int | None]
    valid_from: NotRequired[float]
    valid_to: NotRequired[float | None]
    superseded_by: NotRequired[int | None]
    created_at: NotRequired[float]
    updated_at: NotRequired[float]
    active: bool


class Deleted(TypedDict):
    object: str
    id: int | str
    deleted: bool
    removed: NotRequired[Counted]
    undo_token: NotRequired[str]
    expires_at: NotRequired[float]


@dataclass(frozen=True)
class Session(SessionInfo):  # as memory keeps it, with its kind
    object: Literal["memory.session"]


class Turn(TypedDict):
    object: Literal["memory.turn"]
    id: int
    session_id: str
    parent_id: NotRequired[int | None]
    position: NotRequired[int]
    role: str
    name: NotRequired[str | None]
    content: str
    created_at: float
    model: NotRequired[str | None]
    tokens: NotRequired[int]
    incomplete: NotRequired[bool]


class SearchItem(TypedDict):
    source: str
    id: str
    turn_id: NotRequired[int]
    session_id: NotRequired[str]
    speaker: NotRequired[str]
    created_at: NotRequired[float]
    text: str
    score: float
    signals: dict[str, float]


class SearchResult(TypedDict):
    object: Literal["memory.search"]
    query: str
    user_id: NotRequired[str]
    session_id: NotRequired[str | None]
    scope: str
    budget: int
    model: NotRequired[str]
    block: Annotated[str, Field(description="Exactly what would be injected.")]
    items: list[SearchItem]
    tokens: int
    truncated: NotRequired[bool]
    candidates: NotRequired[int]
    recall_ms: NotRequired[float]
    embed_ms: NotRequired[float]
    skipped: NotRequired[str | None]


@dataclass(frozen=True)
class Clear(ClearReceipt):  # the receipt, with its kind and the window it was given
    object: Literal["memory.clear"]
    undo_seconds: float


# One count per reason a conversation message is left out (memory/admin/record_checks.py).
Ignored = create_model(  # the reasons are data, so not a class statement
    "Ignored", __config__=ConfigDict(extra="forbid"),
    **{reason: (Annotated[int, Field(ge=0)], ...) for reason in IGNORED},  # type: ignore[call-overload]
)


class ImportReport(TypedDict):
    object: str
    records: NotRequired[int]
    restored: NotRequired[bool]
    added: Counted
    updated: NotRequired[Annotated[Counted, Field(
        description="Stored fact versions that took a newer file's state.")]]
    skipped: Annotated[Counted, Field(description="Records already there, by kind.")]
    ignored: NotRequired[Annotated[Ignored, Field(  # type: ignore[valid-type]
        description="Conversation messages left out on purpose: system, developer and legacy"
                    " function messages, and messages with no text.")]]


class ProfileData(TypedDict, total=False):
    fields: dict[str, Any]
    text: str
    created_at: float
    updated_at: float


class Profile(TypedDict):
    object: Literal["memory.profile"]
    user_id: NotRequired[str]
    consent: bool
    profile: ProfileData | None


class Jobs(TypedDict):
    depth: int
    dead: int
    dead_letters: list[dict[str, Any]]


class Stats(TypedDict):
    object: Literal["memory.stats"]
    user_id: NotRequired[str]
    counts: dict[str, Any]
    index: dict[str, Any]
    # null, and index sizes absent, for a key that is not the admin's where keys are set
    jobs: Jobs | None
    pending_clears: NotRequired[list[dict[str, Any]]]
    limits: NotRequired[dict[str, Any]]


class MetricsSummary(TypedDict):
    requests: int
    recall_ms_p50: float | None
    recall_ms_p95: float | None
    recall_ms_max: float | None
    injected_tokens_mean: float | None
    injected_tokens_max: int | None
    truncated: int
    errors: int


class MetricsRow(TypedDict, total=False):
    created_at: float
    session_id: str | None
    request_id: str | None
    model: str | None
    items: Counted
    injected_tokens: int
    truncated: bool
    recall_ms: float | None
    embed_ms: float | None
    error: str | None


class Metrics(TypedDict):
    object: Literal["list"]
    since: float
    until: float
    summary: Annotated[MetricsSummary, Field(
        description="Of every row in [since, until), not this page.")]
    data: list[MetricsRow]
    has_more: bool
    next_cursor: str | None


@with_config(ConfigDict(extra="forbid"))
class ApiKey(TypedDict):
    object: Literal["api_key"]
    id: str
    source: Literal["database", "env"]
    prefix: Annotated[str | None, Field(description="The secret's start, for display.")]
    user: str | None
    org: str | None
    org_writer: bool
    expires_at: float | None
    rate_limit: int | None
    token_quota: int | None
    created_at: float | None
    last_used_at: float | None
    revoked_at: float | None
    status: Literal["active", "revoked", "expired"]


class ApiKeyCreated(ApiKey):
    key: Annotated[str, Field(pattern="^mp-[0-9a-f]{8}_[A-Za-z0-9_-]{43}$",
                              description="The secret: shown here once, never again.")]


@with_config(ConfigDict(extra="forbid"))
class ApiKeyList(TypedDict):
    object: Literal["list"]
    data: list[ApiKey]


Count = Annotated[int, Field(ge=0)]
Day = Annotated[str, Field(pattern="^[0-9]{4}-[0-9]{2}-[0-9]{2}$",
                           json_schema_extra={"format": "date"})]


class Usage(TypedDict):
    requests: Count
    input_tokens: Count
    output_tokens: Count
    memory_tokens: Count
    errors: Count


class KeyUsage(Usage):
    key_id: str


class UserUsage(Usage):
    user_id: str


class DayUsage(KeyUsage, UserUsage):
    day: Day


UsageReport = TypedDict("UsageReport", {  # "from" is a keyword
    "object": Literal["usage.report"],
    "from": Day,
    "to": Day,
    "key_id": NotRequired[str | None],
    "user": NotRequired[str | None],
    "data": list[DayUsage],
    "has_more": Annotated[bool, Field(description="More rows than `limit` matched.")],
    "by_key": list[KeyUsage],
    "by_user": list[UserUsage],
    "totals": Usage,
})

ANSWERS: dict[str, Any] = {
    "Error": Error, "Fact": Fact, "FactList": Page[Fact], "Deleted": Deleted,
    "Session": Session, "SessionList": Page[Session], "Turn": Turn, "TurnList": Page[Turn],
    "SearchResult": SearchResult, "Clear": Clear, "ImportReport": ImportReport,
    "Profile": Profile, "Stats": Stats, "Metrics": Metrics, "ApiKey": ApiKey,
    "ApiKeyCreated": ApiKeyCreated, "ApiKeyList": ApiKeyList, "UsageReport": UsageReport,
}

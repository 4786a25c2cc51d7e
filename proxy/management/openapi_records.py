"""The records /v1/memory/import takes, declared for the OpenAPI document
(memory/admin/record_checks.py checks them, line by line, naming the line).

Records may carry other fields, which are ignored, so the schemas allow additional properties.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict

from memory import FACT_SOURCES, MAX_CLIENT_CHARS
from proxy.access.identity import MAX_ID_LENGTH
from proxy.management.bodies import NON_BLANK, Category, Confidence, FactText, IdText, Seconds

Int = Annotated[int, Field(ge=-(2**63) + 1, le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
Ordinal = Annotated[int, Field(ge=1, le=2**63 - 1)]
Name = Annotated[str, Field(max_length=MAX_ID_LENGTH)]
Said = Annotated[str, Field(min_length=1, pattern=NON_BLANK)]
Time = Seconds | None
TurnRole = Literal["user", "assistant", "tool"]
Parts = list[dict[str, Any]]


class TurnRecord(TypedDict):
    type: Literal["turn"]
    id: NotRequired[Int | None]
    session_id: IdText
    parent_id: NotRequired[Int | None]
    role: TurnRole
    content: Said
    name: NotRequired[Name | None]
    created_at: NotRequired[Time]
    model: NotRequired[Name | None]
    tokens: NotRequired[Count | None]
    request_id: NotRequired[Name | None]
    incomplete: NotRequired[bool]


class FactRecord(TypedDict):
    type: Literal["fact"]
    id: NotRequired[Int | None]
    text: FactText
    category: Category
    confidence: NotRequired[Confidence]
    importance: NotRequired[Annotated[int, Field(ge=1, le=10)] | None]
    mentions: NotRequired[Ordinal | None]
    source: NotRequired[Literal[FACT_SOURCES]]  # type: ignore[valid-type]
    source_session: NotRequired[Name | None]
    client: NotRequired[Annotated[str, Field(max_length=MAX_CLIENT_CHARS)] | None]
    source_turn_ids: NotRequired[list[Int]]
    pinned: NotRequired[bool]
    version: NotRequired[Ordinal | None]
    previous_id: NotRequired[Int | None]
    superseded_by: NotRequired[Int | None]
    first_seen: NotRequired[Time]
    last_seen: NotRequired[Time]
    expires_at: NotRequired[Time]
    valid_from: NotRequired[Time]
    valid_to: NotRequired[Time]
    created_at: NotRequired[Time]
    updated_at: NotRequired[Time]


class SummaryData(TypedDict, total=False):
    facts: list[str]
    preferences: list[str]
    decisions: list[str]
    todos: list[str]
    entities: list[str]


class SummaryRecord(TypedDict):
    type: Literal["summary"]
    id: NotRequired[Int | None]
    session_id: IdText
    text: Said
    data: NotRequired[SummaryData]
    source_turn_ids: NotRequired[list[Int]]
    last_turn_id: NotRequired[Int | None]
    user_turns: NotRequired[Count | None]
    tokens: NotRequired[Count | None]
    superseded_by: NotRequired[Int | None]
    created_at: NotRequired[Time]


class ProfileData(TypedDict, total=False):
    fields: dict[str, Any]
    text: str


class ProfileRecord(TypedDict):
    type: Literal["profile"]
    consent: NotRequired[bool]
    profile: NotRequired[ProfileData | None]


class MetaRecord(TypedDict):
    type: Literal["meta"]
    format: NotRequired[Literal["memproxy-export"]]
    version: NotRequired[Annotated[int, Field(ge=1, le=1)]]


class ToolCall(TypedDict, total=False):
    function: dict[str, Any] | None


class Message(TypedDict, total=False):
    """One shape of a conversation message (record_checks._conversation accepts these)."""

    name: Name | None
    timestamp: Seconds | None
    created_at: Seconds | None
    create_time: Seconds | None


class LeftOut(Message):
    """Left out and counted in the report's `ignored`."""

    role: Literal["system", "developer", "function"]
    content: NotRequired[str | Parts | None]
    tool_calls: NotRequired[list[ToolCall] | None]


# A turn needs text: in its content, or its tool calls.
class TextTurn(Message):
    role: TurnRole
    content: Annotated[str, Field(pattern=NON_BLANK)]
    tool_calls: NotRequired[list[ToolCall] | None]


class PartsTurn(Message):
    role: TurnRole
    content: Annotated[Parts, Field(min_length=1)]
    tool_calls: NotRequired[list[ToolCall] | None]


class CallingTurn(Message):
    role: TurnRole
    content: NotRequired[str | Parts | None]
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)]


class Conversation(TypedDict):
    """OpenAI chat format. system, developer and function messages, and messages whose
    content has no text part, are left out and counted in the report's `ignored`; any other
    role, or a user, assistant or tool message with empty content and no tool_calls, is a 400
    naming messages[i].role or messages[i].content. Records may carry other fields too (they
    are ignored)."""

    type: NotRequired[Literal["conversation"]]
    session_id: NotRequired[Annotated[IdText | None, Field(
        description="Unset: the session a chat with this start gets.")]]
    created_at: NotRequired[Time]
    timestamp: NotRequired[Time]
    create_time: NotRequired[Time]
    messages: Annotated[list[LeftOut | TextTurn | PartsTurn | CallingTurn], Field(min_length=1)]


RECORDS: dict[str, Any] = {record.__name__: record for record in (
    TurnRecord, FactRecord, SummaryRecord, ProfileRecord, MetaRecord, Conversation)}

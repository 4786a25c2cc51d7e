"""The records /v1/memory/import takes, declared once (docs/dependencies.md, pydantic).

Each record type is a pydantic model: it checks an imported line, every field typed and
bounded before anything is written, and it is the OpenAPI document's schema of that record.
`check_record` takes one parsed JSON line (an export record, or a conversation in OpenAI's
message format) and returns it normalised, or raises RecordError naming the field. Records
may carry other fields, which are ignored.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    WrapValidator,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from memory.admin.records import FORMAT, VERSION
from memory.learning.facts import CATEGORIES, MAX_CLIENT_CHARS, MAX_TEXT_CHARS, SOURCES
from memory.learning.profiles import MAX_PROFILE_CHARS
from memory.learning.summaries import SUMMARY_KEYS
from memory.log.messages import TURN_ROLES, turn_text

MAX_ID_CHARS = 256
MAX_TIME = 32503680000  # the year 3000
MAX_INT = 2**63 - 1  # what both databases' integers hold
# At least one character that is not whitespace to Python (str.strip) nor to ECMAScript.
NON_BLANK = r"[^\s\x1c-\x1f\x85]"
_TURN_ROLES = tuple(sorted(TURN_ROLES))
TYPES = ("meta", "turn", "fact", "summary", "profile", "conversation")


class RecordError(ValueError):
    """A record that cannot be imported; `field` names the offending part."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def said(words: str) -> WrapValidator:
    """Any problem with the value is told in these words, after the field's name."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("record", words) from None

    return WrapValidator(check)


def one_of(values: tuple[str, ...]) -> WrapValidator:
    return said(f"must be one of {', '.join(values)}")


def null_is(default: Any) -> AfterValidator:
    """A field sent as null takes the value an absent one has."""
    return AfterValidator(lambda value: default if value is None else value)


def _seconds(value: Any) -> float | None:
    """Unix seconds from a number or an ISO 8601 string."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        # Milliseconds (JavaScript's Date.now()) are read as such.
        seconds = float(value) / 1000 if value > 1e11 else float(value)
        if 0 <= seconds <= MAX_TIME:
            return seconds
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if parsed.tzinfo is None:
                raise PydanticCustomError("record", "is an ISO 8601 time without a time zone")
            return parsed.timestamp()
    raise PydanticCustomError("record", "must be unix seconds or an ISO 8601 time")


Int = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT), said("must be an integer")]
Count = Annotated[int, Field(ge=0, le=MAX_INT), said("must be an integer, at least 0")]
Ordinal = Annotated[int, Field(ge=1, le=MAX_INT), said("must be an integer, at least 1")]
Ints = Annotated[list[Int], said("must be a list of integers")]
Bool = Annotated[bool, said("must be true or false")]
Strings = Annotated[list[str], said("must be a list of strings")]
IdText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS, pattern=NON_BLANK),
                   AfterValidator(str.strip),
                   said(f"must be a string of 1 to {MAX_ID_CHARS} characters")]
Name = Annotated[str, Field(max_length=MAX_ID_CHARS),
                 said(f"must be a string of at most {MAX_ID_CHARS} characters")]
NonEmpty = Annotated[str, StringConstraints(min_length=1, pattern=NON_BLANK),
                 said("must be a non-empty string")]
# Declared as seconds: milliseconds and ISO 8601 strings with a zone are read too.
Seconds = Annotated[float, Field(ge=0, le=MAX_TIME)]
Time = Annotated[float | None, BeforeValidator(_seconds, json_schema_input_type=Seconds | None)]
TurnRole = Annotated[Literal[_TURN_ROLES], one_of(_TURN_ROLES)]  # type: ignore[valid-type]
# Roles of OpenAI's chat format that are not turns: instructions are configuration, and a
# legacy `function` result is not kept (as chat requests do not keep it). An import counts
# each, with messages whose content has no text (an image alone), in its report.
LEFT_OUT_ROLES = ("system", "developer", "function")
IGNORED = (*LEFT_OUT_ROLES, "no_text")
_ROLES = tuple(sorted({*TURN_ROLES, *LEFT_OUT_ROLES}))


class Record(BaseModel):
    """A record: strict JSON types; a field it does not know is ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    def normalised(self) -> dict[str, Any]:
        return self.model_dump()


class MetaRecord(Record):
    type: Literal["meta"]
    format: Annotated[Literal[FORMAT], said(f"must be {FORMAT!r}")] = FORMAT  # type: ignore[valid-type]
    version: Annotated[int, Field(ge=1, le=VERSION), said(
        f"must be an integer from 1 to {VERSION}: this memproxy reads export version {VERSION}"
        " or older")] = VERSION


class TurnRecord(Record):
    type: Literal["turn"]
    role: TurnRole
    content: NonEmpty
    id: Int | None = None
    session_id: IdText
    parent_id: Int | None = None
    name: Name | None = None
    created_at: Time = None  # unset: the time of the import
    model: Name | None = None
    tokens: Count | None = None
    request_id: Name | None = None
    incomplete: Bool = False

    def normalised(self) -> dict[str, Any]:
        created = time.time() if self.created_at is None else self.created_at
        return {**self.model_dump(), "created_at": created,
                "has_parent": "parent_id" in self.model_fields_set}


class FactRecord(Record):
    type: Literal["fact"]
    text: Annotated[str, StringConstraints(min_length=1, pattern=NON_BLANK),
                    AfterValidator(str.strip), Field(max_length=MAX_TEXT_CHARS),
                    said(f"must be 1 to {MAX_TEXT_CHARS} characters")]
    category: Annotated[Literal[CATEGORIES], one_of(CATEGORIES)]  # type: ignore[valid-type]
    source: Annotated[Literal[SOURCES], one_of(SOURCES)] = "import"  # type: ignore[valid-type]
    confidence: Annotated[float, Field(ge=0, le=1), said("must be a number between 0 and 1")] = 0.6
    importance: Annotated[Annotated[int, Field(ge=1, le=10), said(
        "must be an integer from 1 to 10")] | None, null_is(5)] = 5
    id: Int | None = None
    mentions: Annotated[Ordinal | None, null_is(1)] = 1
    source_session: Name | None = None
    client: Annotated[str, Field(max_length=MAX_CLIENT_CHARS), said(  # absent before provenance
        f"must be a string of at most {MAX_CLIENT_CHARS} characters")] | None = None
    source_turn_ids: Ints = []
    pinned: Bool = False
    first_seen: Time = None
    last_seen: Time = None
    expires_at: Time = None
    version: Annotated[Ordinal | None, null_is(1)] = 1
    previous_id: Int | None = None
    valid_from: Time = None
    valid_to: Time = None
    superseded_by: Int | None = None
    created_at: Time = None
    updated_at: Time = None


# The lists a summary's data holds, by key (the keys are data); other keys are dropped.
SummaryData = create_model(  # type: ignore[call-overload]
    "SummaryData", __base__=Record, **{key: (Strings, []) for key in SUMMARY_KEYS})


class SummaryRecord(Record):
    type: Literal["summary"]
    session_id: IdText
    text: Annotated[NonEmpty, AfterValidator(str.strip)]
    data: SummaryData = SummaryData()  # type: ignore[valid-type]
    id: Int | None = None
    source_turn_ids: Ints = []
    last_turn_id: Int | None = None
    user_turns: Annotated[Count | None, null_is(0)] = 0
    tokens: Annotated[Count | None, null_is(0)] = 0
    superseded_by: Int | None = None
    created_at: Time = None


class ProfileData(Record):
    fields: Annotated[dict[str, Any], said("must be an object")] = {}
    text: Annotated[str, said("must be a string")] = ""

    @model_validator(mode="after")
    def _fits(self) -> ProfileData:
        if len(json.dumps(self.fields, ensure_ascii=False)) + len(self.text) > MAX_PROFILE_CHARS:
            raise PydanticCustomError("record", f"must be at most {MAX_PROFILE_CHARS} characters"
                                                " (its fields as JSON, and its text)")
        return self


class ProfileRecord(Record):
    type: Literal["profile"]
    consent: Bool = False
    profile: ProfileData | None = None


class ToolCall(Record):
    function: dict[str, Any] | None = None


class Message(Record):
    """One message of a conversation. system, developer and function messages are left out
    and counted in the report's `ignored`; a user, assistant or tool message needs text: in
    its content, or tool calls (a message whose content has no text part is counted too)."""

    # has_text, for the document: a method is no schema, so the rule is said again here.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"enum": list(LEFT_OUT_ROLES)}}},
        {"required": ["content"], "properties": {"content": {"type": "string",
                                                             "pattern": NON_BLANK}}},
        {"required": ["content"], "properties": {"content": {"type": "array", "minItems": 1}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array",
                                                                   "minItems": 1}}},
    ]})

    role: Annotated[Literal[_ROLES], one_of(_ROLES)]  # type: ignore[valid-type]
    content: Annotated[str | list[dict[str, Any]] | None,
                       said("must be a string or a list of parts")] = None
    tool_calls: Annotated[list[ToolCall] | None,
                          said("must be a list of objects (each function an object)")] = None
    name: Name | None = None
    timestamp: Time = None
    created_at: Time = None
    create_time: Time = None

    def has_text(self) -> bool:
        content = self.content
        return bool((content.strip() if isinstance(content, str) else content) or self.tool_calls)


class Conversation(Record):
    """OpenAI chat format: {"messages": [...]} per line (`type` may be left out). A message
    of any other role, or a user, assistant or tool message with empty content and no
    tool_calls, is a 400 naming messages[i].role or messages[i].content."""

    type: Literal["conversation"] = "conversation"
    session_id: Annotated[IdText | None, Field(
        description="Unset: the session a chat with this start gets.")] = None
    created_at: Time = None
    timestamp: Time = None
    create_time: Time = None
    messages: Annotated[list[Message], Field(min_length=1)]


RECORD_SHAPES: dict[str, type[Record]] = {shape.__name__: shape for shape in (
    TurnRecord, FactRecord, SummaryRecord, ProfileRecord, MetaRecord, Conversation)}
_MODELS: dict[str, type[Record]] = dict(zip(TYPES, (
    MetaRecord, TurnRecord, FactRecord, SummaryRecord, ProfileRecord, Conversation), strict=True))
# Words for pydantic's own errors, where a field's declaration does not say its own.
_WORDS = {"missing": "is required", "model_type": "must be an object",
          "list_type": "must be a non-empty list", "too_short": "must be a non-empty list"}


def check_record(raw: Any) -> dict[str, Any]:
    """The record, normalised (times as unix seconds); RecordError when it is invalid."""
    if not isinstance(raw, Mapping):
        raise RecordError("each line must be a JSON object")
    kind = raw.get("type")
    if "type" not in raw and "messages" in raw:
        kind = "conversation"  # OpenAI's chat format: {"messages": [...]} per line
    if kind not in TYPES:
        raise RecordError(f"type must be one of {', '.join(TYPES)}", "type")
    try:
        record = _MODELS[kind].model_validate(raw)
    except ValidationError as exc:
        raise _record_error(exc) from None
    if isinstance(record, Conversation):
        return {"type": kind, **_conversation(record, raw["messages"])}
    return {**record.normalised(), "type": kind}


def _conversation(record: Conversation, raw: list[Mapping[str, Any]]) -> dict[str, Any]:
    start = _first(record.created_at, record.timestamp, record.create_time)
    start = time.time() if start is None else start
    turns = []
    ignored = dict.fromkeys(IGNORED, 0)
    for i, message in enumerate(record.messages):
        if message.role in LEFT_OUT_ROLES:
            ignored[message.role] += 1
            continue
        if not message.has_text():
            where = f"messages[{i}].content"
            raise RecordError(f"{where} must be non-empty text or a list of parts (or the"
                              " message needs tool_calls)", where)
        text = turn_text(raw[i])
        if not text.strip():
            ignored["no_text"] += 1  # parts without text: an image, audio
            continue
        at = _first(message.timestamp, message.created_at, message.create_time)
        turns.append({"role": message.role, "content": text, "name": message.name,
                      "created_at": start if at is None else at})
    return {"session_id": record.session_id, "messages": list(raw), "turns": turns,
            "ignored": ignored}


def _first(*times: float | None) -> float | None:
    return next((at for at in times if at is not None), None)


def _record_error(exc: ValidationError) -> RecordError:
    """The first problem, after the name of its field (`messages[2].content`, `data.todos`)."""
    error = exc.errors(include_url=False)[0]
    field = ""
    for part in error["loc"]:
        field += f"[{part}]" if isinstance(part, int) else f".{part}" if field else str(part)
    words = _WORDS.get(error["type"], error["msg"])
    return RecordError(f"{field} {words}", field)

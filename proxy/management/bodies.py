"""The shapes of the memory and admin APIs and of the MCP tools, declared once
(docs/dependencies.md), and what is made from them.

Each request body (and each MCP tool's arguments, proxy/mcp/schemas.py) is a pydantic model.
The same declaration validates a request (`parse`, whose errors are 400s in OpenAI's
envelope naming the field in `param`) and gives the OpenAPI document its request schemas
(`openapi_schema`) and a tool its `inputSchema` (`json_schema`). Strict: a JSON true is not
a number, a number is not a string; a field absent takes its default, and a field sent as
null is an error unless the declaration says `| None`. The answers are declared as typed
dicts (proxy/management/answers.py), which only give schemas."""

from __future__ import annotations

import contextlib
import datetime
import functools
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from config.choices import MAX_BUDGET
from memory import (
    CATEGORIES,
    MAX_FACTS_PAGE,
    MAX_METRICS_ROWS,
    MAX_SESSIONS_PAGE,
    MAX_TEXT_CHARS,
    NON_BLANK,
)
from proxy.access.identity import MAX_ID_LENGTH
from proxy.http.errors import InvalidRequest

MAX_TIME = 32503680000.0  # the year 3000
MAX_RATE = 1_000_000  # requests per minute
MAX_QUOTA = 2**62  # tokens per month
MAX_USAGE_ROWS = 10_000  # rows in one usage report
MAX_KEY_ID = 200
COMPONENTS = "#/components/schemas/"


def characters(max_chars: int) -> StringConstraints:
    """1 to `max_chars` characters, one of them not blank."""
    return StringConstraints(min_length=1, max_length=max_chars, pattern=NON_BLANK)


STRIPPED = AfterValidator(str.strip)  # checked as sent, kept stripped
FactText = Annotated[str, characters(MAX_TEXT_CHARS), STRIPPED]
IdText = Annotated[str, characters(MAX_ID_LENGTH), STRIPPED]
Token = Annotated[str, characters(200), STRIPPED]


def _printable(max_chars: int, *, padded: bool = True) -> BeforeValidator:
    """1 to `max_chars` printable characters; unless `padded`, no space at either end."""
    what = f"1 to {max_chars} printable characters" + (
        "" if padded else ", without spaces at either end")

    def check(value: Any) -> Any:
        if (not isinstance(value, str) or not 1 <= len(value) <= max_chars
                or not value.isprintable() or (not padded and value != value.strip())):
            raise PydanticCustomError("printable", what)
        return value
    return BeforeValidator(check)


# A user or organisation id.
Id = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_LENGTH,
                                      pattern=r"^\S(.*\S)?$"),
               _printable(MAX_ID_LENGTH, padded=False)]
Category = Literal[CATEGORIES]  # type: ignore[valid-type]
Seconds = Annotated[float, Field(ge=0, le=MAX_TIME)]
Importance = Annotated[int, Field(ge=1, le=10)]
Confidence = Annotated[float, Field(ge=0, le=1)]
Rate = Annotated[int, Field(ge=1, le=MAX_RATE, description=(
    "Requests per minute (replaces MEMPROXY_RATE_LIMIT for this key)."))]
Quota = Annotated[int, Field(ge=0, le=MAX_QUOTA, description="Tokens per calendar month (UTC).")]


class Body(BaseModel):
    """A request body: a JSON object of exactly these fields."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def given(self) -> dict[str, Any]:
        """The fields the client sent, as sent."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class Changes(Body):
    """A body that must change at least one field."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1})

    @model_validator(mode="after")
    def _not_empty(self) -> Changes:
        if not self.model_fields_set:
            raise PydanticCustomError("empty", "give at least one of "
                                      + ", ".join(type(self).model_fields))
        return self


class NewFact(Body):
    text: FactText
    category: Category
    confidence: Confidence = 0.6
    importance: Importance = 5
    expires_at: Seconds = None  # type: ignore[assignment]
    pinned: bool = False


class FactChanges(Changes):
    text: FactText = None  # type: ignore[assignment]
    category: Category = None
    confidence: Confidence = None  # type: ignore[assignment]
    importance: Importance = None  # type: ignore[assignment]
    expires_at: Seconds = None  # type: ignore[assignment]


class SearchQuery(Body):
    # scope "session" needs a session_id (checked by the handler, said here for the document)
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"not": {"required": ["scope"]}},
        {"properties": {"scope": {"enum": ["user", "organization"]}}},
        {"required": ["session_id"]}]})

    query: Annotated[str, characters(8000), STRIPPED]
    budget: Annotated[int, Field(ge=0, le=MAX_BUDGET)] = None  # type: ignore[assignment]
    scope: Literal["user", "session", "organization"] = Field(
        None, description="session needs session_id")  # type: ignore[arg-type]
    session_id: IdText = None  # type: ignore[assignment]
    model: Annotated[str, characters(200), STRIPPED] = Field(  # type: ignore[assignment]
        None, description="Whose tokenizer counts the budget (default gpt-4o).")


class ClearRequest(Body):
    pass


class UndoRequest(Body):
    undo_token: Token


class ConsentChange(Body):
    consent: bool


class ProfileBody(Body):
    fields: dict[str, Any] = {}
    text: str = ""


class NewApiKey(Body):
    # `user` is required, and null says "no user"; an optional field sent as null is absent.
    user: Id | None = Field(description="The user the key is bound to (null: none).")
    org: Id | None = None
    org_writer: bool | None = None
    expires_at: Seconds | None = Field(None, description="Unix seconds, in the future.")
    rate_limit: Rate | None = None
    token_quota: Quota | None = None


class ApiKeyChanges(Changes):
    # null clears expires_at, rate_limit or token_quota
    expires_at: Seconds | None = None
    rate_limit: Rate | None = None
    token_quota: Quota | None = None
    org_writer: bool = None  # type: ignore[assignment]


def _flag(value: Any) -> Any:
    """true, 1, false or 0, in any case; pydantic alone would also take yes, on, t..."""
    flags = {"true": True, "1": True, "false": False, "0": False}
    if not isinstance(value, str) or value.lower() not in flags:
        raise PydanticCustomError("flag", "true or false")
    return flags[value.lower()]


def _blank_is_absent(value: Any) -> Any:
    return (value.strip() or None) if isinstance(value, str) else value


Flag = Annotated[bool, BeforeValidator(_flag)]
QueryText = Annotated[str | None, BeforeValidator(_blank_is_absent)]
Limit = Annotated[int, Field(ge=1, description="Page size.")]
# An empty cursor is the first page. Said, not checked here: a cursor's owner reads it.
DIGITS_CURSOR = Field(None, max_length=18, json_schema_extra={"pattern": "^([0-9]{1,18})?$"},
                      description="next_cursor of the previous page.")


class Query(Body):
    """Query parameters: strings, read as declared; a parameter no route knows is ignored."""

    model_config = ConfigDict(strict=False, extra="ignore", allow_inf_nan=False)


class FactQuery(Query):
    category: Category | None = Field(None, description="Only this category.")
    pinned: Flag | None = Field(None, description="Only pinned (true) or unpinned (false) facts.")
    q: QueryText = Field(None, max_length=1000, description="Full-text search in the fact text.")
    include_inactive: Flag = Field(False, description="Also old versions and expired facts.")
    limit: Limit = Field(50, le=MAX_FACTS_PAGE, description="Page size (default 50).")
    cursor: QueryText = DIGITS_CURSOR


class SessionQuery(Query):
    limit: Limit = Field(50, le=MAX_SESSIONS_PAGE)
    cursor: QueryText = Field(None, max_length=2100, json_schema_extra={"pattern": (
        r"^([0-9]{1,20}(\.[0-9]{1,20})?(e[+-]?[0-9]{1,3})?:([0-9a-f]{2}){0,1024})?$")},
        description="next_cursor of the previous page.")


class TurnQuery(Query):
    session_id: str = Field(json_schema_extra={"minLength": 1, "maxLength": MAX_ID_LENGTH})
    limit: Limit = Field(100, le=MAX_SESSIONS_PAGE, description="Page size (default 100).")
    cursor: QueryText = DIGITS_CURSOR


class MetricsQuery(Query):
    since: Seconds | None = Field(None, description="Unix seconds (default: a day before until).")
    until: Seconds | None = Field(None, description="Unix seconds (default: now).")
    limit: Limit = Field(1000, le=MAX_METRICS_ROWS, description="Page size (default 1000).")
    cursor: QueryText = Field(None, max_length=64, json_schema_extra={"pattern": (
        r"^([0-9]{1,20}(\.[0-9]{1,20})?(e[+-]?[0-9]{1,3})?:[0-9]{1,18})?$")},
        description="next_cursor of the previous page.")


def _day(value: Any) -> Any:
    # What fromisoformat takes besides YYYY-MM-DD (weeks, ...) is not a day here.
    if isinstance(value, str) and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", value):
        with contextlib.suppress(ValueError):
            return datetime.date.fromisoformat(value)
    raise PydanticCustomError("day", "a day as YYYY-MM-DD")


Day = Annotated[datetime.date | None, BeforeValidator(_day),
                Field(json_schema_extra={"pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"})]


class UsageQuery(Query):
    model_config = ConfigDict(extra="forbid")

    start: Day = Field(None, alias="from", description=(
        "First day, YYYY-MM-DD (default: the first of to's month)."))
    to: Day = Field(None, description=(
        "Last day, YYYY-MM-DD (default: today, UTC); at most 366 days after from."))
    key_id: Annotated[str | None, _printable(MAX_KEY_ID), Field(min_length=1, max_length=MAX_KEY_ID)] = Field(
        None, description="Only this key (`none`: requests without a proxy key).")
    user: Annotated[str | None, _printable(MAX_ID_LENGTH), Field(min_length=1, max_length=MAX_ID_LENGTH)] = Field(
        None, description="Only this user.")
    limit: Limit = Field(1000, le=MAX_USAGE_ROWS, description=(
        "Most rows in `data` (default 1000); the sums count every row."))


BODIES: tuple[type[Body], ...] = (NewFact, FactChanges, SearchQuery, ClearRequest, UndoRequest,
                                  ConsentChange, ProfileBody, NewApiKey, ApiKeyChanges)


B = TypeVar("B", bound=Body)
Q = TypeVar("Q", bound="Query")


def parse(model: type[B], value: Any, *, noun: str = "field") -> B:
    """`value` (a decoded JSON body) as `model`; the first problem as a 400 naming the field
    (an MCP tool's arguments: `noun` "argument")."""
    if not isinstance(value, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # An unknown field first: the rest of such a body was not meant for this API.
        error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        raise _invalid(model, error, noun) from None


def _invalid(model: type[Body], error: ErrorDetails, noun: str) -> InvalidRequest:
    name = str(error["loc"][0]) if error["loc"] else None
    kind = error["type"]
    if name is None:
        return InvalidRequest(error["msg"])
    if kind == "extra_forbidden":
        return InvalidRequest(f"unknown {noun} {name!r}", param=name)
    if kind == "missing":
        return InvalidRequest(f"{name} is required", param=name)
    if kind in ("flag", "day", "printable"):
        return InvalidRequest(f"{name} must be {error['msg']}", param=name)
    field = openapi_schema(model)["properties"][name]
    return InvalidRequest(f"{name} must be {_what(field, kind)}", param=name)


def _what(schema: dict[str, Any], kind: str) -> str:
    """What a field must be, in words, from its declared schema."""
    if "enum" in schema:
        return "one of " + ", ".join(schema["enum"])
    if schema.get("type") == "boolean":
        return "true or false"
    if schema.get("type") in ("integer", "number"):
        if "exclusiveMinimum" in schema and kind.startswith(("greater_than", "less_than")):
            return f"more than {schema['exclusiveMinimum']:g} and at most {schema['maximum']:g}"
        if kind.startswith(("greater_than", "less_than")):
            return f"between {schema['minimum']:g} and {schema['maximum']:g}"
        return "an integer" if schema["type"] == "integer" else "a number"
    if schema.get("type") == "string" and "maxLength" in schema:
        return f"a string of 1 to {schema['maxLength']} characters"
    return {"object": "an object"}.get(schema.get("type", ""), "a string")


@functools.cache
def json_schema(shape: Any, shared: frozenset[str] = frozenset(),
                openapi: bool = False) -> dict[str, Any]:
    """The JSON Schema of a declared shape (a model or a typed dict), each nested shape
    written in place but those `shared` (the OpenAPI document's components, by name): an
    MCP client, and OpenAPI 3.0's `nullable`, want no `$ref`s. With `openapi`, in OpenAPI
    3.0's dialect."""
    schema = TypeAdapter(shape).json_schema(ref_template=COMPONENTS + "{model}")
    return _plain(schema, schema.pop("$defs", {}), shared, openapi)  # type: ignore[no-any-return]


def _plain(node: Any, defs: dict[str, Any], shared: frozenset[str], openapi: bool) -> Any:
    """No `$ref` but to `shared`, no titles, and no null default (an absent field is not
    a null one); with `openapi`, each schema in 3.0's dialect."""
    if isinstance(node, list):
        return [_plain(item, defs, shared, openapi) for item in node]
    if not isinstance(node, dict):
        return node
    name = node.get("$ref", "").removeprefix(COMPONENTS)
    if name in shared:
        return node
    if name:
        node = {**defs[name], **{key: value for key, value in node.items() if key != "$ref"}}
    out = {key: _plain(value, defs, shared, openapi) for key, value in node.items()
           if key != "title" and not (key == "default" and value is None)}
    if "properties" in node:  # names, not keywords: a field may be called "title"
        out["properties"] = {key: _plain(value, defs, shared, openapi)
                             for key, value in node["properties"].items()}
    return _openapi(out) if openapi else out


def openapi_schema(shape: Any, shared: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The OpenAPI 3.0 schema of a declared shape: its JSON Schema, in 3.0's dialect."""
    return json_schema(shape, shared, openapi=True)


def parameters(model: type[Body]) -> list[dict[str, Any]]:
    """A query's fields as the document's parameters (a parameter is absent, never null)."""
    schema = openapi_schema(model)
    return [{
        "name": name, "in": "query", "required": name in schema.get("required", ()),
        "schema": {key: value for key, value in field.items()
                   if key not in ("description", "nullable")},
        **({"description": field["description"]} if "description" in field else {}),
    } for name, field in schema["properties"].items()]


def _openapi(out: dict[str, Any]) -> dict[str, Any]:
    """One schema, its parts converted already, JSON Schema 2020-12 -> OpenAPI 3.0: `X | None`
    is `nullable` (3.0 has no null type) and `const` an enum."""
    options = out.pop("anyOf", None)
    if options is not None:
        kept = [option for option in options if option != {"type": "null"}]
        if len(kept) < len(options):  # null is one of them: the first typed one takes it
            kept[0] = {**kept[0], "nullable": True}
        if len(kept) == 1:
            out = {**kept[0], **out}
        else:
            out["anyOf"] = kept
    if "const" in out:
        out["enum"] = [out.pop("const")]
    return out

"""Hostile input against /v1/chat/completions and the pass-through, through a real server.

One memproxy (memory on, so recall and storage are fuzzed too) and one scripted upstream
serve the whole module. The upstream always answers well, so any 5xx here is memproxy's own.
Properties: never a 5xx, the server still answers /healthz, and every error is OpenAI's
envelope with the right status (and the right `param` where the field is known).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from config import load_settings
from memory.index.embeddings import LocalEmbedder
from proxy.formats.chat_body import ROLES
from tests.conftest import MODEL_DIR, RunningProxy, serve
from tests.support.scripted_upstream import (
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)

pytestmark = pytest.mark.fuzz

BODY_LIMIT = 64 * 1024
REPLY = "fuzzed reply"
FUZZ = settings(
    max_examples=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error"}


def well_behaved(received: Received) -> Reply:
    """A model that always answers, whatever it was sent: upstream 5xx cannot occur."""
    if received.path.endswith("/chat/completions"):
        body = received.json if isinstance(received.json, dict) else {}
        if body.get("stream") is True:
            return SSEReply(chat_chunks(REPLY))
        return JSONReply(chat_completion(REPLY))
    return JSONReply({"method": received.method, "path": received.path,
                      "body_length": len(received.body)})


@pytest.fixture(scope="module")
def upstream_server() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(keep_history=False) as server:
        server.respond_with(well_behaved)
        yield server


@pytest.fixture(scope="module")
def server(
    upstream_server: ScriptedUpstream, embedder: LocalEmbedder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningProxy]:
    data: Path = tmp_path_factory.mktemp("fuzz-chat")
    settings_ = load_settings(env={
        "MEMPROXY_UPSTREAM_BASE_URL": upstream_server.base_url,
        "MEMPROXY_DATA_DIR": str(data),
        "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR),
        "MEMPROXY_LOG_LEVEL": "error",
        "MEMPROXY_MAX_BODY_BYTES": str(BODY_LIMIT),
        "MEMPROXY_UPSTREAM_TIMEOUT": "10",
        "MEMPROXY_SHUTDOWN_GRACE_SECONDS": "5",
        "MEMPROXY_EXTRACT_EVERY": "0",
        "MEMPROXY_SUMMARY_EVERY": "0",
    })
    running = serve(settings_, with_memory=True, embedder=embedder)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server: RunningProxy) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(autouse=True)
def still_alive(http: httpx.Client) -> Iterator[None]:
    """After every test the server still serves."""
    yield
    assert http.get("/healthz").json() == {"status": "ok"}


# -- checks ------------------------------------------------------------------------------------


def assert_envelope(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """An error in OpenAI's envelope, with a type that matches its status."""
    if status is not None:
        assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ERROR_TYPES.get(response.status_code, error["type"])
    assert error["param"] is None or isinstance(error["param"], str)
    return dict(error)


def assert_served(response: httpx.Response) -> None:
    """Never a 5xx; a success is the upstream's reply, relayed whole; an error is an envelope."""
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        assert_envelope(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert "event: error" not in response.text
        assert response.text.rstrip().endswith("data: [DONE]")
    elif response.request.url.path == "/v1/chat/completions":
        reply = response.json()
        if reply.get("object") != "memory.dry_run":  # X-Memory-Dry-Run: on
            assert reply["choices"][0]["message"]["content"] == REPLY


def post_chat(http: httpx.Client, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return http.post("/v1/chat/completions", content=content, headers=headers)


# -- strategies --------------------------------------------------------------------------------



def json_of(integers: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    scalars = (
        st.none() | st.booleans() | integers
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
        max_leaves=16,
    )


json_values = json_of(st.integers(-(2**70), 2**70))  # past 64 bits: orjson reads them as floats
upstream_json = json_of(st.integers(-(2**63), 2**63 - 1))  # what the scripted upstream can write
user_text = st.text(min_size=1, max_size=200)
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "input_text", "image_url", "input_audio", "file",
                                  "refusal", "", "made-up", "TEXT"])},
        optional={"text": json_values, "image_url": json_values, "extra": json_values},
    ),
    max_size=4,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(sorted(ROLES)), "content": st.none() | user_text | content_parts},
        optional={"name": st.text(max_size=20), "tool_calls": json_values,
                  "tool_call_id": json_values},
    ),
    min_size=1, max_size=5,
)
valid_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["gpt-4o-mini", "gpt-4o", "x" * 300, "模型"]), "messages": messages},
    optional={"stream": st.booleans(), "n": st.integers(1, 3), "user": st.text(max_size=30),
              "metadata": st.dictionaries(st.text(max_size=10), json_values, max_size=3),
              "max_tokens": json_values, "temperature": json_values, "tools": json_values,
              "response_format": json_values, "made_up_field": json_values},
)


def validated(field: str, value: Any) -> bool:
    """Whether memproxy's own checks (docs/architecture.md, "Request flow") accept `value` for a top-level field."""
    kinds: dict[str, Any] = {"stream": bool, "user": str, "metadata": dict, "stream_options": dict}
    if field == "model":
        return isinstance(value, str) and bool(value)
    if field == "n":
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if field in kinds:
        return value is None or isinstance(value, kinds[field])
    return True


def message_ok(message: Any) -> bool:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    if message["role"] not in ROLES:
        return False
    content, name = message.get("content"), message.get("name")
    if content is not None and not isinstance(content, str | list):
        return False
    if isinstance(content, list) and not all(
        isinstance(part, dict) and isinstance(part.get("type"), str) for part in content
    ):
        return False
    return name is None or isinstance(name, str)


# -- the chat route ----------------------------------------------------------------------------


@FUZZ
@given(body=json_values)
def test_arbitrary_json_is_a_400_or_a_reply(http: httpx.Client, case_counts: Counter[str], body: Any) -> None:
    case_counts["chat: arbitrary JSON"] += 1
    response = post_chat(http, json.dumps(body).encode())
    assert_served(response)
    if not isinstance(body, dict):
        assert_envelope(response, 400)


@FUZZ
@given(body=valid_bodies)
def test_well_formed_requests_get_the_reply(
    http: httpx.Client, case_counts: Counter[str], body: dict[str, Any]
) -> None:
    case_counts["chat: well-formed bodies"] += 1
    response = post_chat(http, json.dumps(body).encode())
    assert response.status_code == 200, response.text[:500]
    assert_served(response)


def metrics_row(http: httpx.Client, user_id: str, request_id: str) -> dict[str, Any]:
    """The request's metrics row, written once its turns and reply were stored (or failed)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = http.get("/v1/memory/metrics", headers={"X-Memory-User-Id": user_id}).json()["data"]
        for row in rows:
            if row["request_id"] == request_id:
                return dict(row)
        time.sleep(0.02)
    raise AssertionError(f"no metrics row for {request_id}")


@settings(FUZZ, max_examples=30)
@given(body=valid_bodies)
def test_accepted_requests_are_remembered_without_memory_errors(
    http: httpx.Client, case_counts: Counter[str], body: dict[str, Any]
) -> None:
    """Odd but accepted messages (tool_calls of any type, unknown parts) never fail storage."""
    case_counts["chat: remembered"] += 1
    request_id = f"req-fuzz-{uuid.uuid4().hex}"
    headers = {"X-Memory-User-Id": "remembered", "X-Request-Id": request_id}
    response = post_chat(http, json.dumps(body).encode(), headers)
    assert response.status_code == 200, response.text[:500]
    assert "x-memory-error" not in response.headers
    assert metrics_row(http, "remembered", request_id)["error"] is None


@FUZZ
@given(
    body=valid_bodies,
    field=st.sampled_from(["model", "messages", "stream", "n", "user", "metadata",
                           "stream_options", "max_tokens", "tools", "temperature"]),
    value=json_values,
)
def test_wrong_types_in_top_level_fields_name_the_field(
    http: httpx.Client, case_counts: Counter[str], body: dict[str, Any], field: str, value: Any
) -> None:
    case_counts["chat: wrong top-level types"] += 1
    body = {**body, field: value}
    response = post_chat(http, json.dumps(body).encode())
    assert_served(response)
    if field == "messages":
        ok = isinstance(value, list) and bool(value) and all(message_ok(m) for m in value)
    else:
        ok = validated(field, value)
    if ok:
        assert response.status_code == 200, response.text[:500]
    else:
        error = assert_envelope(response, 400)
        assert (error["param"] or "").startswith(field)


@FUZZ
@given(
    body=valid_bodies, index=st.integers(0, 4),
    key=st.sampled_from(["role", "content", "name", "tool_calls"]), value=json_values,
)
def test_wrong_types_inside_messages_name_the_message(
    http: httpx.Client, case_counts: Counter[str], body: dict[str, Any], index: int, key: str,
    value: Any,
) -> None:
    case_counts["chat: wrong message fields"] += 1
    index %= len(body["messages"])
    body["messages"][index] = {**body["messages"][index], key: value}
    response = post_chat(http, json.dumps(body).encode())
    assert_served(response)
    if all(message_ok(m) for m in body["messages"]):
        assert response.status_code == 200, response.text[:500]
    else:
        error = assert_envelope(response, 400)
        assert error["param"].startswith("messages[")


@pytest.fixture(scope="module")
def user_with_memory(http: httpx.Client) -> str:
    """A user whose requests get a memory block injected (recall finds something)."""
    user = "deep-nesting"
    said = {"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "My nested lists are called matryoshka lists."}]}
    assert post_chat(http, json.dumps(said).encode(), {"X-Memory-User-Id": user}).status_code == 200
    probe = {"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "what did I say about the nested lists?"}]}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        dry = post_chat(http, json.dumps(probe).encode(),
                        {"X-Memory-User-Id": user, "X-Memory-Dry-Run": "on"})
        if dry.json()["items"]:
            return user
        time.sleep(0.05)
    raise AssertionError("the memory was never recalled")


@settings(FUZZ, max_examples=25)
@given(
    depth=st.integers(1, 1100), where=st.sampled_from(["metadata", "tools", "part"]),
    stream=st.booleans(),
)
@example(depth=300, where="metadata", stream=False)  # parsed, but too deep for orjson to write
def test_deep_nesting(
    http: httpx.Client, user_with_memory: str, case_counts: Counter[str], depth: int, where: str,
    stream: bool,
) -> None:
    """Nesting past the JSON parser's limit is a 400; anything it parses is served, with a
    memory block injected or, when the body is too deep to re-encode, as it was sent."""
    case_counts["chat: deep nesting"] += 1
    nested = "[" * depth + "]" * depth
    message = '{"role": "user", "content": "what did I say about the nested lists?"}'
    if where == "part":
        message = ('{"role": "user", "content": [{"type": "text", "text": '
                   f'"what did I say about the nested lists?", "extra": {nested}}}]}}')
    extra = f', "metadata": {{"x": {nested}}}' if where == "metadata" else ""
    extra += f', "tools": {nested}' if where == "tools" else ""
    raw = (f'{{"model": "gpt-4o-mini", "stream": {json.dumps(stream)}, '
           f'"messages": [{message}]{extra}}}').encode()
    response = post_chat(http, raw, {"X-Memory-User-Id": user_with_memory})
    assert_served(response)
    # orjson parses up to 1024 levels; the deepest here adds up to 3 around the lists.
    if depth + 3 < 1024:
        assert response.status_code == 200, response.text[:500]
        assert int(response.headers["x-memory-items"]) > 0  # the injection was attempted
    else:
        assert_envelope(response, 400)


@settings(FUZZ, max_examples=20)
@given(size=st.integers(1, BODY_LIMIT), filler=st.characters(codec="utf-8"))
def test_huge_strings_up_to_the_limit(
    http: httpx.Client, case_counts: Counter[str], size: int, filler: str
) -> None:
    case_counts["chat: huge strings"] += 1
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": filler * size}]}
    raw = json.dumps(body).encode()
    response = post_chat(http, raw)
    assert_served(response)
    if len(raw) > BODY_LIMIT:
        assert_envelope(response, 413)
    elif "\ud800" <= filler <= "\udfff":
        assert_envelope(response, 400)
    else:
        assert response.status_code == 200


@FUZZ
@given(junk=st.binary(min_size=1, max_size=40), at=st.integers(0, 1000))
def test_invalid_utf8_is_a_400(http: httpx.Client, case_counts: Counter[str], junk: bytes, at: int) -> None:
    case_counts["chat: raw bytes"] += 1
    text = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]})
    raw = text.encode()
    at %= len(raw)
    raw = raw[:at] + junk + raw[at:]
    response = post_chat(http, raw)
    assert_served(response)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        assert_envelope(response, 400)


@settings(FUZZ, max_examples=30)
@given(
    content_type=st.none() | st.sampled_from([
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
        "application/json; charset=latin-1", "application/xml", "*/*", "", "garbage;;;=",
    ]),
    stream=st.booleans(),
)
def test_json_or_a_missing_content_type_is_judged_by_the_body_and_any_other_is_415(
    http: httpx.Client, case_counts: Counter[str], content_type: str | None, stream: bool
) -> None:
    case_counts["chat: content types"] += 1
    raw = json.dumps({"model": "gpt-4o-mini", "stream": stream,
                      "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    response = http.post("/v1/chat/completions", content=raw, headers=headers)
    # A web page sends text and form bodies cross-origin unasked (proxy/access/edge.py).
    essence = (content_type or "").split(";")[0].strip()
    if essence not in ("", "application/json"):
        assert assert_envelope(response, 415)["param"] == "Content-Type"
        return
    assert response.status_code == 200, response.text[:500]
    assert_served(response)


@settings(FUZZ, max_examples=10)
@given(extra=st.integers(1, 3 * BODY_LIMIT), chunked=st.booleans(),
       path=st.sampled_from(["/v1/chat/completions", "/v1/embeddings", "/v1/files"]))
def test_oversized_bodies_are_413(
    http: httpx.Client, case_counts: Counter[str], extra: int, chunked: bool, path: str
) -> None:
    case_counts["oversized bodies"] += 1
    raw = b'{"model": "gpt-4o-mini", "input": "' + b"x" * (BODY_LIMIT + extra) + b'"}'
    content: Any = iter([raw[i : i + 16384] for i in range(0, len(raw), 16384)]) if chunked else raw
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert_envelope(response, 413)


# -- headers -----------------------------------------------------------------------------------

FLAG_HEADERS = {
    "X-Memory": ["on", "off"], "X-Memory-Read": ["on", "off"], "X-Memory-Write": ["on", "off"],
    "X-Memory-Dry-Run": ["on", "off"], "X-Memory-Scope": ["session", "user"],
    "X-Memory-Placement": ["system", "last_user"], "X-Memory-Budget": ["0", "10", "100000"],
}
ID_HEADERS = ["X-Memory-User-Id", "X-Memory-Session-Id"]
# What h11 lets a client send in a header value: visible ASCII, space, tab and obs-text.
header_bytes = st.binary(min_size=1, max_size=64).map(
    lambda raw: bytes(b for b in raw if b == 9 or 32 <= b <= 126 or b >= 128).strip(b" \t")
).filter(bool)
odd_values = (
    header_bytes
    | st.text(min_size=1, max_size=30).map(lambda t: t.encode("utf-8")).filter(
        lambda raw: all(b == 9 or 32 <= b <= 126 or b >= 128 for b in raw) and raw == raw.strip())
    | st.integers(1, 8000).map(lambda n: b"a" * n)
    | st.sampled_from([b"ON", b"off\t \toff", b"1", b"true", b"-1", b"1e3", b"\xb2", b"\xbd", b"100001",
                       b"007", b"S\xc3\xa9ssion", b"%00", b"../../etc/passwd", b"' OR 1=1 --"])
)


def expected_flag(name: str, raw: bytes) -> bool:
    """Whether a flag header's value is one it takes (values are trimmed, case-insensitive)."""
    value = raw.decode("latin-1").strip().lower()
    if name == "X-Memory-Budget":
        return value.isascii() and value.isdigit() and int(value) <= 100_000
    return value in FLAG_HEADERS[name]


@settings(FUZZ, max_examples=80)
@given(name=st.sampled_from([*FLAG_HEADERS, *ID_HEADERS, "X-Memory-Unknown", "X-Request-Id",
                             "Authorization", "OpenAI-Organization"]),
       value=odd_values | st.sampled_from(FLAG_HEADERS["X-Memory"]).map(str.encode),
       stream=st.booleans())
@example(name="X-Memory-Budget", value=b"\xb2", stream=False)  # latin-1 "²": isdigit(), not int()
@example(name="X-Memory-User-Id", value="Zoë 👋".encode(), stream=True)
@example(name="X-Memory-Session-Id", value=b"a" * 257, stream=False)
def test_odd_headers_are_a_400_naming_the_header_or_harmless(
    http: httpx.Client, case_counts: Counter[str], name: str, value: bytes, stream: bool
) -> None:
    case_counts["chat: odd headers"] += 1
    raw = json.dumps({"model": "gpt-4o-mini", "stream": stream,
                      "messages": [{"role": "user", "content": "remember the odd header"}]}).encode()
    headers = [(b"content-type", b"application/json"), (name.encode(), value)]
    response = http.post("/v1/chat/completions", content=raw, headers=headers)
    assert_served(response)
    if name in FLAG_HEADERS:
        if expected_flag(name, value):
            assert response.status_code == 200, response.text[:500]
        else:
            assert assert_envelope(response, 400)["param"] == name
    elif name in ID_HEADERS:
        try:  # ids arrive as UTF-8 when they are; as latin-1 otherwise
            text = value.decode("utf-8").strip()
        except UnicodeDecodeError:
            text = value.decode("latin-1").strip()
        if 0 < len(text) <= 256 and text.isprintable():
            assert response.status_code == 200, response.text[:500]
            if name == "X-Memory-Session-Id":
                sent = dict(response.headers.raw)[b"x-memory-session-id"]
                assert sent == value.strip(b" \t")
        else:
            assert assert_envelope(response, 400)["param"] == name
    else:
        assert response.status_code == 200, response.text[:500]


# -- the pass-through --------------------------------------------------------------------------

path_segments = st.lists(
    st.text(min_size=1, max_size=12).filter(lambda s: s not in (".", "..")), min_size=1, max_size=4
)


@settings(FUZZ, max_examples=50)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]),
    segments=path_segments,
    query=st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=3),
    body=st.binary(max_size=512) | json_values.map(lambda v: json.dumps(v).encode()),
    header=st.tuples(st.sampled_from([b"x-memory-user-id", b"x-junk", b"accept-encoding",
                                      b"content-type"]), header_bytes),
)
def test_pass_through_relays_anything_without_a_5xx(
    http: httpx.Client, case_counts: Counter[str], method: str, segments: list[str],
    query: dict[str, str], body: bytes, header: tuple[bytes, bytes],
) -> None:
    case_counts["pass-through: requests"] += 1
    path = "/v1/" + "/".join(quote(segment, safe="") for segment in segments)
    if path.startswith(("/v1/chat/completions", "/v1/memory")):
        path = "/v1/x" + path[3:]
    content = body if method not in ("GET", "HEAD", "OPTIONS") else None
    response = http.request(method, path, params=query, content=content, headers=[header])
    assert response.status_code < 500, response.text[:500]
    if method == "HEAD":
        assert response.content == b""  # a refusal of a HEAD request has no body either
    elif response.status_code >= 400:
        assert_envelope(response)
    else:
        echoed = response.json()
        assert echoed["method"] == method and echoed["body_length"] == len(content or b"")


# -- a hostile upstream ------------------------------------------------------------------------


def _mutated(document: dict[str, Any], path: list[str | int], value: Any) -> dict[str, Any]:
    """A deep copy of `document` with the value at `path` replaced (created when missing)."""
    copy: Any = json.loads(json.dumps(document))
    node = copy
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return dict(copy)


COMPLETION_PATHS: list[list[str | int]] = [
    ["choices"], ["choices", 0], ["choices", 0, "message"], ["choices", 0, "message", "content"],
    ["choices", 0, "message", "tool_calls"], ["choices", 0, "index"], ["usage"], ["model"],
]
CHUNK_PATHS: list[list[str | int]] = [
    ["choices"], ["choices", 0], ["choices", 0, "delta"], ["choices", 0, "delta", "content"],
    ["choices", 0, "delta", "tool_calls"], ["choices", 0, "index"], ["choices", 0, "finish_reason"],
    ["model"], ["error"],
]


@settings(FUZZ, max_examples=50)
@given(path=st.sampled_from(COMPLETION_PATHS), value=upstream_json)
def test_odd_completions_from_the_upstream_are_relayed_as_sent(
    http: httpx.Client, upstream_server: ScriptedUpstream, case_counts: Counter[str],
    path: list[str | int], value: Any,
) -> None:
    """Memory reads the reply to store it; whatever shape it has, the client gets it unchanged."""
    case_counts["upstream: odd completions"] += 1
    reply = _mutated(chat_completion(REPLY), path, value)
    upstream_server.enqueue(JSONReply(reply), path="/v1/chat/completions")
    raw = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
    response = post_chat(http, raw.encode(), {"X-Memory-User-Id": "odd-upstream"})
    assert response.status_code == 200, response.text[:500]
    assert response.content == orjson.dumps(reply)  # byte for byte


@settings(FUZZ, max_examples=50)
@given(at=st.integers(0, 4), path=st.sampled_from(CHUNK_PATHS), value=upstream_json)
def test_odd_stream_chunks_from_the_upstream_are_relayed_as_sent(
    http: httpx.Client, upstream_server: ScriptedUpstream, case_counts: Counter[str],
    at: int, path: list[str | int], value: Any,
) -> None:
    """The tee that collects the streamed reply never turns an odd chunk into a failure."""
    case_counts["upstream: odd stream chunks"] += 1
    events: list[Any] = chat_chunks(REPLY)
    at %= len(events)
    events[at] = _mutated(events[at], path, value)
    upstream_server.enqueue(SSEReply(events), path="/v1/chat/completions")
    raw = json.dumps({"model": "gpt-4o-mini", "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]})
    response = post_chat(http, raw.encode(), {"X-Memory-User-Id": "odd-upstream"})
    assert response.status_code == 200, response.text[:500]
    sent = b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)
    assert response.content == sent + b"data: [DONE]\n\n"  # byte for byte

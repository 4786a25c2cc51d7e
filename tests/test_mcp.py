"""/mcp with the official `mcp` SDK client over Streamable HTTP on a real socket: the tools,
their errors, and one memory shared with chat completions, Responses and Messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp_types import Implementation

from tests.conftest import ROOT, RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.mcp_client import Mode, error_text, mcp_session, structured
from tests.support.memory import QUIET
from tests.support.scripted_upstream import ScriptedUpstream

KEYS = ",".join([
    "key-alice-0001:alice:org=acme",
    "key-bob-00001:bob:org=acme",
    "key-writer-0001:org=acme:org-writer",
    "key-carol-0001:carol",
])
ALICE = "key-alice-0001"
TOOL_NAMES = {
    "search_memory", "add_memory", "list_memories", "delete_memory", "undo_delete", "read_profile",
}
NOTE = "User's favourite editor is Helix, configured with the gruvbox theme."
pytestmark = pytest.mark.both_backends


@pytest.fixture
def served(start_proxy: Callable[..., RunningProxy], backend: str) -> RunningProxy:
    """memproxy with memory and proxy keys, on the test's backend."""
    return start_proxy(memory=True, api_keys=KEYS, upstream_api_key="sk-upstream", **QUIET)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_tools_are_listed_with_schemas_and_annotations(served: RunningProxy, mode: Mode) -> None:
    async with mcp_session(served, key=ALICE, mode=mode) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == TOOL_NAMES
    for tool in tools.values():
        assert tool.description and tool.input_schema["type"] == "object"
        assert tool.output_schema is not None and tool.annotations is not None
    assert tools["search_memory"].annotations.read_only_hint is True  # type: ignore[union-attr]
    assert tools["delete_memory"].annotations.destructive_hint is True  # type: ignore[union-attr]
    assert tools["add_memory"].annotations.read_only_hint is False  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_each_tool_round_trip(served: RunningProxy, mode: Mode) -> None:
    async with mcp_session(served, key=ALICE, mode=mode) as client:
        added = structured(await client.call_tool(
            "add_memory", {"text": NOTE, "category": "preference", "pinned": True}))
        assert added["id"].startswith("f") and added["pinned"] and not added["shared"]
        found = structured(await client.call_tool("search_memory", {"query": "Which editor?"}))
        assert [item["id"] for item in found["items"] if item["kind"] == "fact"] == [added["id"]]
        assert "Helix" in found["block"] and found["tokens"] > 0
        listed = structured(await client.call_tool("list_memories", {"limit": 5}))
        assert [item["id"] for item in listed["items"]] == [added["id"]]
        assert structured(await client.call_tool("list_memories", {"kind": "summary"}))["items"] == []
        profile = structured(await client.call_tool("read_profile", {}))
        assert profile == {"consent": False, "profile": None}
        deleted = structured(await client.call_tool("delete_memory", {"id": added["id"]}))
        assert {k: deleted[k] for k in ("id", "deleted", "shared")} == {
            "id": added["id"], "deleted": True, "shared": False}
        assert deleted["undo_token"] and deleted["expires_at"] > added["created_at"]
        again = await client.call_tool("delete_memory", {"id": added["id"]})
        assert "no memory" in error_text(again)
        assert structured(await client.call_tool("list_memories", {}))["items"] == []
        undone = structured(await client.call_tool(
            "undo_delete", {"undo_token": deleted["undo_token"]}))
        assert undone == {"restored": True, "added": {"facts": 1}}
        back = structured(await client.call_tool("list_memories", {}))["items"]
        assert [(item["text"], item["pinned"]) for item in back] == [(NOTE, True)]
        assert "no deletion" in error_text(await client.call_tool(
            "undo_delete", {"undo_token": "not-a-token"}))
        resource = await client.read_resource("memproxy://profile")
        assert json.loads(resource.contents[0].text) == profile  # type: ignore[union-attr]


async def test_added_memory_is_stored_with_ttl_and_redaction(served: RunningProxy) -> None:
    async with mcp_session(served, key=ALICE, headers={"X-Memory-Session-Id": "editor-setup"}) as client:
        added = structured(await client.call_tool("add_memory", {
            "text": "User's staging token is sk-abcdefghijklmnopqrstuvwxyz0123456789",
            "ttl_days": 2, "importance": 8,
        }))
    assert "abcdefghijklmnop" not in added["text"]  # redacted like any stored fact
    assert added["expires_at"] is not None and added["session_id"] == "editor-setup"
    assert added["importance"] == 8 and added["category"] == "context"


async def test_added_memories_merge_and_supersede_as_learned_facts_do(served: RunningProxy) -> None:
    berlin = {"text": "User lives in Berlin.", "category": "identity"}
    async with mcp_session(served, key=ALICE) as client:
        first = structured(await client.call_tool("add_memory", berlin))
        again = structured(await client.call_tool("add_memory", berlin))
        # A duplicate counts one more mention of the same fact (memory/learning/fact_rules.py).
        assert again["id"] == first["id"]
        assert [(f["text"], f["mentions"]) for f in fact_records(served, ALICE)] == [
            ("User lives in Berlin.", 2)
        ]
        moved = structured(await client.call_tool(
            "add_memory", {"text": "User lives in Lisbon.", "category": "identity"}))
    # A new value of the same subject supersedes the old one: only it stays active.
    assert moved["id"] != first["id"] and moved["source"] == "mcp"
    assert [f["text"] for f in fact_records(served, ALICE)] == ["User lives in Lisbon."]
    # Without ttl_days a memory expires after its category's lifetime, as learned facts do.
    assert moved["expires_at"] is not None


def fact_records(served: RunningProxy, key: str) -> list[dict[str, Any]]:
    """The key's user's facts as the memory API shows them."""
    listed = httpx.get(f"{served.url}/v1/memory/facts", timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
    assert listed.status_code == 200, listed.text
    data: list[dict[str, Any]] = listed.json()["data"]
    return data


@pytest.mark.parametrize(("mode", "recorded"), [
    ("auto", "helix-editor"),  # the client info every 2026 request carries
    ("legacy", "helix/25.1"),  # stateless: initialize's client info is gone by the call
])
async def test_an_added_memory_records_mcp_and_the_client_name(
    served: RunningProxy, mode: Mode, recorded: str
) -> None:
    async with mcp_session(served, key=ALICE, mode=mode, name="helix-editor",
                           headers={"User-Agent": "helix/25.1"}) as client:
        added = structured(await client.call_tool("add_memory", {"text": NOTE}))
    assert added["source"] == "mcp" and added["client"] == recorded
    [fact] = fact_records(served, ALICE)
    assert (fact["source"], fact["client"]) == ("mcp", recorded)
    records = exported(served, ALICE)
    [record] = [r for r in records if r["type"] == "fact"]
    assert (record["source"], record["client"]) == ("mcp", recorded)
    imported(served, "key-carol-0001", records)  # import keeps it (into another user)
    [copy] = fact_records(served, "key-carol-0001")
    assert (copy["source"], copy["client"]) == ("mcp", recorded)


def imported(served: RunningProxy, key: str, records: list[dict[str, Any]]) -> None:
    """Import these records for the key's user."""
    answer = httpx.post(f"{served.url}/v1/memory/import", timeout=30,
                        headers={"Authorization": f"Bearer {key}"},
                        content="\n".join(json.dumps(r) for r in records))
    assert answer.status_code == 200, answer.text


def exported(served: RunningProxy, key: str) -> list[dict[str, Any]]:
    """The key's user's memory as export records."""
    answer = httpx.get(f"{served.url}/v1/memory/export", timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
    return [json.loads(line) for line in answer.text.splitlines()]


BAD_CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("add_memory", {"text": 5}, "text must be a string"),
    ("add_memory", {"text": "x" * 1001}, "1 to 1000 characters"),
    ("add_memory", {"text": "ok", "category": "gossip"}, "category must be one of"),
    ("add_memory", {"text": "ok", "importance": "high"}, "importance must be an integer"),
    ("add_memory", {"text": "ok", "ttl_days": 0}, "ttl_days"),
    ("add_memory", {"text": "ok", "user_id": "bob"}, "unknown argument 'user_id'"),
    ("search_memory", {}, "query is required"),
    ("search_memory", {"query": "q" * 8001}, "1 to 8000 characters"),
    ("search_memory", {"query": "q", "budget": -1}, "budget must be between"),
    ("search_memory", {"query": "q", "scope": "session"}, "needs a session_id"),
    ("list_memories", {"limit": 0}, "limit must be between"),
    ("list_memories", {"cursor": "abc"}, "invalid cursor"),
    ("delete_memory", {"id": "x12"}, "id must look like"),
    ("delete_memory", {"id": ["f1"]}, "id must be a string"),
]


async def test_listed_schemas_are_plain_json_schema_that_refuse_the_bad_calls(
    served: RunningProxy,
) -> None:
    async with mcp_session(served, key=ALICE) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    for tool in tools.values():
        for schema in (tool.input_schema, tool.output_schema):
            jsonschema.Draft202012Validator.check_schema(schema)
            assert "$ref" not in json.dumps(schema), tool.name  # written in place
    # A client's schema and the check a call meets are one declaration: the schema refuses
    # every bad call but those only the tool can judge (the session, the cursor's digits).
    passed = [(tool, args) for tool, args, _ in BAD_CALLS
              if jsonschema.Draft202012Validator(tools[tool].input_schema).is_valid(args)]
    assert passed == [("search_memory", {"query": "q", "scope": "session"}),
                      ("list_memories", {"cursor": "abc"})]


@pytest.mark.parametrize(("tool", "args", "message"), BAD_CALLS)
async def test_bad_arguments_are_tool_errors_that_store_nothing(
    served: RunningProxy, tool: str, args: dict[str, Any], message: str
) -> None:
    async with mcp_session(served, key=ALICE) as client:
        assert message in error_text(await client.call_tool(tool, args))
        assert structured(await client.call_tool("list_memories", {}))["items"] == []


async def test_unknown_tool_is_a_json_rpc_error(served: RunningProxy) -> None:
    async with mcp_session(served, key=ALICE) as client:
        with pytest.raises(MCPError, match="unknown tool"):
            await client.call_tool("drop_tables", {})


def raw(served: RunningProxy, body: bytes | str, key: str | None = ALICE, **headers: str) -> httpx.Response:
    sent = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
            "MCP-Protocol-Version": "2025-11-25", **headers}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{served.url}/mcp", content=body, headers=sent, timeout=30)


def facts_of(served: RunningProxy, key: str) -> list[str]:
    """The texts of the key's user's facts, through the memory API."""
    listed = httpx.get(f"{served.url}/v1/memory/facts", timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
    return [fact["text"] for fact in listed.json()["data"]]


def call(name: str, arguments: Any) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": name, "arguments": arguments}})


def test_http_level_errors_never_5xx(served: RunningProxy) -> None:
    assert raw(served, call("list_memories", {}), key=None).status_code == 401
    assert raw(served, call("list_memories", {}), key="key-wrong-0001").status_code == 401
    too_big = raw(served, call("add_memory", {"text": "x" * (2 * 1024 * 1024)}))
    assert too_big.status_code == 413 and too_big.headers["content-type"] == "application/json"
    assert raw(served, b"{not json").status_code == 400
    assert raw(served, b"[1, 2]").status_code == 400
    assert raw(served, json.dumps({"jsonrpc": "2.0", "id": 1})).status_code == 400
    wrong_type = raw(served, call("add_memory", ["not", "an", "object"]),
                     Accept="application/json")
    assert wrong_type.status_code == 200 and wrong_type.json()["error"]["code"] == -32602
    assert httpx.get(f"{served.url}/mcp", timeout=10).status_code == 405
    assert httpx.delete(f"{served.url}/mcp", timeout=10).status_code == 405
    assert facts_of(served, ALICE) == []  # nothing was stored


def test_json_or_sse_as_the_client_asks(served: RunningProxy) -> None:
    as_json = raw(served, call("read_profile", {}), Accept="application/json")
    assert as_json.headers["content-type"] == "application/json"
    assert as_json.json()["result"]["structuredContent"]["consent"] is False
    as_sse = raw(served, call("read_profile", {}))
    assert as_sse.headers["content-type"].startswith("text/event-stream")
    assert '"consent":false' in as_sse.text


def test_calls_are_counted_per_tool(served: RunningProxy) -> None:
    raw(served, call("read_profile", {}), Accept="application/json")
    raw(served, call("add_memory", {"text": 1}), Accept="application/json")
    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    assert 'memproxy_mcp_tool_calls_total{outcome="ok",tool="read_profile"} 1.0' in metrics
    assert 'memproxy_mcp_tool_calls_total{outcome="error",tool="add_memory"} 1.0' in metrics


async def test_a_chat_turn_is_found_by_mcp_search(served: RunningProxy) -> None:
    said = "We deploy the billing service with Nomad on the Falkenstein cluster."
    reply = chat(served, said, session="ops", api_key=ALICE)
    assert reply.status == 200 and "x-memory-error" not in reply.headers
    wait_for_jobs(served)
    async with mcp_session(served, key=ALICE) as client:
        found = structured(await client.call_tool("search_memory", {"query": "How is billing deployed?"}))
    turns = [item for item in found["items"] if item["kind"] == "turn"]
    assert any("Falkenstein" in item["text"] and item["session_id"] == "ops" for item in turns)
    async with mcp_session(served, key="key-bob-00001") as client:  # never another user's
        other = structured(await client.call_tool("search_memory", {"query": "How is billing deployed?"}))
    assert "Falkenstein" not in other["block"]


async def test_an_mcp_memory_is_injected_in_every_format_until_deleted(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    async with mcp_session(served, key=ALICE) as client:
        added = structured(await client.call_tool("add_memory", {"text": NOTE}))
    wait_for_jobs(served)
    question = "Which editor should the tutorial use?"

    def sent_upstream() -> str:
        return json.dumps(upstream.history[-1].json)

    chat(served, question, session="tut", api_key=ALICE)
    assert "Helix" in sent_upstream()
    with openai.OpenAI(base_url=served.base_url, api_key=ALICE, max_retries=0) as oa:
        oa.responses.create(model="gpt-4o", input=question)
    assert "Helix" in sent_upstream()
    with anthropic.Anthropic(base_url=served.url, api_key=ALICE, max_retries=0) as claude:
        claude.messages.create(model="claude-scripted-1", max_tokens=50,
                               messages=[{"role": "user", "content": question}])
    assert "Helix" in sent_upstream()
    async with mcp_session(served, key="key-carol-0001") as client:  # another user's key
        assert "Helix" not in structured(
            await client.call_tool("search_memory", {"query": question}))["block"]
        assert "no memory" in error_text(await client.call_tool("delete_memory", {"id": added["id"]}))

    async with mcp_session(served, key=ALICE) as client:
        structured(await client.call_tool("delete_memory", {"id": added["id"]}))
    wait_for_jobs(served)
    chat(served, question, session="tut2", api_key=ALICE)
    assert "Helix" not in sent_upstream()
    with openai.OpenAI(base_url=served.base_url, api_key=ALICE, max_retries=0) as oa:
        oa.responses.create(model="gpt-4o", input=question)
    assert "Helix" not in sent_upstream()


async def test_org_members_read_shared_memory_only_writers_change_it(served: RunningProxy) -> None:
    shared = {"text": "The staging cluster is called Bluebird.", "shared": True}
    async with mcp_session(served, key=ALICE) as alice:
        refused = error_text(await alice.call_tool("add_memory", shared))
        assert "may read but not change" in refused
    async with mcp_session(served, key="key-writer-0001", headers={"X-Memory-User-Id": "alice"}) as writer:
        fact = structured(await writer.call_tool("add_memory", shared))
        assert fact["shared"] is True
    async with mcp_session(served, key="key-bob-00001") as bob:
        listed = structured(await bob.call_tool("list_memories", {"shared": True}))
        assert [item["id"] for item in listed["items"]] == [fact["id"]]
        found = structured(await bob.call_tool(
            "search_memory", {"query": "What is the staging cluster called?", "scope": "organization"}))
        assert "Bluebird" in found["block"]
        assert "may read but not change" in error_text(
            await bob.call_tool("delete_memory", {"id": fact["id"]}))
    async with mcp_session(served, key="key-carol-0001") as carol:  # outside the organisation
        assert "organisation" in error_text(await carol.call_tool("list_memories", {"shared": True}))
        assert "no memory" in error_text(await carol.call_tool("delete_memory", {"id": fact["id"]}))
    async with mcp_session(served, key="key-writer-0001", headers={"X-Memory-User-Id": "bob"}) as writer:
        deleted = structured(await writer.call_tool("delete_memory", {"id": fact["id"]}))
        assert deleted["shared"]
    undo = {"undo_token": deleted["undo_token"]}
    async with mcp_session(served, key="key-bob-00001") as bob:  # a member, not a writer
        assert "may read but not change" in error_text(await bob.call_tool("undo_delete", undo))
        assert structured(await bob.call_tool("list_memories", {"shared": True}))["items"] == []
    async with mcp_session(served, key="key-carol-0001") as carol:
        assert "no deletion" in error_text(await carol.call_tool("undo_delete", undo))
    async with mcp_session(served, key="key-writer-0001", headers={"X-Memory-User-Id": "bob"}) as writer:
        assert structured(await writer.call_tool("undo_delete", undo))["restored"]
        listed = structured(await writer.call_tool("list_memories", {"shared": True}))["items"]
        assert [item["text"] for item in listed] == [shared["text"]]


async def test_memproxy_mcp_on_stdio_forwards_to_the_server(served: RunningProxy) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "proxy", "mcp", "--url", served.url], cwd=ROOT,
        env={**env, "MEMPROXY_KEY": ALICE},
    )
    editor = Implementation(name="stdio-editor", version="3")
    async with Client(params, client_info=editor) as client:
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOL_NAMES
        added = structured(await client.call_tool("add_memory", {"text": NOTE}))
        assert "1 to 1000" in error_text(await client.call_tool("add_memory", {"text": "x" * 1001}))
    assert facts_of(served, ALICE) == [added["text"]]
    # Provenance names the local client, not the bridge between it and the server.
    [fact] = fact_records(served, ALICE)
    assert (fact["source"], fact["client"]) == ("mcp", "stdio-editor")


def test_the_readme_example_runs(start_proxy: Callable[..., RunningProxy]) -> None:
    local = start_proxy(memory=True, **QUIET)  # keys off: loopback clients reach memory
    added = httpx.post(f"{local.url}/v1/memory/facts", timeout=30,
                       json={"text": "User lives in Lisbon.", "category": "identity"})
    assert added.status_code == 201
    readme = (ROOT / "README.md").read_text()
    example = readme.split("**MCP**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8080/mcp" in example
    ran = subprocess.run(
        [sys.executable, "-c", example.replace("http://127.0.0.1:8080", local.url)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert ran.returncode == 0, ran.stderr
    assert "User lives in Lisbon." in ran.stdout and "<memory>" in ran.stdout


@pytest.mark.process
def test_memproxy_mcp_that_cannot_start_says_why_in_one_line(served: RunningProxy) -> None:
    """Issue 39 item 8: no key, a wrong key, a --url with /v1, no server: one line with the
    status (or the connection's error) and the fix, not nested ExceptionGroup tracebacks."""
    from tests.support.servers import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}

    def bridge(*args: str) -> tuple[int, str]:
        ran = subprocess.run([sys.executable, "-m", "proxy", "mcp", *args], cwd=ROOT, env=env,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=60)
        return ran.returncode, ran.stderr

    for args, said in [
        (("--url", served.url), f"{served.url}/mcp answered 401 missing API key"),
        (("--url", served.url, "--key", "key-nobody-0001"), f"{served.url}/mcp answered 401"),
        (("--url", f"{served.url}/v1", "--key", ALICE), f"{served.url}/v1/mcp "),
        (("--url", f"http://127.0.0.1:{free_port()}"), "cannot reach memproxy at"),
    ]:
        code, err = bridge(*args)
        assert code == 1 and err.startswith(f"memproxy mcp: {said}"), (args, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        if "401" in said:
            assert err.rstrip().endswith("give a proxy key with --key or MEMPROXY_KEY"), err
        if "/v1" in said:
            assert err.rstrip().endswith("memproxy's own address, without /v1 or /mcp"), err


@pytest.mark.process
def test_memproxy_mcp_reads_the_key_under_the_name_the_other_commands_use(
    served: RunningProxy,
) -> None:
    """Issue 39 item 11: MEMPROXY_KEY, as `memories` and `keys` read it; the old
    MEMPROXY_API_KEY still works, with a warning."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}
    for name, warned in (("MEMPROXY_KEY", False), ("MEMPROXY_API_KEY", True)):
        ran = subprocess.run([sys.executable, "-m", "proxy", "mcp", "--url", served.url],
                             cwd=ROOT, env={**env, name: ALICE}, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        assert ("MEMPROXY_API_KEY is deprecated" in ran.stderr) is warned, ran.stderr

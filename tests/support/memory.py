"""Helpers shared by the memory API, CLI and panel tests: a client, seeding, records."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema

from config import Settings
from memory.engine import MemoryEngine
from memory.storage.turns import NewTurn
from proxy.management.openapi import DOCUMENT
from tests.conftest import RunningProxy
from tests.support.sql import query

# Learning calls an LLM; these tests drive memory through its API only.
QUIET = {"extract_every": 0, "summary_every": 0}


def memory_api(proxy: RunningProxy, **headers: str) -> httpx.Client:
    """An httpx client aimed at /v1/memory of a running proxy."""
    return httpx.Client(base_url=f"{proxy.url}/v1/memory", headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None = "") -> dict[str, Any]:
    """The response is OpenAI's error envelope with this status (and param, when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "":
        assert error["param"] == param, error
    return error


def db_rows(proxy: RunningProxy, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """Rows straight from the proxy's database (the file, or PostgreSQL)."""
    return query(proxy.state.settings, sql, params)


async def seed(settings: Settings, embedder: Any, user: str = "ada") -> None:
    """A memory with every kind of record: branched turns, facts with history, summaries,
    consent and a profile, written through the engine's own stores."""
    engine = await MemoryEngine.open(settings, embedder=embedder)
    try:
        log = engine.log
        first = await log.append_turns(user, "trip", [
            NewTurn("user", "We fly to Lisbon on the 3rd of May.", created_at=1_700_000_000.0),
            NewTurn("assistant", "Noted: Lisbon, May 3rd.", created_at=1_700_000_010.0,
                    model="gpt-4o", tokens=7),
            NewTurn("user", "Book a hotel near Alfama \u2028 with a view.", created_at=1_700_000_020.0),
        ])
        turns = await log.session_turns(user, "trip")
        # An edited second message: a branch from the first turn.
        await log.append_turns(user, "trip", [
            NewTurn("assistant", "Lisbon it is.", name="planner", created_at=1_700_000_030.0),
        ], after=turns[0].id)
        await log.append_turns(user, "work", [
            NewTurn("user", "The billing service runs Postgres 16.", created_at=1_700_100_000.0),
            NewTurn("assistant", "Postgres 16, got it.", created_at=1_700_100_005.0,
                    incomplete=True),
        ])
        facts = engine.facts
        lisbon = await facts.add(user, "Ada travels to Lisbon in May", "context",
                                 source="extracted", source_session="trip",
                                 source_turn_ids=[turns[0].id])
        await facts.edit(user, lisbon.id, text="Ada travels to Lisbon on May 3rd", confidence=0.9)
        pinned = await facts.add(user, "Ada prefers TypeScript", "preference", pinned=True)
        await facts.add(user, "Ada works on billing", "project", importance=8,
                        expires_at=4_102_444_800.0)
        assert pinned.pinned
        await engine.summaries.put(
            user, "trip", "Planning a Lisbon trip.", {"facts": ["Lisbon in May"]},
            source_turn_ids=[t.id for t in turns], last_turn_id=turns[-1].id, user_turns=2,
            tokens=5,
        )
        await engine.summaries.put(
            user, "trip", "Planning a Lisbon trip; hotel near Alfama.", {"todos": ["hotel"]},
            source_turn_ids=[t.id for t in turns], last_turn_id=turns[-1].id, user_turns=2,
            tokens=9,
        )
        await engine.profiles.set_consent(user, True)
        await engine.profiles.put(user, {"name": "Ada", "languages": ["en", "pt"]}, "Engineer.")
        assert first.new_ids
        await engine.worker.run_until_idle(timeout=30)
    finally:
        await engine.close()


def export_records(proxy: RunningProxy, **headers: str) -> list[dict[str, Any]]:
    """The records of GET /export, parsed."""
    with memory_api(proxy, **headers) as client:
        response = client.get("/export")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.content.split(b"\n") if line]


def canonical(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Records with database ids replaced by what they point at, for comparing memories."""
    turn_key: dict[int, Any] = {}
    turns = []
    for r in (r for r in records if r["type"] == "turn"):
        key = (r["session_id"], r["role"], r["content"], r["created_at"])
        turn_key[r["id"]] = key
        turns.append((*key, r["name"], r["model"], r["tokens"], r["incomplete"],
                      turn_key.get(r["parent_id"])))
    fact_key = {r["id"]: (r["text"], r["version"]) for r in records if r["type"] == "fact"}
    facts = sorted(
        (r["text"], r["category"], r["confidence"], r["importance"], r["mentions"], r["source"],
         r["source_session"], r["pinned"], r["first_seen"], r["last_seen"], r["expires_at"],
         r["version"], r["valid_from"], r["valid_to"], r["created_at"], r["updated_at"],
         fact_key.get(r["previous_id"]), fact_key.get(r["superseded_by"]),
         tuple(sorted(turn_key[t] for t in r["source_turn_ids"])))
        for r in records if r["type"] == "fact"
    )
    summary_key = {r["id"]: r["text"] for r in records if r["type"] == "summary"}
    summaries = sorted(
        (r["session_id"], r["text"], json.dumps(r["data"], sort_keys=True), r["user_turns"],
         r["tokens"], r["created_at"], summary_key.get(r["superseded_by"]),
         turn_key.get(r["last_turn_id"]), tuple(sorted(turn_key[t] for t in r["source_turn_ids"])))
        for r in records if r["type"] == "summary"
    )
    profiles = [(r["consent"], r["profile"] and (r["profile"]["fields"], r["profile"]["text"]))
                for r in records if r["type"] == "profile"]
    return {"turns": sorted(turns, key=repr), "facts": facts, "summaries": summaries,
            "profile": profiles}


def check_schema(name: str, payload: Any) -> None:
    """`payload` matches the OpenAPI document's schema `name` (what jsonschema.validate
    raises: the best match of the errors)."""
    error = jsonschema.exceptions.best_match(_validator(name).iter_errors(payload))
    if error is not None:
        raise error


@functools.cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    """A validator of the document's schema `name`, the schema itself checked once:
    jsonschema.validate checks it again on every call (0.14 s each, 20 calls a test)."""
    schemas = {key: _json_schema(value) for key, value in DOCUMENT["components"]["schemas"].items()}
    schema = {**schemas[name], "$defs": schemas}
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def _json_schema(node: Any) -> Any:
    """OpenAPI 3.0 -> JSON Schema: `nullable` becomes a null type, refs point at $defs."""
    if isinstance(node, list):
        return [_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items() if k != "nullable"}
    if "$ref" in out:
        out["$ref"] = out["$ref"].replace("#/components/schemas/", "#/$defs/")
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
    return out


Starter = Callable[..., RunningProxy]

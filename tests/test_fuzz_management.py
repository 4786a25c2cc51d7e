"""Schemathesis against the memory API's own OpenAPI document, on a real running server.

Each operation gets schemathesis' deterministic coverage cases (boundary and invalid values
field by field) plus 25 generated ones, all checked with its standard checks: no 5xx, status
codes, content types, headers and bodies as the document promises, invalid input rejected
and valid input accepted. The stateful phase is not run: on this API it fails inside
schemathesis (FlakyStrategyDefinition) and takes minutes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case
from schemathesis.specs.openapi.checks import positive_data_acceptance

from config import load_settings
from memory.index.embeddings import LocalEmbedder
from proxy.management.openapi import DOCUMENT
from tests.conftest import MODEL_DIR, RunningProxy, serve
from tests.support.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.fuzz


@pytest.fixture(scope="module")
def server(embedder: LocalEmbedder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    data: Path = tmp_path_factory.mktemp("fuzz-management")
    with ScriptedUpstream(keep_history=False) as upstream:
        running = serve(load_settings(env={
            "MEMPROXY_UPSTREAM_BASE_URL": upstream.base_url,
            "MEMPROXY_DATA_DIR": str(data),
            "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR),
            "MEMPROXY_LOG_LEVEL": "error",
            "MEMPROXY_MAX_BODY_BYTES": str(256 * 1024),
            "MEMPROXY_SHUTDOWN_GRACE_SECONDS": "5",
            "MEMPROXY_EXTRACT_EVERY": "0",
            "MEMPROXY_SUMMARY_EVERY": "0",
        }), with_memory=True, embedder=embedder)
        try:
            yield running
        finally:
            running.stop()


@schemathesis.serializer("application/x-ndjson")
def ndjson(context: schemathesis.SerializationContext, value: Any) -> bytes:
    """/import's JSON Lines body: a string as it is, anything else one JSON value per line."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    items = value if isinstance(value, list) else [value]
    return "\n".join(json.dumps(item) for item in items).encode()


# The document is generated from at import (schemathesis' lazy loader breaks on pytest 9);
# test_the_published_document_is_the_one_fuzzed checks the server publishes this very one.
# The admin API's paths (their own server, /v1/admin) are fuzzed against the admin key in
# their own tests (tests/security/test_admin_keys.py, tests/security/test_admin_usage.py);
# this one fuzzes /v1/memory.
schema = schemathesis.openapi.from_dict(DOCUMENT).exclude(
    path=[path for path, item in DOCUMENT["paths"].items() if "servers" in item])


@schema.parametrize()
@settings(
    max_examples=25, deadline=None, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck),
)
def test_memory_api_conforms_to_its_document(
    case: Case[Any], server: RunningProxy, case_counts: Counter[str]
) -> None:
    case_counts[f"schemathesis: {case.operation.label}"] += 1
    # `type: string` cannot say "JSON lines", so a valid string may rightly be a 400 there.
    lines = case.media_type == "application/x-ndjson"
    case.call_and_validate(
        base_url=f"{server.url}/v1/memory", timeout=30,
        excluded_checks=[positive_data_acceptance] if lines else None,
    )


def test_the_published_document_is_the_one_fuzzed(server: RunningProxy) -> None:
    published = httpx.get(f"{server.url}/v1/memory/openapi.json", timeout=30)
    assert published.status_code == 200
    assert published.json() == DOCUMENT


def test_server_survived_the_fuzzing(server: RunningProxy) -> None:
    assert httpx.get(f"{server.url}/healthz", timeout=30).json() == {"status": "ok"}

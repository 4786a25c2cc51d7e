"""The memory and admin APIs' request bodies are declared once (proxy/management/bodies.py):
every route that reads a body has it in the OpenAPI document, and the document's request
schemas are the declarations' own."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import schemathesis
from starlette.routing import Route

from proxy.management import admin_routes, routes
from proxy.management.bodies import BODIES, openapi_schema
from proxy.management.openapi import DOCUMENT
from tests.conftest import RunningProxy
from tests.support.memory import QUIET, assert_error

ADMIN = "admin-key-bodies-01"
WRITES = ("POST", "PUT", "PATCH")


def served(prefix: str, table: list[Any]) -> list[tuple[str, str, str]]:
    """(document path, method, URL path with sample ids) of every route that may take a body."""
    found = []
    for route in table:
        assert isinstance(route, Route)
        path = re.sub(r"\{(\w+):path\}", r"{\1}", route.path)
        url = prefix + re.sub(r"\{\w+(:path)?\}", "1", route.path)
        found += [(path, method, url) for method in sorted(route.methods or ()) if method in WRITES]
    return found


def test_every_route_that_reads_a_body_declares_it(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(memory=True, admin_key=ADMIN, **QUIET)
    walked = served("/v1/memory", routes()) + served(
        "/v1/admin", admin_routes())
    reading = []
    headers = {"Authorization": f"Bearer {ADMIN}", "X-Memory-User-Id": "ada"}
    with httpx.Client(base_url=proxy.url, headers=headers, timeout=60) as http:
        for path, method, url in walked:
            # A body no route takes: a route that reads its body refuses it, naming the field.
            response = http.request(method, url, json={"not_a_field": 1})
            if response.status_code == 400:
                reading.append((path, method))
                operation = DOCUMENT["paths"][path][method.lower()]
                assert "requestBody" in operation, (path, method)
                if path != "/import":  # records, not an object: its own test file
                    assert assert_error(response, 400, "not_a_field")["message"] == (
                        "unknown field 'not_a_field'")
    # The walk reached every body: the memory API's eight and the admin API's two.
    assert len(reading) == 10, reading
    bodies = {(path, method.lower()) for path, item in DOCUMENT["paths"].items()
              for method, operation in item.items()
              if isinstance(operation, dict) and "requestBody" in operation}
    assert bodies == {(path, method.lower()) for path, method in reading}


def test_the_document_s_request_schemas_are_the_declarations() -> None:
    components = DOCUMENT["components"]["schemas"]
    used = {ref.rsplit("/", 1)[1] for ref in re.findall(r"'\$ref': '([^']+)'", str(DOCUMENT["paths"]))}
    for model in BODIES:
        assert components[model.__name__] == openapi_schema(model)
        assert model.__name__ in used, model.__name__
        # OpenAPI 3.0's schema dialect: no null type, no const; nullable says it.
        text = str(openapi_schema(model))
        assert "'null'" not in text and "'const'" not in text and "'title'" not in text
        jsonschema.Draft4Validator.check_schema(openapi_schema(model))


def test_the_document_is_valid_openapi_3_0() -> None:
    # Against the OpenAPI 3.0 schema that schemathesis checks a document with (its public
    # `validate`): a Media Type Object, for one, has no `description`.
    schemathesis.openapi.from_dict(DOCUMENT).validate()

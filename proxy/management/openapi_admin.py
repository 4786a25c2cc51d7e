"""The admin API's part of the OpenAPI document (proxy/management/openapi.py): paths under
/v1/admin (the keys, and GET /usage), each with its own `servers` entry, tagged `admin` (the
admin key only). Its request bodies (NewApiKey, ApiKeyChanges) come from
proxy/management/bodies.py, its answers from answers.py."""

from __future__ import annotations

from typing import Any

from proxy.management.bodies import UsageQuery, parameters

JSON = "application/json"
ADMIN_SERVERS = [{"url": "/v1/admin"}]
_ERROR_TEXT = {
    "400": "Invalid input; `param` names the field. Nothing was changed.",
    "401": "No key, or a wrong one.",
    "403": "A valid key that is not the admin key, or no admin key is configured.",
    "404": "No key with this id.",
    "405": "A method other than GET.",
    "409": "The key is revoked, or comes from MEMPROXY_API_KEYS (read-only here).",
    "413": "The body is larger than MEMPROXY_MAX_BODY_BYTES.",
    "500": "A bug in memproxy.",
    "503": "Memory, and so the key database, is off on this proxy; or it is unreachable.",
}
_ALWAYS = ("401", "403", "500", "503")


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def answer(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def operation(
    summary: str, ok: dict[str, Any], errors: set[str], texts: dict[str, str], *,
    status: str = "200", body: dict[str, Any] | None = None, **more: Any,
) -> dict[str, Any]:
    """One operation: its answer, then each error it can give with what it means here."""
    responses = {status: ok} | {code: answer(ref("Error"), texts[code]) for code in sorted(errors)}
    done: dict[str, Any] = {"summary": summary, "responses": responses, **more}
    if body is not None:
        done["requestBody"] = body
    return done


def _op(summary: str, ok: str, *errors: str, status: str = "200",
        body: str | None = None, params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return operation(
        summary, answer(ref(ok)), {*errors, *_ALWAYS}, _ERROR_TEXT, status=status,
        body=None if body is None else {"required": True, "content": {JSON: {"schema": ref(body)}}},
        tags=["admin"], security=[{"bearer": []}], **({} if params is None else {"parameters": params}),
    )


_KEY_ID = {"name": "key_id", "in": "path", "required": True,
           "schema": {"type": "string", "minLength": 1, "maxLength": 100}}

ADMIN_PATHS: dict[str, Any] = {
    "/keys": {
        "servers": ADMIN_SERVERS,
        "get": _op("Every key: MEMPROXY_API_KEYS's (source env) and the stored ones; never a"
                   " secret", "ApiKeyList"),
        "post": _op("Make a key; its secret is in `key`, shown this once", "ApiKeyCreated",
                    "400", "413", status="201", body="NewApiKey"),
    },
    "/keys/{key_id}": {
        "servers": ADMIN_SERVERS,
        "parameters": [_KEY_ID],
        "get": _op("One key", "ApiKey", "404"),
        "patch": _op("Change expires_at, rate_limit, token_quota or org_writer (null clears)",
                     "ApiKey", "400", "404", "409", "413", body="ApiKeyChanges"),
        "delete": _op("Revoke a key (409: already revoked)", "ApiKey", "404", "409"),
    },
}

# Apart from ADMIN_PATHS: tests/test_admin_keys.py matches those with admin_keys.py's routes.
USAGE_PATHS: dict[str, Any] = {"/usage": {"servers": ADMIN_SERVERS, "get": _op(
    "Usage per day (UTC), key and user, with sums per key, per user and in all",
    "UsageReport", "400", "405", params=parameters(UsageQuery))}}

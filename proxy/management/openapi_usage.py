"""GET /v1/admin/usage in the OpenAPI document (proxy/management/openapi.py): the admin
API's paths carry their own server, /v1/admin, beside the memory API's /v1/memory."""

from __future__ import annotations

from typing import Any

from proxy.access.identity import MAX_ID_LENGTH

_DAY = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "format": "date"}
_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


USAGE_PATHS: dict[str, Any] = {
    "/usage": {
        "servers": [{"url": "/v1/admin"}],
        "get": {
            "summary": "Usage per day (UTC), key and user, with sums per key, per user and in"
                       " all (the admin key only)",
            "security": [{"bearer": []}],
            "parameters": [
                _query("from", _DAY, "First day, YYYY-MM-DD (default: the first of to's month)."),
                _query("to", _DAY, "Last day, YYYY-MM-DD (default: today, UTC); at most 366"
                                   " days after from."),
                _query("key_id", {"type": "string", "minLength": 1, "maxLength": 200},
                       "Only this key (`none`: requests without a proxy key)."),
                _query("user", {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH},
                       "Only this user."),
                _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000},
                       "Most rows in `data` (default 1000); the sums count every row."),
            ],
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/UsageReport"}}}},
                "400": {"description": "A bad or unknown query parameter; `param` names it.",
                        **_ERROR},
                "401": {"description": "No key, or a wrong one.", **_ERROR},
                "403": {"description": "A key that is not the admin key, or no admin key is"
                                       " configured.", **_ERROR},
                "405": {"description": "A method other than GET.", **_ERROR},
                "503": {"description": "The proxy runs without its database.", **_ERROR},
            },
        },
    },
}

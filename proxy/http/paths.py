"""One spelling of a request's path, made once before anything reads it (docs/security.md).

Routing, the edge's checks, access and ownership all match `scope["path"]`. A gateway in
front (nginx merges slashes by default) or the upstream may read `/v1//responses/x/` as
`/v1/responses/x`, so a check that matched only the plain spelling could be stepped
around with an extra slash, a `.` segment or a trailing slash. Every spelling is made the
plain one here, in `scope["path"]` and in `scope["raw_path"]` (what the pass-through
forwards), so what memproxy checks is what the upstream gets:

- runs of slashes become one (`//v1//responses` -> `/v1/responses`);
- `.` segments go (`/v1/./responses`; in the raw path `%2e` too, RFC 3986 5.2.4);
- a trailing slash goes under `/v1/` (`/v1/responses/x/`); elsewhere (the panel's `/ui/`)
  it is part of the name.

`..` segments stay: they are refused where a path leaves memproxy (the pass-through's
`proxy/upstream/client.contained_path`), never resolved into another path.
"""

from __future__ import annotations

from urllib.parse import unquote

from starlette.types import Scope

API_PREFIX = "/v1/"


def needs_normalising(path: str) -> bool:
    """Whether `path` (decoded) has a spelling `normal_path` changes: a cheap test first."""
    return "//" in path or "/." in path or (path.endswith("/") and path.startswith(API_PREFIX))


def normal_path(path: str, *, decode: bool = False) -> str:
    """`path` with repeated slashes merged, `.` segments dropped and, under /v1/, no
    trailing slash; `decode`: `path` is still percent-encoded (`%2e` is a `.` too)."""
    kept = [part for part in path.split("/") if part and _segment(part, decode) != "."]
    plain = "/" + "/".join(kept)
    if path.endswith("/") and plain != "/" and not plain.startswith(API_PREFIX):
        plain += "/"
    return plain


def normalised(scope: Scope) -> Scope:
    """`scope` with its path and raw path in their one spelling (the same scope when it
    already is: the usual request costs one test of its path)."""
    path = scope["path"]
    if not needs_normalising(path):
        return scope
    changed = {**scope, "path": normal_path(path)}
    raw = scope.get("raw_path")
    if isinstance(raw, bytes):
        changed["raw_path"] = normal_path(raw.decode("latin-1"), decode=True).encode("latin-1")
    return changed


def _segment(part: str, decode: bool) -> str:
    return unquote(part) if decode and "%" in part else part

"""`memproxy keys create|list|show|revoke`: the admin API's keys (docs/keys.md) from the
command line, with the admin key (`--key` or MEMPROXY_KEY) against a running memproxy
(`--url` or MEMPROXY_URL). Tables on a terminal, `--json` for scripts; exit status 0 done,
1 the server said no, 2 usage."""

from __future__ import annotations

import argparse
import contextlib
from datetime import UTC, datetime
from functools import partial
from typing import Any
from urllib.parse import quote

from proxy.cli.client import DEFAULT_URL, AdminClient, UsageError, add_action, emit, given
from proxy.cli.render import table, when


def add_commands(commands: Any) -> None:
    """Add `keys` to the `memproxy` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"memproxy's address (MEMPROXY_URL, default {DEFAULT_URL})")
    common.add_argument("--key", help="the admin key (MEMPROXY_KEY)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    keys = commands.add_parser("keys", help="proxy keys in the database (the admin key only)")
    actions = keys.add_subparsers(dest="action", required=True)
    action = partial(add_action, actions, client=AdminClient, parents=[common])
    create = action("create", create_key, help="make a key; its secret is printed once")
    bound = create.add_mutually_exclusive_group(required=True)
    bound.add_argument("--user", help="the user the key is bound to")
    bound.add_argument("--no-user", action="store_true",
                       help="bind the key to no user (an organisation's or an application's)")
    create.add_argument("--org", help="the key's organisation")
    create.add_argument("--org-writer", action="store_true",
                        help="let it change the organisation's shared memory")
    create.add_argument("--expires-at", help="unix seconds or an ISO 8601 time (UTC if no zone)")
    create.add_argument("--rate-limit", type=int, help="requests per minute for this key")
    create.add_argument("--token-quota", type=int, help="tokens per calendar month")
    action("list", list_keys, help="every key, never a secret")
    action("show", show, help="one key").add_argument("id")
    action("revoke", revoke, help="revoke a key").add_argument("id")


def create_key(client: AdminClient, args: argparse.Namespace) -> None:
    """POST /keys; the secret, said to be shown once."""
    expires_at = parse_time(args.expires_at) if args.expires_at else None
    body = {"user": None if args.no_user else args.user,
            **given(org=args.org, rate_limit=args.rate_limit, token_quota=args.token_quota,
                    org_writer=args.org_writer or None, expires_at=expires_at)}
    made = client.call("POST", "/keys", json=body)
    emit(args, made, f"{made['key']}\n\nKey {made['id']} ({made['prefix']}...) for "
         f"{_bound(made)}. This is the only time the secret is shown: store it now.")


def list_keys(client: AdminClient, args: argparse.Namespace) -> None:
    """GET /keys, as a table."""
    keys = client.call("GET", "/keys")["data"]
    rows = [[k["id"], k["prefix"] or "", _bound(k), k["status"], k["source"],
             when(k["last_used_at"]) if k["last_used_at"] else "never",
             when(k["expires_at"]) if k["expires_at"] else ""] for k in keys]
    emit(args, keys, table(["ID", "PREFIX", "FOR", "STATUS", "SOURCE", "LAST USED", "EXPIRES"],
                           rows, flex=2) if keys else "No keys.")


def show(client: AdminClient, args: argparse.Namespace) -> None:
    """GET /keys/{id}, one field a line."""
    key = client.call("GET", f"/keys/{quote(args.id, safe='')}")
    emit(args, key, table(["FIELD", "VALUE"], [[k, "" if v is None else v] for k, v in key.items()
                                               if k != "object"]))


def revoke(client: AdminClient, args: argparse.Namespace) -> None:
    """DELETE /keys/{id}."""
    key = client.call("DELETE", f"/keys/{quote(args.id, safe='')}")
    emit(args, key, f"Revoked {key['id']} ({_bound(key)}); every replica refuses it within"
         " seconds.")


def parse_time(text: str) -> float:
    """Unix seconds from a number or an ISO 8601 time (UTC when it names no zone)."""
    with contextlib.suppress(ValueError):
        return float(text)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"--expires-at: {text!r} is neither unix seconds nor ISO 8601") from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def _bound(key: dict[str, Any]) -> str:
    parts = [f"user {key['user']}" if key["user"] else "no user"]
    if key["org"]:
        parts.append(f"org {key['org']}" + (" (writer)" if key["org_writer"] else ""))
    return ", ".join(parts)


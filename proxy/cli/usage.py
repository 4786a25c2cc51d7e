"""`memproxy usage`: GET /v1/admin/usage from the command line (the admin key only)."""

from __future__ import annotations

import argparse
from typing import Any

from proxy.cli.client import DEFAULT_URL, MemoryClient, add_action, emit, given
from proxy.cli.render import table

COUNTERS = ("requests", "input_tokens", "output_tokens", "memory_tokens", "errors")
HEADERS = ["REQUESTS", "INPUT", "OUTPUT", "MEMORY", "ERRORS"]
# Per --by: the part of the report shown, and the fields that name its rows, with headers.
BY = {"day": ("data", {"day": "DAY", "key_id": "KEY", "user_id": "USER"}),
      "key": ("by_key", {"key_id": "KEY"}), "user": ("by_user", {"user_id": "USER"})}


def add_command(commands: Any) -> None:
    """Add `usage` to the `memproxy` parser."""
    usage = add_action(commands, "usage", usage_show, MemoryClient,
                       help="requests, tokens and errors per day, key and user (the admin key)")
    usage.add_argument("--url", help=f"memproxy's address (MEMPROXY_URL, default {DEFAULT_URL})")
    usage.add_argument("--key", help="the admin key (MEMPROXY_KEY)")
    usage.add_argument("--from", dest="first", metavar="YYYY-MM-DD",
                       help="first day (default: the first of the month)")
    usage.add_argument("--to", dest="last", metavar="YYYY-MM-DD", help="last day (default: today, UTC)")
    usage.add_argument("--key-id", help="only this key (`none`: requests without a key)")
    usage.add_argument("--user", dest="for_user", help="only this user")
    usage.add_argument("--by", choices=("day", "key", "user"), default="day",
                       help="rows per day, key and user (default), or sums per key or per user")
    usage.add_argument("--limit", type=int, default=1000, help="most daily rows (default 1000)")
    usage.add_argument("--json", action="store_true", help="print the report as JSON")
    # The memory client's own options, unused here: usage names no user's memory.
    usage.set_defaults(user=None, org=None)


def usage_show(client: MemoryClient, args: argparse.Namespace) -> None:
    """The usage report as a table, with its totals."""
    params = given(**{"from": args.first, "to": args.last}, key_id=args.key_id,
                   user=args.for_user, limit=args.limit)
    report = client.call("GET", client.admin_url("/usage"), params=params)
    part, named = BY[args.by]
    rows = [[*(r[f] or "-" if f == "user_id" else r[f] for f in named), *(r[c] for c in COUNTERS)]
            for r in report[part]]
    headers = [*named.values(), *HEADERS]
    totals = report["totals"]
    summary = (f"{report['from']} to {report['to']}: {totals['requests']} requests,"
               f" {totals['input_tokens']} input and {totals['output_tokens']} output tokens,"
               f" {totals['memory_tokens']} memory tokens, {totals['errors']} errors")
    more = "\n(more rows than --limit: the totals count them all)" if report["has_more"] else ""
    emit(args, report, table(headers, rows, flex=0) + "\n" + summary + more)

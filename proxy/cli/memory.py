"""`memproxy memories|sessions|stats|usage`: the memory API (and the admin API's usage)
from the command line.

Talks to a running memproxy (`--url` or MEMPROXY_URL, `--key` or MEMPROXY_KEY, `--user`,
`--org` for an organisation's shared memory).
Tables on a terminal, `--json` for scripts; a progress bar on stderr for exports and
imports when stderr is a terminal. Exit status: 0 done, 1 the server said no, 2 usage, 141
(quietly) when the output pipe closed early.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

from config.choices import SCOPES
from memory import CATEGORIES
from proxy.cli import commands as handlers
from proxy.cli import usage as cli_usage
from proxy.cli.client import DEFAULT_URL, MemoryClient, add_action


def add_commands(commands: Any) -> None:
    """Add `memories`, `sessions` and `stats` to the `memproxy` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"memproxy's address (MEMPROXY_URL, default {DEFAULT_URL})")
    common.add_argument("--key", help="a proxy key or the admin key (MEMPROXY_KEY)")
    common.add_argument("--user", help="whose memory (X-Memory-User-Id)")
    common.add_argument(
        "--org", help="an organisation's shared memory instead of a user's (X-Memory-Org-Id)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")

    memories = commands.add_parser("memories", help="see and change what memproxy remembers")
    actions = memories.add_subparsers(dest="action", required=True)
    action = partial(add_action, actions, client=MemoryClient, parents=[common])
    listing = action("list", handlers.memories_list, help="list facts")
    listing.add_argument("--category", choices=CATEGORIES)
    listing.add_argument("--pinned", action="store_true", help="only pinned facts")
    listing.add_argument("--query", "-q", help="full-text filter")
    listing.add_argument("--all", action="store_true", help="include old versions and expired")
    listing.add_argument("--limit", type=int, default=50, help="most facts shown (default 50)")
    search = action("search", handlers.memories_search, help="what would be injected")
    search.add_argument("query")
    search.add_argument("--budget", type=int, help="token budget (default: the server's)")
    search.add_argument("--scope", choices=SCOPES)
    search.add_argument("--session", help="the session to search from")
    add = action("add", handlers.memories_add, help="remember a fact")
    add.add_argument("text")
    add.add_argument("--category", choices=CATEGORIES, default="context")
    add.add_argument("--confidence", type=float)
    add.add_argument("--importance", type=int)
    add.add_argument("--pin", action="store_true")
    edit = action("edit", handlers.memories_edit, help="change a fact (keeps history)")
    edit.add_argument("id", type=int)
    edit.add_argument("--text")
    edit.add_argument("--category", choices=CATEGORIES)
    edit.add_argument("--confidence", type=float)
    edit.add_argument("--importance", type=int)
    forget = action("forget", handlers.memories_forget, help="delete a fact and its history")
    forget.add_argument("id", type=int)
    pin = action("pin", handlers.memories_pin, help="pin a fact (--off to unpin)")
    pin.add_argument("id", type=int)
    pin.add_argument("--off", action="store_true", help="unpin instead")
    export = action("export", handlers.memories_export, help="export as JSON Lines")
    export.add_argument("--output", "-o", type=Path, help="file to write (default: stdout)")
    load = action("import", handlers.memories_import, help="import JSON Lines")
    load.add_argument("file", type=Path, help="records or OpenAI-format conversations, or -")
    clear = action("clear", handlers.memories_clear,
                   help="delete all memory of the user (undo within the window)")
    clear.add_argument("--yes", action="store_true", help="really clear (required)")
    undo = action("undo", handlers.memories_undo, help="undo a clear or a forget with its undo token")
    # An option, written --token=...: a token may start with "-", which argparse would take
    # for an option if it stood alone.
    undo.add_argument("--token", required=True, dest="undo_token",
                      help="the undo token `memories clear` or `forget` printed")

    sessions = commands.add_parser("sessions", help="conversations memproxy has logged")
    action = partial(add_action, sessions.add_subparsers(dest="action", required=True),
                     client=MemoryClient, parents=[common])
    listing = action("list", handlers.sessions_list, help="list sessions")
    listing.add_argument("--limit", type=int, default=50)
    action("show", handlers.sessions_show, help="a session's turns").add_argument("session_id")
    action("delete", handlers.sessions_delete, help="delete a session").add_argument("session_id")

    add_action(commands, "stats", handlers.stats_show, MemoryClient, parents=[common],
               help="counts, index sizes, job queue")
    cli_usage.add_command(commands)


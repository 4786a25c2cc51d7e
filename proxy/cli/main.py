"""The `memproxy` command line: `memproxy serve`, `memproxy backup` (memory/admin/backup.py),
`memproxy migrate` (memory/admin/migrate.py), `memproxy mcp` (proxy/mcp/stdio.py), and `memories`, `sessions` and `stats` against a
running server (proxy/cli/memory.py), and `keys` (proxy/cli/keys.py)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from config import Settings, SettingsError, load_settings
from config.settings import unknown_env_warnings
from proxy.access.exposure import start_refusal
from proxy.cli import keys as cli_keys
from proxy.cli import memory as cli_memory
from proxy.cli.render import count

if TYPE_CHECKING:
    from memory import MigrateResult


DESCRIPTION = """An OpenAI-compatible proxy that gives any chat application long-term memory.
`memproxy serve` runs it; the other commands manage a running one (memories, sessions,
stats, usage, keys, mcp) or its data directory (backup, migrate). `memproxy COMMAND -h`
says more; docs/ has every page."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="memproxy", description=DESCRIPTION)
    parser.add_argument("--version", action="version",
                        version=f"memproxy {importlib.metadata.version('memproxy')}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the proxy")
    serve.set_defaults(run=serve_command)
    serve.add_argument("--host", help="address to bind (MEMPROXY_HOST)")
    serve.add_argument("--port", type=int, help="port to listen on (MEMPROXY_PORT)")
    serve.add_argument("--config", type=Path, help="TOML settings file (MEMPROXY_CONFIG)")
    backup = commands.add_parser(
        "backup", help="copy the memory of this data directory, safely while a server runs"
    )
    backup.set_defaults(run=backup_command)
    backup.add_argument("dest", type=Path, help="new data directory to write the copy to")
    backup.add_argument("--config", type=Path, help="TOML settings file (MEMPROXY_CONFIG)")
    migrate = commands.add_parser(
        "migrate", help="copy this data directory's memory into PostgreSQL (and a Chroma"
        " server); stop memproxy first"
    )
    migrate.set_defaults(run=migrate_command)
    migrate.add_argument("dest_url", help="the PostgreSQL database, postgresql://...")
    migrate.add_argument("--chroma-url", help="also copy the vectors to this Chroma server;"
                         " without it they stay in the embedded Chroma of the data directory")
    migrate.add_argument("--batch-size", type=int, default=2000, help="rows (or vectors) per committed batch")
    migrate.add_argument("--config", type=Path, help="TOML settings file (MEMPROXY_CONFIG)")
    mcp = commands.add_parser(
        "mcp", help="speak MCP on stdin/stdout, forwarding to a running memproxy's /mcp"
    )
    mcp.set_defaults(run=mcp_command)
    mcp.add_argument("--url", help="memproxy's address (MEMPROXY_URL, default http://127.0.0.1:8080)")
    mcp.add_argument("--key", help="a proxy key (MEMPROXY_KEY)")
    mcp.add_argument("--user", help="X-Memory-User-Id, where the key allows one")
    mcp.add_argument("--session", help="X-Memory-Session-Id for what is added")
    cli_memory.add_commands(commands)
    cli_keys.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `memproxy` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `memproxy`: what it can do, not an error
        parser.print_help()
        return 0
    return int(args.run(args))


def mcp_command(args: argparse.Namespace) -> int:
    """Speak MCP on stdin/stdout (proxy/mcp/stdio.py)."""
    from proxy.mcp.stdio import run  # the MCP SDK, for this command only

    return run(args)


def backup_command(args: argparse.Namespace) -> int:
    """Copy MEMPROXY_DATA_DIR's database to a new data directory (memory/admin/backup.py)."""
    from memory import BackupError, backup

    try:
        settings = load_settings(config_file=args.config)
        if settings.database_url:
            raise BackupError("the memory is in PostgreSQL (MEMPROXY_DATABASE_URL): back it up"
                              " with pg_dump; this command copies the embedded SQLite file")
        done = backup(settings.db_path, args.dest)
    except (SettingsError, BackupError, OSError) as exc:
        print(f"memproxy: backup failed: {exc}", file=sys.stderr)
        return 1
    print(f"Backed up {count(done.turns, 'turn')} ({done.size / 1e6:.1f} MB) to {done.path} in"
          f" {done.seconds:.1f} s. A server started on it (MEMPROXY_DATA_DIR={args.dest})"
          f" rebuilds the vector index first: {count(done.rebuild_jobs, 'queued job')}.")
    return 0


def migrate_command(args: argparse.Namespace) -> int:
    """Copy MEMPROXY_DATA_DIR's memory into PostgreSQL (memory/admin/migrate.py)."""
    from memory import CopiedBatch, MigrateError, migrate

    copied = 0

    def progress(batch: CopiedBatch) -> None:
        nonlocal copied
        copied += batch.inserted
        print(f"  {batch.table}: {batch.inserted} of {batch.rows} new", file=sys.stderr)

    try:
        settings = load_settings(config_file=args.config)
        if settings.database_url:
            raise MigrateError("MEMPROXY_DATABASE_URL is set: this command copies the embedded"
                               " SQLite file of MEMPROXY_DATA_DIR; unset it")
        if not args.dest_url.startswith(("postgresql://", "postgres://")):
            raise MigrateError(f"DEST_URL is postgresql://..., not {args.dest_url!r}")
        done = migrate(settings, args.dest_url, chroma_url=args.chroma_url,
                       batch_size=max(1, args.batch_size), on_batch=progress)
    except (SettingsError, MigrateError, OSError) as exc:
        kept = (f" ({copied} rows and vectors copied stay; run it again to go on)" if copied
                else "")
        print(f"memproxy: migrate failed: {exc}{kept}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("memproxy: migrate interrupted; run it again to go on", file=sys.stderr)
        return 130
    print(_copied_table(done))
    print(f"Done in {done.seconds:.1f} s. Start memproxy with MEMPROXY_DATABASE_URL=DEST_URL"
          + (f" and MEMPROXY_CHROMA_URL={args.chroma_url}." if args.chroma_url else
             f" and the same MEMPROXY_DATA_DIR={settings.data_dir} (its embedded Chroma)."))
    return 0


def _copied_table(done: MigrateResult) -> str:
    """What migrate copied, as columns as wide as their longest value."""
    rows = [["TABLE", "SOURCE", "DEST", "COPIED"]]
    rows += [[table, str(count), str(done.dest_rows[table]), str(done.copied_rows[table])]
             for table, count in done.source_rows.items()]
    rows += [[f"vectors {collection}", "", "", str(count)]
             for collection, count in done.copied_vectors.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join([row[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(row[1:], widths[1:],
                                                                          strict=True))]).rstrip()
        for row in rows
    )


def _stores_answer(settings: Settings) -> str | None:
    """Why PostgreSQL or the Chroma server will not do, in one line (None: they answer)."""
    if not (settings.database_url or settings.chroma_url):
        return None
    from memory import CannotOpen, check_stores

    try:
        asyncio.run(check_stores(settings))
    except CannotOpen as exc:
        return str(exc)
    return None


def serve_command(args: argparse.Namespace) -> int:
    """Start uvicorn with the app."""
    import uvicorn

    from proxy.app import begin_shutdown, create_app
    from proxy.http.serving import cap_malloc_arenas, uvicorn_config
    from proxy.http.shutdown import Shutdown

    class Server(uvicorn.Server):
        """uvicorn's server, starting the app's shutdown clock when the signal arrives (not
        when its main loop next looks), so streams and jobs share one grace from then."""

        signalled_at: float | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signalled_at = self.signalled_at or time.monotonic()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            begin_shutdown(app, self.signalled_at)
            await super().shutdown(sockets)

    try:
        settings = load_settings(config_file=args.config,
                                 flags={"host": args.host, "port": args.port})
    except SettingsError as exc:
        print(f"memproxy: {exc}", file=sys.stderr)
        return 2
    for warning in unknown_env_warnings(os.environ):
        print(f"memproxy: warning: {warning}", file=sys.stderr)
    if (refusal := start_refusal(settings)) is not None:
        print(f"memproxy: {refusal}", file=sys.stderr)
        return 2
    if problem := _stores_answer(settings):
        print(f"memproxy: cannot start: {problem}", file=sys.stderr)
        return 1
    # uvicorn re-raises the SIGTERM that stopped it once its graceful shutdown is done, which
    # would end a clean drain as "killed by a signal" (143); a finished shutdown exits 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    cap_malloc_arenas()  # before any thread: the embedding threads' arenas stay small
    app = create_app(settings)
    config = uvicorn_config(
        app, settings,
        # The app ends its streams at the cut (proxy/http/shutdown.py); uvicorn cancels what else
        # still runs (a reply not yet started) then too. A float: int() would turn a grace
        # under a second into 0; asyncio.wait_for takes any number.
        timeout_graceful_shutdown=Shutdown(settings.shutdown_grace_seconds).work_seconds,
    )
    Server(config).run()
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())

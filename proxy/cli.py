"""The `memproxy` command line: `memproxy serve`, and `memories`, `sessions` and `stats`
against a running server (proxy/cli_memory.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from config import SettingsError, load_settings
from proxy import cli_memory


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="memproxy", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("--host", help="address to bind (MEMPROXY_HOST)")
    serve.add_argument("--port", type=int, help="port to listen on (MEMPROXY_PORT)")
    serve.add_argument("--config", type=Path, help="TOML settings file (MEMPROXY_CONFIG)")
    cli_memory.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `memproxy` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return cli_memory.run(args)


def serve(args: argparse.Namespace) -> int:
    """Start uvicorn with the app."""
    import uvicorn

    from proxy.app import create_app

    try:
        settings = load_settings(config_file=args.config)
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        if overrides:
            settings = settings.replace(**overrides)
    except SettingsError as exc:
        print(f"memproxy: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port,
        log_level=settings.log_level, access_log=False, server_header=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The memory API's client for the command line: requests, errors, output and uploads."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx

from proxy.cli.render import Progress

DEFAULT_URL = "http://127.0.0.1:8080"
UPLOAD_CHUNK = 256 * 1024
# The status of a command whose output pipe was closed (`memproxy stats | head -1`): what a
# shell reports for a tool ended by SIGPIPE, 128 + 13.
CLOSED_PIPE = 141


class CliError(Exception):
    """The server answered with an error, or could not be reached."""


class UsageError(Exception):
    """The command line asks for something it may not (exit status 2, as argparse's)."""


class MemoryClient:
    """httpx against /v1/memory with the key and the user of the command line."""

    api, timeout, for_user = "/v1/memory", 300.0, True

    def __init__(self, args: argparse.Namespace) -> None:
        url = (args.url or os.environ.get("MEMPROXY_URL") or DEFAULT_URL).rstrip("/")
        key = args.key or os.environ.get("MEMPROXY_KEY")
        wanted = {"Authorization": key and f"Bearer {key}",
                  "X-Memory-User-Id": self.for_user and args.user,
                  "X-Memory-Org-Id": self.for_user and args.org}
        headers = {name: value for name, value in wanted.items() if value}
        self.http = httpx.Client(base_url=url + self.api, headers=headers, timeout=self.timeout)

    def admin_url(self, path: str) -> str:
        """The absolute URL of an admin API path (/v1/admin/...)."""
        return str(self.http.base_url).removesuffix("/").removesuffix("/v1/memory") + "/v1/admin" + path

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; the JSON answer, or CliError with the server's message."""
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach memproxy at {self.http.base_url}: {exc}") from None
        _check(response)
        return response.json()

    def pages(
        self, path: str, params: dict[str, Any], limit: int | None = None
    ) -> list[dict[str, Any]]:
        """A listing's items, following its cursor until there are `limit` (None: all)."""
        items: list[dict[str, Any]] = []
        while limit is None or len(items) < limit:
            page = self.call("GET", path, params=params)
            items += page["data"]
            if not page["has_more"]:
                break
            params["cursor"] = page["next_cursor"]
        return items[:limit]

    def stream(self, path: str) -> Iterator[bytes]:
        """The lines of a streamed answer, without their newline."""
        try:
            with self.http.stream("GET", path) as response:
                if response.is_error:
                    response.read()
                    _check(response)
                # Split on b"\n" only: httpx's iter_lines also splits at U+2028 inside JSON.
                pending = b""
                for chunk in response.iter_bytes():
                    *lines, pending = (pending + chunk).split(b"\n")
                    yield from lines
                if pending:
                    yield pending
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach memproxy at {self.http.base_url}: {exc}") from None


class AdminClient(MemoryClient):
    """httpx against /v1/admin with the command line's key (its --user and --org, where a
    command has them, describe a key, not whose memory)."""

    api, timeout, for_user = "/v1/admin", 60.0, False


Client = TypeVar("Client", bound=MemoryClient)
Handler = Callable[[Client, argparse.Namespace], None]  # one command: prints, or raises


def _check(response: httpx.Response) -> None:
    if not response.is_error:
        return
    try:
        error = response.json()["error"]
        message = f"{error['message']} ({response.status_code} {error.get('code') or ''})".strip()
    except (ValueError, KeyError, TypeError):
        message = f"HTTP {response.status_code}: {response.text[:200]}"
    if response.status_code == 401:
        # The server speaks HTTP ("a Bearer token"); the command line takes --key.
        message += "; give the key with --key or MEMPROXY_KEY"
    raise CliError(message)


def given(**options: Any) -> dict[str, Any]:
    """The options the command line was given (those not None), for a body or a query."""
    return {name: value for name, value in options.items() if value is not None}


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """`data` as JSON with --json, else `text`."""
    print(json.dumps(data, indent=2, ensure_ascii=False) if args.json else text)


def upload(path: Path) -> tuple[Iterator[bytes], Progress]:
    """The file's bytes in chunks, advancing a progress bar."""
    if str(path) == "-":
        data = sys.stdin.buffer.read()
        return iter([data]), Progress("importing", len(data))
    size = path.stat().st_size
    progress = Progress("uploading", size)

    def chunks() -> Iterator[bytes]:
        with path.open("rb") as handle:
            while chunk := handle.read(UPLOAD_CHUNK):
                progress.advance(len(chunk))
                yield chunk

    return chunks(), progress


def add_action(
    actions: Any, name: str, handler: Handler[Client], client: type[Client], **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand whose `run` gives `handler` a `client` for its arguments."""
    parser: argparse.ArgumentParser = actions.add_parser(name, **kwargs)
    parser.set_defaults(run=partial(run_command, client, handler))
    return parser


def run_command(client_type: type[Client], handler: Handler[Client],
                args: argparse.Namespace) -> int:
    """Run `handler` with a client for `args` and close it: its exit status, errors on stderr
    (0 done, 1 the server said no or could not be reached, 2 usage, CLOSED_PIPE quietly)."""
    client = client_type(args)
    try:
        handler(client, args)
        sys.stdout.flush()  # here, where a closed pipe can be handled, not at exit
    except BrokenPipeError:
        # The reader has gone, as `head` does: stop quietly. Python would flush stdout again
        # at exit and print the error, so stdout now writes to nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE
    except UsageError as exc:
        print(f"memproxy: {exc}", file=sys.stderr)
        return 2
    except (CliError, OSError) as exc:
        print(f"memproxy: {exc}", file=sys.stderr)
        return 1
    finally:
        client.http.close()
    return 0

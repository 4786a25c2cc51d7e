"""The memory panel: static files in proxy/ui served at /ui (no build step)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

UI_DIR = Path(__file__).resolve().parents[1] / "ui"
# Everything the panel loads comes from this origin; the key never leaves it.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self';"
        " connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class PanelFiles(StaticFiles):
    """Static files with the panel's security headers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


async def to_panel(request: Request) -> Response:
    """/ui -> /ui/"""
    return RedirectResponse("/ui/", status_code=308)


def panel_routes() -> list[BaseRoute]:
    """The panel's routes."""
    return [
        Route("/ui", to_panel, methods=["GET", "HEAD"]),
        Mount("/ui", app=PanelFiles(directory=UI_DIR, html=True), name="ui"),
    ]

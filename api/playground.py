"""The playground: a single page (web/index.html) plus the pusher-js browser build.

It holds no secret: the visitor pastes the API token (or opens the URL `coderunner up`
prints, which carries it in the fragment, never sent to the server). But the page holds
that token while it shows what untrusted programs print, so it is served with a Content
Security Policy that runs only its own scripts: the inline ones it was written with (by
their hashes, taken from the file as it is served), pusher-js from this server, nothing
injected. It may talk only to this server and to soketi, and no other page may frame it.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from shared.paths import REPO_ROOT
from shared.settings import Settings

__all__ = ["content_security_policy", "playground_routes"]

_PAGE = REPO_ROOT / "web" / "index.html"
_PUSHER_JS = REPO_ROOT / "clients" / "js" / "node_modules" / "pusher-js" / "dist" / "web" / "pusher.min.js"

# An element's text runs to the first `</script` or `</style` (HTML's raw text elements).
_INLINE = re.compile(r"<(script|style)(\s[^>]*)?>(.*?)</\1", re.DOTALL | re.IGNORECASE)
_ATTRIBUTE = re.compile(r"""\b(src|type)\s*=\s*("[^"]*"|'[^']*'|[^\s>]+)""", re.IGNORECASE)
_SCRIPT_TYPES = {"", "text/javascript", "module", "application/javascript"}


def _hash(text: str) -> str:
    # (Over the text as the browser parsed it: HTML reads every CR LF and lone CR as LF.)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _realtime_source(settings: Settings) -> str:
    """Where the page's pusher-js connects (GET /v1/realtime says the same)."""
    host, port = settings.realtime_host, settings.realtime_port
    try:
        if ipaddress.ip_address(host).version == 6:
            # (A policy cannot name an IPv6 address: any WebSocket server then.)
            return "wss:" if settings.realtime_tls else "ws: wss:"
    except ValueError:
        pass
    return f"{'wss' if settings.realtime_tls else 'ws'}://{host}:{port}"


def content_security_policy(page: str, settings: Settings) -> str:
    scripts: list[str] = []
    styles: list[str] = []
    for match in _INLINE.finditer(page):
        tag, attributes, text = match.group(1).lower(), match.group(2) or "", match.group(3)
        found = {name.lower(): value.strip("'\"").strip().lower() for name, value in _ATTRIBUTE.findall(attributes)}
        if tag == "style":
            styles.append(_hash(text))
        elif "src" not in found and found.get("type", "") in _SCRIPT_TYPES:
            scripts.append(_hash(text))  # (a text/plain sample is data, never run)
    return "; ".join(
        [
            "default-src 'none'",
            " ".join(["script-src 'self'", *scripts]),
            " ".join(["style-src", *styles]) if styles else "style-src 'none'",
            f"connect-src 'self' {_realtime_source(settings)}",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )


class _Served:
    """A small file read once and again whenever it changes (its mtime and size), sent
    whole: a Range header is ignored (as HTTP allows), so no malformed one can earn a
    plain-text error outside the API's JSON envelope."""

    def __init__(self, path: Path, with_policy: Settings | None = None) -> None:
        self._path = path
        self._settings = with_policy
        self._key: tuple[int, int] | None = None
        self.body = b""
        self.policy = ""

    def fresh(self) -> bool:
        """Whether the file is there (read again if it changed)."""
        try:
            info = self._path.stat()
        except FileNotFoundError:
            return False
        key = (info.st_mtime_ns, info.st_size)
        if key != self._key:
            self.body = self._path.read_bytes()
            if self._settings is not None:
                self.policy = content_security_policy(self.body.decode("utf-8"), self._settings)
            self._key = key
        return True


def playground_routes(settings: Settings) -> list[BaseRoute]:
    page_file = _Served(_PAGE, with_policy=settings)
    pusher_file = _Served(_PUSHER_JS)

    async def page(request: Request) -> Response:
        if not page_file.fresh():
            return Response("playground not installed", status_code=404)
        headers = {
            "cache-control": "no-cache",
            "content-security-policy": page_file.policy,
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
        }
        return Response(page_file.body, media_type="text/html", headers=headers)

    async def pusher(request: Request) -> Response:
        if not pusher_file.fresh():
            return Response("pusher-js not installed (run `make deps`)", status_code=404)
        return Response(pusher_file.body, media_type="application/javascript", headers={"x-content-type-options": "nosniff"})

    return [
        Route("/", page, methods=["GET"]),
        Route("/static/pusher.min.js", pusher, methods=["GET"]),
    ]

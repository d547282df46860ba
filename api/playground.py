"""The playground: a single page (web/index.html) plus the pusher-js browser build.

It holds no secret: the visitor pastes the API token (or opens the URL `coderunner up`
prints, which carries it in the fragment, never sent to the server).
"""

from __future__ import annotations

from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Route

from shared.paths import REPO_ROOT

__all__ = ["playground_routes"]

_PAGE = REPO_ROOT / "web" / "index.html"
_PUSHER_JS = REPO_ROOT / "clients" / "js" / "node_modules" / "pusher-js" / "dist" / "web" / "pusher.min.js"


async def _page(request: object) -> Response:
    if not _PAGE.exists():
        return Response("playground not installed", status_code=404)
    return FileResponse(_PAGE, media_type="text/html", headers={"cache-control": "no-cache"})


async def _pusher(request: object) -> Response:
    if not _PUSHER_JS.exists():
        return Response("pusher-js not installed (run `make deps`)", status_code=404)
    return FileResponse(_PUSHER_JS, media_type="application/javascript")


def playground_routes() -> list[BaseRoute]:
    return [
        Route("/", _page, methods=["GET"]),
        Route("/static/pusher.min.js", _pusher, methods=["GET"]),
    ]

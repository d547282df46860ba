"""`coderunner api`: serve the HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

import uvicorn

from api.app import create_app
from api.server import guarded_protocol
from shared.errors import ConfigError
from shared.logs import configure_logging
from shared.settings import load_settings

__all__ = ["main"]


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on a stop signal first tells the app's long waits to end
    (app.state.draining: `/output?waitMs` answers a 503 to ask again, an event stream ends for
    its EventSource to reconnect, to another process or this one restarted). Without it,
    uvicorn waited for them to end by themselves: one open stream held a restart for its
    whole life, the API refusing every start meanwhile."""

    def __init__(self, config: uvicorn.Config, draining: asyncio.Event) -> None:
        super().__init__(config)
        self._draining = draining

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._draining.set()
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coderunner api", description="Serve the coderunner HTTP API.")
    parser.add_argument("--host", help="bind address (default API_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="bind port (default API_PORT or 8000)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(os.environ)
        configure_logging(settings.log_level)
        app = create_app(settings)
    except ConfigError as exc:
        print(f"coderunner api: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=args.host or settings.api_host,
        port=args.port or settings.api_port,
        log_level=settings.log_level.lower(),
        access_log=False,
        loop="uvloop",
        # httptools with header and body read timeouts and a send timeout (api/server.py).
        http=guarded_protocol(
            settings.api_header_timeout_ms,
            settings.api_body_timeout_ms,
            settings.api_send_timeout_ms,
            settings.api_max_connections,
        ),
        lifespan="on",
        timeout_graceful_shutdown=settings.api_shutdown_grace_ms / 1000,
    )
    _DrainingServer(config, app.state.draining).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`coderunner api`: serve the HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import os
import sys

import uvicorn

from api.app import create_app
from api.server import guarded_protocol
from shared.errors import ConfigError
from shared.logs import configure_logging
from shared.settings import load_settings

__all__ = ["main"]


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
    uvicorn.run(
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
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

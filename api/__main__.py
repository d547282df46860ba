"""`coderunner api`: serve the HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import sys

import uvicorn

from api.app import create_app
from api.server import guarded_protocol
from shared.errors import ConfigError, ManifestError
from shared.logs import configure_logging
from shared.settings import Settings, load_settings

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


# Descriptors besides the connections and the pools' Redis connections: the listening
# socket, the event loop's, the command connection to Redis, logs, the playground's files.
OPEN_FILES_MARGIN = 256


def raise_open_files(settings: Settings) -> int:
    """Raise this process's soft limit on open files to what the settings let it hold at
    once (every connection API_MAX_CONNECTIONS admits, and a Redis connection for each
    event stream and output wait); the limit it then has. Under Debian's usual 1024 the
    connection cap was never reached: accept() failed first, before its 503 could be sent.

    Raises:
        ConfigError: the hard limit is below that (lower the caps, or raise `ulimit -Hn`).
    """
    needed = settings.api_max_connections + settings.max_event_streams + settings.max_output_waits + OPEN_FILES_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(
            f"API_MAX_CONNECTIONS ({settings.api_max_connections}), MAX_EVENT_STREAMS ({settings.max_event_streams}) "
            f"and MAX_OUTPUT_WAITS ({settings.max_output_waits}) need {needed} open files, but this process may "
            f"open at most {hard} (ulimit -Hn): lower them, or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coderunner api", description="Serve the coderunner HTTP API.")
    parser.add_argument("--host", help="bind address (default API_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="bind port (default API_PORT or 8000)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(os.environ)
        configure_logging(settings.log_level)
        raise_open_files(settings)
        app = create_app(settings)
    except (ConfigError, ManifestError) as exc:
        print(f"coderunner api: {exc}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        # (The language manifests could not be read: an unreadable folder or file.)
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

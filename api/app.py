"""The Starlette application factory."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import Authenticator
from api.blobs import BlobStore
from api.body import BodyBudget
from api.catalog import Catalog, load_manifests
from api.errors import exception_handlers
from api.events import BLOCK_MS
from api.playground import playground_routes
from api.realtime import RealtimePublisher
from api.routes import OUTPUT_WAIT_SLICE_MS, routes
from api.state import AppState
from api.store import JobStore
from api.streams import EventPace, StreamSlots
from api.sweeper import RealtimeSweeper
from leanredis import BlockingLeanRedis, LeanRedis
from shared.errors import ConfigError
from shared.paths import profiles_dir
from shared.settings import Settings

__all__ = ["create_app"]

# A dropped connection (Redis restarting, a proxy closing idle sockets) is re-dialled and
# the command retried a few times before a request sees a 503.
_RECONNECTING: dict[str, Any] = {
    "retry": Retry(ExponentialBackoff(cap=0.5, base=0.02), 6),
    "retry_on_error": [RedisConnectionError, RedisTimeoutError],
}
# A half-open connection (a peer that vanished without a FIN) must not hang a request: no
# command of the API takes Redis more than a moment, so 5 s without a reply is a dead
# connection, re-dialled and retried as above (every API script is safe to run twice).
_COMMAND_TIMEOUT_S = 5.0


def _blocking_pool(settings: Settings, connections: int, block_ms: int) -> Redis:
    """A bounded pool for reads that block in Redis up to `block_ms`: their timeout is the
    block time plus the usual one."""
    return BlockingLeanRedis.from_url(
        settings.redis_url,
        max_connections=connections,
        pool_timeout_s=5,
        socket_timeout=block_ms / 1000 + _COMMAND_TIMEOUT_S,
        socket_connect_timeout=_COMMAND_TIMEOUT_S,
        **_RECONNECTING,
    )


# The least length of the secrets the API signs and checks with. Every job token (which
# browsers hold) is an HMAC under a key derived from EXECUTOR_API_TOKEN (unless
# JOB_TOKEN_SECRET is set), and every channel signature one under PUSHER_SECRET: a short
# secret could be guessed offline from any of them.
MIN_SECRET_CHARS = 16


def _check_secrets(settings: Settings) -> None:
    for name, value, required in (
        ("EXECUTOR_API_TOKEN", settings.api_token, True),
        ("PUSHER_SECRET", settings.pusher_secret, True),
        ("JOB_TOKEN_SECRET", settings.job_token_secret, False),
        ("METRICS_TOKEN", settings.metrics_token, False),
    ):
        if not value:
            if required:
                raise ConfigError(f"{name} must be set")
            continue
        if len(value) < MIN_SECRET_CHARS:
            raise ConfigError(f"{name} must be at least {MIN_SECRET_CHARS} characters")
    for name, token in (("EXECUTOR_API_TOKEN", settings.api_token), ("METRICS_TOKEN", settings.metrics_token)):
        # A bearer token travels in a header: one with a space, a line break (a secret made
        # from a file) or a character outside printable ASCII could never be sent.
        if token and not (token.isascii() and token.isprintable() and " " not in token):
            raise ConfigError(f"{name} must be printable ASCII without spaces or line breaks")


def create_app(settings: Settings) -> Starlette:
    _check_secrets(settings)
    manifests = load_manifests(profiles_dir(settings))
    if not manifests:
        raise ConfigError(f"no language manifests found in {profiles_dir(settings) / 'languages'}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Every request's short commands share one pipelined connection (leanredis/); no
        # command on it blocks in Redis.
        redis = LeanRedis.from_url(
            settings.redis_url,
            socket_timeout=_COMMAND_TIMEOUT_S,
            socket_connect_timeout=_COMMAND_TIMEOUT_S,
            **_RECONNECTING,
        )
        # Event streams block in XREAD for seconds at a time: they get their own bounded pool,
        # so however many are open, the rest of the API keeps its connections. Their reads
        # wait out the XREAD block first, so their timeout is the block time plus the above.
        streams = _blocking_pool(settings, settings.max_event_streams, BLOCK_MS)
        # Long-polls for a result block on the job's done stream: a pool of their own, so
        # however many wait, event streams keep theirs (each side is admitted, api/streams.py).
        waits = _blocking_pool(settings, settings.max_output_waits, OUTPUT_WAIT_SLICE_MS)
        store = JobStore(
            redis, settings.job_record_ttl_s, streams=streams, waits=waits, publish_timeout_ms=settings.pusher_timeout_ms
        )
        realtime = RealtimePublisher(settings)
        sweeper = RealtimeSweeper(store, realtime, settings.realtime_sweep_ms)
        app.state.coderunner = AppState(
            settings=settings,
            redis=redis,
            store=store,
            catalog=Catalog(manifests, store),
            auth=Authenticator(settings),
            realtime=realtime,
            blobs=BlobStore(redis, settings),
        )
        app.state.event_streams = StreamSlots.event_streams(settings)
        app.state.event_pace = EventPace(settings.max_event_rate)
        app.state.output_waits = StreamSlots.output_waits(settings)
        app.state.artifact_downloads = StreamSlots.artifact_downloads(settings)
        app.state.blob_uploads = StreamSlots.blob_uploads(settings)
        app.state.request_bodies = BodyBudget(
            settings.max_bodies_in_flight_mb * 1024 * 1024, settings.max_small_bodies_in_flight_mb * 1024 * 1024
        )
        sweeper.start()
        try:
            yield
        finally:
            await sweeper.aclose()
            await realtime.aclose()
            await waits.aclose()
            await streams.aclose()
            await redis.aclose()

    app = Starlette(
        routes=[*routes, *playground_routes(settings)],
        exception_handlers=exception_handlers,
        lifespan=lifespan,
        middleware=_cors(settings),
    )
    # Set when the server stops (api/__main__.py): long waits end then, not at their end.
    app.state.draining = asyncio.Event()
    return app


class _CorsForJobs:
    """CORS on the job API (`/v1/...`) only: /health and /metrics (open unless METRICS_TOKEN
    is set) stay unreadable to other origins' pages, even with `*`, as does soketi's webhook."""

    def __init__(self, app: ASGIApp, **options: Any) -> None:
        self._app = app
        self._cors = CORSMiddleware(app, **options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v1/") and not path.startswith("/v1/realtime/webhooks"):
            await self._cors(scope, receive, send)
        else:
            await self._app(scope, receive, send)


def _cors(settings: Settings) -> list[Middleware]:
    """Browsers on CORS_ALLOW_ORIGINS may call the API (a page holding a job token). Bearer
    tokens, never cookies: no credentials mode, so "*" gives a page nothing it does not
    already hold."""
    if not settings.cors_allow_origins:
        return []
    return [
        Middleware(
            _CorsForJobs,
            allow_origins=list(settings.cors_allow_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            expose_headers=["Idempotent-Replayed", "Retry-After"],
            max_age=600,
        )
    ]
